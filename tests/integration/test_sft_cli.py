"""`llmtune sft` through the CLI on a tiny random Llama: run dir, adapter vs base weights, resume, export."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model
from llmtune.utils import read_jsonl
from tests.integration.flops_expect import PEAK, check_mfu

QA = [("What is 2 + 3?", "It is 5."), ("Say hello.", "Hello! How are you today?"),
      ("What is 12 * 7?", "12 * 7 = 84. #### 84"), ("Name a color.", "The sea is blue.")]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model_dir = save_tiny_model(root / "model")
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
            for _ in range(6) for q, a in QA]
    (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    recipe = {
        "stage": "sft",
        "model": {"name_or_path": str(model_dir)},
        "data": {"datasets": [{"path": str(root / "data.jsonl")}], "max_length": 64, "val_size": 4},
        "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2,
                  "save_steps": 1, "eval_steps": 1, "save_total_limit": 5},
        "output": {"dir": str(root / "run")},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with pytest.MonkeyPatch.context() as mp:  # a peak, so that metrics.jsonl has an MFU (test_mfu_is_logged)
        mp.setenv("LLMTUNE_PEAK_TFLOPS", str(PEAK))
        assert main(["sft", str(root / "recipe.yaml")]) == 0
    return root


def test_run_dir_contents(workspace):
    run = workspace / "run"
    assert sorted(p.name for p in run.iterdir()) == sorted([
        "recipe.resolved.yaml", "data_report.json", "metrics.jsonl", "plots", "checkpoints", "adapter", "lineage.json"])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    adapter = {p.name for p in (run / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "chat_template.jinja"} <= adapter
    resolved = yaml.safe_load((run / "recipe.resolved.yaml").read_text())
    assert resolved["train"]["max_steps"] == 2 and resolved["train"]["lr_scheduler"] == "cosine"  # defaults included
    lineage = json.loads((run / "lineage.json").read_text())
    assert lineage["stage"] == "sft" and lineage["summary"]["steps"] == 2
    assert lineage["base_model"]["kind"] == "local"
    assert len(lineage["data"][0]["sha256"]) == 64
    summary = lineage["summary"]  # train.gradient_checkpointing: auto (default); a tiny model fits in any RAM
    assert summary["gradient_checkpointing"] is False
    assert summary["memory_estimate_gb"] == summary["memory_estimate"]["without_checkpointing_gb"] > 0


def test_metrics_have_eval_before_and_after_and_training_fields(workspace):
    records = read_jsonl(workspace / "run" / "metrics.jsonl")
    evals = [r for r in records if "eval_loss" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 2
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["trained_tokens"] > 0 and r["tokens_per_s"] > 0 and r["peak_mem_gb"] > 0 and r["grad_norm"] > 0
    for r in evals:
        assert r["eval_ppl"] == pytest.approx(2.718281828 ** r["eval_loss"], rel=1e-6)


def test_mfu_is_logged(workspace):
    check_mfu(read_jsonl(workspace / "run" / "metrics.jsonl"), workspace / "model", "tokens_per_s", lora_r=4)


def test_adapter_changed_base_did_not(workspace):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    weights = load_file(str(workspace / "run" / "adapter" / "adapter_model.safetensors"))
    lora_b = {k: v for k, v in weights.items() if "lora_B" in k}
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b.values())  # lora_B starts at zero
    base = AutoModelForCausalLM.from_pretrained(workspace / "model", dtype=torch.float32)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    peft = PeftModel.from_pretrained(base, workspace / "run" / "adapter")
    after = peft.get_base_model().state_dict()
    for key, value in before.items():
        base_key = key if key in after else key.replace(".weight", ".base_layer.weight")
        torch.testing.assert_close(after[base_key], value, rtol=0, atol=0)


def test_resume_from_checkpoint_continues_the_same_run(workspace, tmp_path):
    recipe = workspace / "recipe.yaml"
    # resume the 2-step run's checkpoint-1 into a fresh dir and train to step 2: same loss as the original step 2
    src = workspace / "run" / "checkpoints" / "checkpoint-1"
    out = tmp_path / "resumed"
    assert main(["sft", str(recipe), f"output.dir={out}", f"train.resume_from={src}"]) == 0
    original = [r for r in read_jsonl(workspace / "run" / "metrics.jsonl") if "loss" in r]
    resumed = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["loss"] == pytest.approx(original[1]["loss"], rel=1e-5)
    assert json.loads((out / "lineage.json").read_text())["summary"]["steps"] == 2


def test_existing_run_dir_is_not_overwritten(workspace, capsys):
    assert main(["sft", str(workspace / "recipe.yaml")]) == 1
    assert "already holds a run" in capsys.readouterr().err


def test_export_matches_adapter_model(workspace):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert main(["export", str(workspace / "run")]) == 0
    merged_dir = workspace / "run" / "merged"
    report = json.loads((merged_dir / "verification.json").read_text())
    assert report["passed"] and report["max_abs_diff"] <= 1e-4 and report["dtype"] == "fp32"
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(workspace / "model", dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, workspace / "run" / "adapter").eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft(input_ids=ids).logits, atol=1e-4, rtol=0)
    # merged weight == W + scale * B @ A in fp32
    layer = peft.base_model.model.model.layers[0].self_attn.q_proj
    expected = layer.base_layer.weight + layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    torch.testing.assert_close(merged.model.layers[0].self_attn.q_proj.weight, expected, atol=1e-6, rtol=0)
    gen = json.loads((merged_dir / "generation_config.json").read_text())
    tok = json.loads((merged_dir / "tokenizer_config.json").read_text())
    assert gen["eos_token_id"] == [1] or gen["eos_token_id"] == 1  # <|im_end|> of the tiny ChatML tokenizer
    assert (merged_dir / "chat_template.jinja").is_file() or "chat_template" in tok


@pytest.mark.parametrize("command", ["sft", "validate", "export", "chat"])
def test_help_exits_zero(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    if command in ("sft", "validate"):
        assert "model.name_or_path" in out and "train.global_batch_size" in out and "data.datasets.N.columns" in out


def test_validate_reports_bad_rows_and_exits_nonzero(workspace, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    rows = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
            {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": {"k": 1}}]}]
    bad.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert main(["validate", str(workspace / "recipe.yaml"), f"data.datasets.0.path={bad}", "data.val_size=0", "train.eval_steps=null",
                 f"output.dir={tmp_path / 'v'}"]) == 1
    err = capsys.readouterr().err
    assert "row 1" in err and "row 2" in err and str(bad) in err


def test_packed_sft_trains_through_the_cli(workspace, tmp_path):
    out = tmp_path / "packed"
    assert main(["sft", str(workspace / "recipe.yaml"), f"output.dir={out}", "data.packing=true",
                 "train.save_steps=null", "data.val_size=0", "train.eval_steps=null", "output.report_to=[tensorboard]"]) == 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    report = json.loads((out / "data_report.json").read_text())
    assert report["packing"] is True and report["train_sequences"] < report["train_rows"]
    records = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert len(records) == 2 and all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in records)


def test_export_bf16_casts_once_from_fp32_merge(workspace, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "bf16"
    assert main(["export", str(workspace / "run"), "--dtype", "bf16", "--out", str(out)]) == 0
    report = json.loads((out / "verification.json").read_text())
    assert report["passed"] and report["dtype"] == "bf16"
    weights = load_file(str(out / "model.safetensors"))
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.bfloat16
    base = AutoModelForCausalLM.from_pretrained(workspace / "model", dtype=torch.float32)
    layer = PeftModel.from_pretrained(base, workspace / "run" / "adapter").base_model.model.model.layers[0].self_attn.q_proj
    fp32 = layer.base_layer.weight + layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight
    assert torch.equal(q, fp32.detach().to(torch.bfloat16))  # merged in fp32, rounded once


def test_validate_reports_an_occupied_output_dir_after_checking_the_data(workspace, capsys):
    assert main(["validate", str(workspace / "recipe.yaml")]) == 1
    captured = capsys.readouterr()
    assert "data:" in captured.out  # the data was still checked and reported
    assert "output.dir" in captured.err and "already holds a run" in captured.err


def test_resume_refuses_a_changed_recipe(workspace, tmp_path):
    import shutil

    from llmtune.config import RecipeError

    copy = tmp_path / "copy"
    shutil.copytree(workspace / "run", copy)
    args = ["sft", str(workspace / "recipe.yaml"), f"output.dir={copy}", "train.resume_from=latest"]
    with pytest.raises(RecipeError) as info:  # the CLI prints it; main() returns 1 — check the problems themselves
        from llmtune.config import load_recipe
        from llmtune.core.rundir import RunDir

        recipe = load_recipe(workspace / "recipe.yaml", [*args[2:], "train.learning_rate=0.5", "data.max_length=32"])
        RunDir(copy).check_resume_recipe(recipe.model_dump(mode="json"))
    assert dict(info.value.problems).keys() == {"train.learning_rate", "data.max_length"}
    assert main([*args, "train.learning_rate=0.5"]) == 1
    assert main([*args, "train.max_steps=3"]) == 0  # extending a run is allowed
    assert json.loads((copy / "lineage.json").read_text())["summary"]["trained_tokens"] > 0


def test_overrides_collect_all_problems_and_accept_brackets():
    from llmtune.config import RecipeError, load_recipe

    with pytest.raises(RecipeError) as info:
        load_recipe(raw={"train": {"lr": 1}}, overrides=["train.max_steps", "data.datasets.5.path=x", "train.seed="])
    paths = [p for p, _ in info.value.problems]
    assert paths == ["train.max_steps", "data.datasets.5.path", "train.seed", "train.lr"]
    recipe = load_recipe(raw={}, overrides=["data.datasets[0].path=x.jsonl"])
    assert recipe.data.datasets[0].path == "x.jsonl"


def test_validate_caches_the_tokenized_data_and_training_reuses_it(workspace, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LLMTUNE_DATA_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "cached"
    args = [str(workspace / "recipe.yaml"), f"output.dir={out}", "train.save_steps=null", "train.eval_steps=null"]
    assert main(["validate", *args]) == 0
    assert "tokenized sft data cached in" in capsys.readouterr().err
    assert main(["sft", *args]) == 0
    assert "tokenized sft data reused from the cache" in capsys.readouterr().err
    report = json.loads((out / "data_report.json").read_text())
    reference = json.loads((workspace / "run" / "data_report.json").read_text())  # built and tokenized by the fixture
    assert report == reference
    assert [r["trained_tokens"] for r in read_jsonl(out / "metrics.jsonl") if "loss" in r] == \
        [r["trained_tokens"] for r in read_jsonl(workspace / "run" / "metrics.jsonl") if "loss" in r]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU peak (resident set)")
def test_a_stage_reports_its_own_peak_memory_not_an_earlier_one_of_the_same_process(workspace, tmp_path):
    """`llmtune pipeline` runs its steps in one process: a step's peak_mem_gb must not include what an earlier step
    (here a 2 GiB block, freed before the stage starts) held. The old peak (ru_maxrss since the process started)
    reported the block."""
    recipe = yaml.safe_load((workspace / "recipe.yaml").read_text())
    recipe["output"]["dir"] = str(tmp_path / "run2")
    recipe["train"].update(max_steps=1, eval_steps=None, save_steps=1)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    block = torch.ones(2 * 2**30 // 8, dtype=torch.float64)  # 2 GiB, every page touched
    with open("/proc/self/status") as f:  # resident set now, with the block (GiB)
        held = next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**20
    del block
    assert main(["sft", str(tmp_path / "recipe.yaml")]) == 0
    logged = [r["peak_mem_gb"] for r in read_jsonl(tmp_path / "run2" / "metrics.jsonl") if "loss" in r]
    assert logged and max(logged) < held - 1.0, (logged, held)
