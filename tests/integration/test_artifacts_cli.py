"""Artifacts outside llmtune: SFT -> DPO (from_run) and SFT -> RM (from_run) through the CLI on a tiny Llama, then
each stage's export loaded with plain transformers/peft (as a user elsewhere would, from the names the artifacts
record) gives llmtune's numbers: SFT merged logits, RM merged scores, and the chained DPO (and RM) runs via the one
adapter `llmtune export --adapter` writes. Also: adapter_config.json/README.md/tokenizer_config.json/lineage.json are
portable and say what a chained adapter needs."""

import json

import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from llmtune.commands.cli import main
from llmtune.export.merge import load_adapter_model, load_run_recipe, sample_inputs
from llmtune.models.tiny import save_tiny_model

pytestmark = pytest.mark.slow

QA = [("What is 2 + 3?", "It is 5.", "It is 7."), ("Say hello.", "Hello! How are you today?", "No."),
      ("What is 12 * 7?", "12 * 7 = 84. #### 84", "12 * 7 = 74."), ("Name a color.", "The sea is blue.", "Dog.")]
TOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("artifacts")
    model_dir = save_tiny_model(root / "model")
    (root / "pairs.jsonl").write_text("".join(json.dumps({"prompt": f"{q} ({i})", "chosen": c, "rejected": r}) + "\n"
                                              for i in range(3) for q, c, r in QA))
    (root / "sft.jsonl").write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                                      {"role": "assistant", "content": c}]}) + "\n"
                                            for _ in range(3) for q, c, _r in QA))
    train = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 3e-2}
    pair_data = {"datasets": [{"path": str(root / "pairs.jsonl"), "format": "preference"}], "max_length": 64}
    recipes = {
        "sft": {"model": {"name_or_path": str(model_dir)}, "adapter": {"lora_r": 4, "lora_alpha": 8,
                "target_modules": ["q_proj", "v_proj"]},
                "data": {"datasets": [{"path": str(root / "sft.jsonl")}], "max_length": 64}},
        "dpo": {"model": {"from_run": str(root / "sft")}, "data": pair_data,
                "adapter": {"lora_r": 2, "lora_alpha": 8, "use_rslora": True}},  # all-linear, other r/alpha
        "rm": {"model": {"from_run": str(root / "sft")}, "data": pair_data, "adapter": {"lora_r": 2}},
    }
    for stage, recipe in recipes.items():
        path = root / f"{stage}.yaml"
        path.write_text(yaml.safe_dump({"stage": stage, **recipe, "train": train,
                                        "output": {"dir": str(root / stage)}}))
        assert main([stage, str(path)]) == 0, stage
    return root


def chat_inputs(run):
    return sample_inputs(AutoTokenizer.from_pretrained(run / "adapter"))


@torch.no_grad()
def llmtune_outputs(run):
    """What llmtune computes for the run: its chain model (earlier adapters merged in fp32 + its adapter)."""
    model, _, _ = load_adapter_model(run, load_run_recipe(run))
    return [model.eval()(input_ids=x).logits.float() for x in chat_inputs(run)]


def assert_close(got, expected):
    for a, b in zip(got, expected):
        assert float((a - b).abs().max()) <= TOL


def test_stage_adapters_are_portable_and_a_chained_one_says_what_it_needs(runs):
    for stage in ("sft", "dpo", "rm"):
        adapter = runs / stage / "adapter"
        config = json.loads((adapter / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == str((runs / "model").resolve())  # the user's model, not a cache
        tok = json.loads((adapter / "tokenizer_config.json").read_text())
        assert "local_files_only" not in tok and "is_local" not in tok
        assert tok["model_max_length"] == json.loads((runs / "model" / "config.json").read_text())[
            "max_position_embeddings"]
        lineage = json.loads((runs / stage / "lineage.json").read_text())
        assert lineage["versions"]["torch"] == torch.__version__
        assert {"transformers", "peft", "trl", "deepspeed", "bitsandbytes"} <= set(lineage["versions"])
        assert "llmtune_commit" in lineage
        card = (adapter / "README.md").read_text()
        assert card.startswith("---\n") and f"base_model: {(runs / 'model').resolve()}" in card
        needs = "This adapter needs earlier adapters" in card
        assert needs == (stage != "sft")
    assert str((runs / "sft" / "adapter").resolve()) in (runs / "dpo" / "adapter" / "README.md").read_text()


def test_sft_merged_model_gives_llmtunes_logits_in_plain_transformers(runs):
    run = runs / "sft"
    assert main(["export", str(run), "--dtype", "fp32"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(run / "merged").eval()
    with torch.no_grad():
        got = [merged(input_ids=x).logits for x in chat_inputs(run)]
    assert_close(got, llmtune_outputs(run))
    card = (run / "merged" / "README.md").read_text()
    assert "## Usage" in card and "from_pretrained" in card and "## Versions" in card


def test_rm_merged_model_gives_llmtunes_scores_in_plain_transformers(runs):
    run = runs / "rm"
    assert main(["export", str(run), "--dtype", "fp32"]) == 0
    merged = AutoModelForSequenceClassification.from_pretrained(run / "merged").eval()
    with torch.no_grad():  # one unpadded sequence each: the score is read at its last token by both
        got = [merged(input_ids=x).logits.float() for x in chat_inputs(run)]
    expected = llmtune_outputs(run)
    assert all(g.shape == (1, 1) for g in got)
    assert_close(got, expected)


@pytest.mark.parametrize("stage", ["dpo", "rm"])
def test_chained_run_via_the_single_exported_adapter_in_plain_peft(runs, stage):
    run = runs / stage
    assert main(["export", str(run), "--adapter"]) == 0
    out = run / "exported_adapter"
    config = json.loads((out / "adapter_config.json").read_text())
    auto = AutoModelForSequenceClassification if stage == "rm" else AutoModelForCausalLM
    extra = {"num_labels": 1} if stage == "rm" else {}
    base = auto.from_pretrained(config["base_model_name_or_path"], **extra)  # the name the adapter records
    if stage == "rm":
        base.config.pad_token_id = AutoTokenizer.from_pretrained(out).pad_token_id
    plain = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        got = [plain(input_ids=x).logits.float() for x in chat_inputs(run)]
    expected = llmtune_outputs(run)
    assert_close(got, expected)
    # the run's own adapter on the base alone (what a peft user got before) is another model
    alone = PeftModel.from_pretrained(auto.from_pretrained(runs / "model", **extra), run / "adapter").eval()
    with torch.no_grad():
        wrong = [alone(input_ids=x).logits.float() for x in chat_inputs(run)]
    assert max(float((a - b).abs().max()) for a, b in zip(wrong, expected)) > 10 * TOL
    report = json.loads((out / "verification.json").read_text())
    assert report["passed"] and [link["stage"] for link in report["links"]] == ["sft", stage]


def test_push_to_hub_uploads_the_finished_adapter_with_its_card(runs, tmp_path, monkeypatch):
    """output.push_to_hub at the end of a stage, against a mock of huggingface_hub's HfApi (no network)."""
    import huggingface_hub

    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, folder_path, repo_id, **kwargs):
            from pathlib import Path

            calls.append(("upload_folder", repo_id, sorted(p.name for p in Path(folder_path).iterdir())))

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    out = tmp_path / "pushed"
    assert main(["sft", str(runs / "sft.yaml"), f"output.dir={out}", "train.max_steps=1", "output.push_to_hub=true",
                 "output.hub_model_id=me/tiny-sft"]) == 0
    assert calls[0] == ("create_repo", "me/tiny-sft", {"repo_type": "model", "private": True, "exist_ok": True})
    assert calls[1][:2] == ("upload_folder", "me/tiny-sft")
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer_config.json"} <= set(calls[1][2])
