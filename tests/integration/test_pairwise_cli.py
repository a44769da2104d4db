"""`llmtune rm` and `llmtune dpo` through the CLI on a tiny random Llama: run dir, adapters, lineage, export.

The DPO run starts from a tiny SFT run (`model.from_run`): the SFT adapter is merged into the base and is the
reference, so at step 0 every held-out margin is 0 and the loss is log 2.
"""

import json
import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model
from llmtune.utils import read_jsonl
from tests.integration.flops_expect import PEAK, check_mfu
from tests.integration.plots_expect import summary_of

RUN_FILES = ["recipe.resolved.yaml", "data_report.json", "metrics.jsonl", "plots", "checkpoints", "adapter",
             "lineage.json"]
QA = [("What is 2 + 3?", "It is 5.", "It is 7."), ("Say hello.", "Hello! How are you today?", "No."),
      ("What is 12 * 7?", "12 * 7 = 84. #### 84", "12 * 7 = 74."), ("Name a color.", "The sea is blue.", "Dog.")]


def write_recipe(root, name, stage, **sections):
    recipe = {"stage": stage, **sections}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairwise")
    model_dir = save_tiny_model(root / "model")
    pairs = [{"prompt": f"{q} ({i})", "chosen": c, "rejected": r} for i in range(5) for q, c, r in QA]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": c}]}
             for _ in range(4) for q, c, _r in QA]
    (root / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in chats) + "\n")
    common = {
        "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2,
                  "save_steps": 1, "eval_steps": 1, "save_total_limit": 5},
    }
    pair_data = {"datasets": [{"path": str(root / "pairs.jsonl"), "format": "preference"}], "max_length": 64,
                 "val_size": 4}
    sft = write_recipe(root, "sft", "sft", model={"name_or_path": str(model_dir)},
                       data={"datasets": [{"path": str(root / "sft.jsonl")}], "max_length": 64, "val_size": 2},
                       output={"dir": str(root / "sft")}, **common)
    rm = write_recipe(root, "rm", "rm", model={"name_or_path": str(model_dir)}, data=pair_data,
                      rm={"center_rewards_coef": 0.01}, output={"dir": str(root / "rm")}, **common)
    dpo = write_recipe(root, "dpo", "dpo", model={"from_run": str(root / "sft")}, data=pair_data,
                       dpo={"beta": 0.1}, output={"dir": str(root / "dpo")}, **common)
    with pytest.MonkeyPatch.context() as mp:  # a peak, so that metrics.jsonl has an MFU (test_dpo_mfu_is_logged)
        mp.setenv("LLMTUNE_PEAK_TFLOPS", str(PEAK))
        for command, recipe in (("sft", sft), ("rm", rm), ("dpo", dpo)):
            assert main([command, str(recipe)]) == 0, command
    return root


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_run_dir_contents_and_lineage(workspace, stage):
    run = workspace / stage
    assert sorted(p.name for p in run.iterdir()) == sorted(RUN_FILES)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-1", "checkpoint-2"]
    summary = summary_of(run, stage)  # each chosen curve with its held-out points (before training, after each step)
    assert list(summary) == (["loss", "accuracy", "margin"] if stage == "rm" else
                             ["loss", "rewards/accuracies", "rewards/margins", "rewards/chosen, rewards/rejected"])
    assert all(len(p["train"]) == 2 and len(p["eval"]) == 3 for n, p in summary.items() if "," not in n)
    lineage = json.loads((run / "lineage.json").read_text())
    assert lineage["stage"] == stage and lineage["summary"]["steps"] == 2
    assert lineage["base_model"]["path"] == str((workspace / "model").resolve())
    report = json.loads((run / "data_report.json").read_text())
    assert report["train_rows"] == 16 and report["eval_rows"] == 4
    if stage == "rm":
        assert lineage["model_head"] == "score" and lineage["previous_adapters"] == []
        assert "score" in json.loads((run / "adapter" / "adapter_config.json").read_text())["modules_to_save"]
    else:
        assert lineage["model_head"] == "causal_lm"
        assert lineage["from_run"] == str(workspace / "sft")
        assert lineage["previous_adapters"] == [{"stage": "sft", "run_dir": str((workspace / "sft").resolve()),
                                                 "path": str((workspace / "sft" / "adapter").resolve()),
                                                 "adapter_type": "lora"}]
        resolved = yaml.safe_load((run / "recipe.resolved.yaml").read_text())
        assert resolved["model"]["name_or_path"] == str((workspace / "model").resolve())  # inherited


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_adapter_changed(workspace, stage):
    weights = load_file(str(workspace / stage / "adapter" / "adapter_model.safetensors"))
    lora_b = {k: v for k, v in weights.items() if "lora_B" in k}
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b.values())  # lora_B starts at zero
    if stage == "rm":
        assert [k for k in weights if "score" in k] == ["base_model.model.score.weight"]


def test_dpo_mfu_is_logged(workspace):  # policy forward + backward and the reference forward
    check_mfu(read_jsonl(workspace / "dpo" / "metrics.jsonl"), workspace / "model", "tokens_per_s", lora_r=4,
              reference=True)


def test_rm_metrics(workspace):
    records = read_jsonl(workspace / "rm" / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert [r["trained_pairs"] for r in train] == [4, 8] and "trained_tokens" not in train[0]  # 4 pairs per step
    for r in train:
        assert 0 <= r["accuracy"] <= 1 and 0 <= r["ties"] <= 1 and math.isfinite(r["margin"])
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 1, 2, 2]
    for r in evals:
        assert r["eval_pairs"] == 4 and r["eval_accuracy"] + r["eval_ties"] <= 1
        assert {"eval_margin", "eval_chosen", "eval_rejected"} <= set(r)


def test_dpo_metrics_and_reference_is_the_sft_model(workspace):
    records = read_jsonl(workspace / "dpo" / "metrics.jsonl")
    keys = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"]
    train = [r for r in records if "loss" in r]
    assert len(train) == 2 and all(math.isfinite(r[k]) for r in train for k in keys)
    evals = [r for r in records if "eval_loss" in r]
    assert all(math.isfinite(r[f"eval_{k}"]) for r in evals for k in keys)
    start = evals[0]
    assert start["step"] == 0
    # policy == reference (fresh LoRA on the SFT-merged base): loss log 2, all margins 0, no pair "accurate"
    assert start["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert start["eval_rewards/margins"] == 0 and start["eval_rewards/accuracies"] == 0
    assert evals[-1]["eval_rewards/margins"] != 0


def test_dpo_reference_logps_are_the_sft_merged_models(workspace):
    """eval_logps/chosen at step 0 (policy == reference) equals the SFT-merged model's, not the raw base's."""
    from llmtune.config import PrecisionConfig, load_recipe
    from llmtune.core.stage import prepare_tokenizer
    from llmtune.models import load_model, load_model_with_chain
    from llmtune.stages import DPOStage

    run = workspace / "dpo"
    recipe = load_recipe(run / "recipe.resolved.yaml", stage="dpo")
    lineage = json.loads((run / "lineage.json").read_text())
    stage = DPOStage(recipe)
    tokenizer = prepare_tokenizer(recipe)
    data = stage.build_data(tokenizer, str(workspace))
    batch = data.collator([data.eval[i] for i in range(len(data.eval))])
    sft = load_model_with_chain(recipe.model, PrecisionConfig(), lineage["previous_adapters"]).eval()
    base = load_model(recipe.model, PrecisionConfig()).eval()
    with torch.no_grad():
        sft_chosen = stage.logps(sft, batch)[0].mean().item()
        base_chosen = stage.logps(base, batch)[0].mean().item()
    start = [r for r in read_jsonl(run / "metrics.jsonl") if "eval_loss" in r][0]
    assert start["eval_logps/chosen"] == pytest.approx(sft_chosen, abs=1e-4)
    assert abs(base_chosen - sft_chosen) > 1e-2


def test_dpo_resume_from_checkpoint(workspace, tmp_path):
    src = workspace / "dpo" / "checkpoints" / "checkpoint-1"
    out = tmp_path / "resumed"
    assert main(["dpo", str(workspace / "dpo.yaml"), f"output.dir={out}", f"train.resume_from={src}"]) == 0
    original = [r for r in read_jsonl(workspace / "dpo" / "metrics.jsonl") if "loss" in r]
    resumed = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in resumed] == [2]
    assert resumed[0]["loss"] == pytest.approx(original[1]["loss"], rel=1e-5)


def test_dpo_precomputed_reference_gives_the_same_first_step(workspace, tmp_path):
    out = tmp_path / "pre"
    assert main(["dpo", str(workspace / "dpo.yaml"), f"output.dir={out}", "dpo.precompute_ref_logps=true",
                 "train.max_steps=1", "train.save_steps=null"]) == 0
    first = [r for r in read_jsonl(workspace / "dpo" / "metrics.jsonl") if "loss" in r][0]
    pre = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r][0]
    assert pre["loss"] == pytest.approx(first["loss"], abs=1e-5)
    assert pre["grad_norm"] == pytest.approx(first["grad_norm"], rel=1e-4)


def test_rm_export_reloads_as_sequence_classifier_with_identical_scores(workspace):
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification

    from llmtune.models import sequence_scores

    run = workspace / "rm"
    assert main(["export", str(run)]) == 0
    report = json.loads((run / "merged" / "verification.json").read_text())
    assert report["passed"] and report["model_head"] == "score" and report["newly_initialized"] == []
    assert report["max_abs_diff"] <= 1e-4 and report["hf_max_abs_diff"] <= 1e-4
    merged, info = AutoModelForSequenceClassification.from_pretrained(run / "merged", output_loading_info=True)
    assert not info["missing_keys"]  # no newly initialised weights (the head was saved: trl #368)
    base = AutoModelForSequenceClassification.from_pretrained(workspace / "model", num_labels=1)
    adapter = PeftModel.from_pretrained(base, run / "adapter").eval()
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7], [12, 13, 14, 1, 1, 1, 1]])
    mask = torch.tensor([[1] * 7, [1, 1, 1, 0, 0, 0, 0]])
    with torch.no_grad():
        expected = sequence_scores(adapter, ids, mask)
        torch.testing.assert_close(sequence_scores(merged.eval(), ids, mask), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged(input_ids=ids[:1]).logits[:, 0], expected[:1], atol=1e-5, rtol=0)
    assert merged.config.pad_token_id is not None and merged.config.num_labels == 1


def test_exported_rm_scores_like_llmtune_in_plain_transformers_and_in_ppo(workspace, tmp_path):
    """The tiny tokenizer pads with EOS, like SmolLM2. A consumer scores apply_chat_template(conversation,
    tokenize=True) with AutoModelForSequenceClassification (logits[:, 0]), alone or in right/left-padded batches
    with the saved pad token; llmtune scores the same conversation as PPO and on-policy pairs do (RewardModel, by
    text and by token ids of a generated reply). All agree, also for ids that end in EOS."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from llmtune.export.merge import padded_batch
    from llmtune.models import sequence_scores
    from llmtune.models.reward import RewardModel

    run, out = workspace / "rm", tmp_path / "merged"
    assert main(["export", str(run), "--out", str(out)]) == 0
    report = json.loads((out / "verification.json").read_text())
    assert report["passed"] and max(report["hf_max_abs_diff_by_padding"].values()) <= 1e-4
    model = AutoModelForSequenceClassification.from_pretrained(out).eval()
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.pad_token_id == model.config.pad_token_id != tok.eos_token_id  # old code: pad == EOS
    rm = RewardModel(run)
    prompts = [[{"role": "user", "content": q}] for q, _c, _r in QA]
    answers = [c for _q, c, _r in QA]
    ours = rm.score_texts(prompts, answers)  # (B,)
    rows = [torch.tensor([tok.apply_chat_template([*p, {"role": "assistant", "content": a}], tokenize=True,
                                                  return_dict=True)["input_ids"]]) for p, a in zip(prompts, answers)]
    assert all(int(r[0, -2]) == tok.eos_token_id for r in rows)  # ChatML: "<|im_end|>\n"
    ending_in_eos = [r[:, :-1] for r in rows]
    with torch.no_grad():
        alone = torch.cat([model(input_ids=r).logits[:, 0] for r in rows])
        torch.testing.assert_close(alone, ours, atol=1e-4, rtol=0)  # old code: read at <|im_end|> vs "\n"
        for side in ("right", "left"):
            ids, mask = padded_batch(rows, tok.pad_token_id, side)
            torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits[:, 0], ours, atol=1e-4,
                                       rtol=0, msg=side)
            ids, mask = padded_batch(ending_in_eos, tok.pad_token_id, side)  # old code: pooled one token early
            torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits[:, 0],
                                       sequence_scores(model, ids, mask), atol=1e-4, rtol=0, msg=side)
        # PPO with the RM's tokenizer: left-padded prompt ids + the generated reply up to its <|im_end|>
        queries = [torch.tensor([tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True,
                                                         return_dict=True)["input_ids"]]) for p in prompts]
        replies = [torch.tensor([tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]) for a in answers]
        query_ids, query_mask = padded_batch(queries, tok.eos_token_id, "left")
        reply_ids, reply_mask = padded_batch(replies, tok.eos_token_id, "right")
        scored = rm.score_rollouts(torch.cat([query_ids, reply_ids], 1), torch.cat([query_mask, reply_mask], 1))
        torch.testing.assert_close(scored, ours, atol=1e-4, rtol=0)


def test_dpo_export_merges_the_sft_adapter_too(workspace):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run = workspace / "dpo"
    assert main(["export", str(run)]) == 0
    report = json.loads((run / "merged" / "verification.json").read_text())
    assert report["passed"] and len(report["merged_adapters"]) == 2
    merged = AutoModelForCausalLM.from_pretrained(run / "merged")
    base = AutoModelForCausalLM.from_pretrained(workspace / "model")
    sft = PeftModel.from_pretrained(base, workspace / "sft" / "adapter").merge_and_unload()
    dpo = PeftModel.from_pretrained(sft, run / "adapter").merge_and_unload()
    torch.testing.assert_close(merged.model.layers[0].self_attn.q_proj.weight,
                               dpo.model.layers[0].self_attn.q_proj.weight, atol=1e-6, rtol=0)


@pytest.mark.parametrize("stage", ["rm", "dpo"])
def test_validate_renders_a_pair(workspace, stage, capsys, tmp_path):
    assert main(["validate", str(workspace / f"{stage}.yaml"), f"output.dir={tmp_path / 'new'}"]) == 0
    out = capsys.readouterr().out
    assert "[chosen]" in out and "[rejected]" in out and "«" in out
    if stage == "dpo":
        assert "merges the sft adapter" in out


@pytest.mark.parametrize("command", ["rm", "dpo"])
def test_help_exits_zero(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    assert f"{command}." in capsys.readouterr().out
