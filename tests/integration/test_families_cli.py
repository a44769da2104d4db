"""Each model family of docs/models.md through the CLI (in process), on a tiny model of transformers' own config
class: SFT -> DPO -> GRPO (hf engine) -> export, 2 optimizer steps each, with the recipe defaults of what a user
leaves unset (attention auto, all-linear with lora_dropout 0.05). The merged model equals the base plus the three
adapters applied by plain transformers + peft, each adapter trained every weight all-linear adapts (the MoE experts
and routers included), and `llmtune validate` refuses an attention kernel the model cannot run in one line.

Wall time on one core: ~4 s per family; Granite-MoE and Mixtral, extra MoE layouts beyond the
families of the issue, run with the slow tests."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model

EXTRA = {"granitemoe", "mixtral"}  # further MoE layouts: slow
FAMILIES = ["qwen3", "qwen3_moe", "gpt_oss", "mistral", "gemma3_text", "phi3", "olmo2", "granite",
            *[pytest.param(f, marks=pytest.mark.slow) for f in sorted(EXTRA)]]
MOE_PARTS = {"qwen3_moe": ("mlp.experts", "mlp.gate"), "gpt_oss": ("mlp.experts", "mlp.router"),
             "granitemoe": ("block_sparse_moe.experts", "block_sparse_moe.router"),
             "mixtral": ("mlp.experts", "mlp.gate")}
TRAIN = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2}


def write(root, name, stage, **sections):
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"stage": stage, "adapter": {"lora_r": 4, "lora_alpha": 8}, "train": TRAIN,
                                    "output": {"dir": str(root / name), "plot": False}, **sections}))
    return path


def chain(root, family):
    """The tiny model of ``family`` and its sft/, dpo/, grpo/ runs and grpo/merged/ export under ``root``."""
    model = save_tiny_model(root / "model", family=family)
    chats = [{"messages": [{"role": "user", "content": f"What is {a} + 1?"},
                           {"role": "assistant", "content": f"{a} + 1 = {a + 1}. #### {a + 1}"}]} for a in range(8)]
    pairs = [{"prompt": f"What is {a} + 2?", "chosen": f"It is {a + 2}. #### {a + 2}", "rejected": "No."}
             for a in range(8)]
    prompts = [{"prompt": f"What is {a} + {b}?", "completion": f"#### {a + b}"} for a in range(2) for b in range(4)]
    (root / "my_rewards.py").write_text("def length_reward(prompts, completions):\n"
                                        "    return [float(len(c) % 7) for c in completions]\n")  # varies: a signal
    for name, rows in (("sft", chats), ("pairs", pairs), ("prompts", prompts)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = lambda name: {"datasets": [{"path": str(root / f"{name}.jsonl")}], "max_length": 64}  # noqa: E731
    assert main(["sft", str(write(root, "sft", "sft", model={"name_or_path": str(model)}, data=data("sft")))]) == 0
    assert main(["dpo", str(write(root, "dpo", "dpo", model={"from_run": str(root / "sft")}, data=data("pairs")))]) == 0
    grpo = write(root, "grpo", "grpo", model={"from_run": str(root / "dpo")}, data=data("prompts"),
                 grpo={"num_generations": 2, "rollout_batch_size": 4},
                 rollout={"engine": "hf", "max_new_tokens": 8}, reward={"function": f"{root / 'my_rewards.py'}:length_reward"})
    assert main(["grpo", str(grpo)]) == 0
    assert main(["export", str(root / "grpo")]) == 0
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_dpo_grpo_export_equals_base_plus_adapters_in_plain_peft(tmp_path, family):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir = chain(tmp_path, family)
    runs = [tmp_path / name for name in ("sft", "dpo", "grpo")]
    for run in runs:  # every adapted weight trained, the MoE experts and router included
        weights = load_file(run / "adapter" / "adapter_model.safetensors")
        untrained = [k for k, v in weights.items() if "lora_B" in k and not v.abs().sum() > 0]
        assert not untrained, (run.name, untrained[:4])
        if family in MOE_PARTS:
            for part in MOE_PARTS[family]:
                assert any(f"layers.0.{part}." in k and "lora_B" in k for k in weights), (run.name, part)
    expected_kernel = "eager" if family == "gpt_oss" else "sdpa"
    assert json.loads((runs[-1] / "merged" / "config.json").read_text())["model_type"] == family
    ids = torch.tensor([[5, 17, 42, 8, 99, 23, 61, 7, 150, 3, 44, 12]])
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert plain.config._attn_implementation == expected_kernel  # transformers' own default = what auto ran
    for run in runs[:-1]:
        plain = PeftModel.from_pretrained(plain, run / "adapter").merge_and_unload()
    plain = PeftModel.from_pretrained(plain, runs[-1] / "adapter").eval()  # the last one unmerged, as trained
    merged = AutoModelForCausalLM.from_pretrained(runs[-1] / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        want, got = plain(input_ids=ids).logits, merged(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert (got - base).abs().max() > 1e-3  # the chain changed the model
    report = json.loads((runs[-1] / "merged" / "verification.json").read_text())
    assert report["passed"] and report["max_abs_diff"] <= report["tolerance"]


def test_validate_refuses_an_attention_kernel_the_model_cannot_run_in_one_line(tmp_path, capsys):
    model = save_tiny_model(tmp_path / "model", family="gpt_oss")
    rows = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}] * 4
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = write(tmp_path, "sft", "sft", model={"name_or_path": str(model), "attn_implementation": "sdpa"},
                 data={"datasets": [{"path": str(tmp_path / "sft.jsonl")}], "max_length": 64})
    assert main(["validate", str(path)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next(ln for ln in err.splitlines() if "model.attn_implementation" in ln)
    assert "GptOssForCausalLM" in line and "it supports eager, flash_attention_2" in line and "auto" in line
    assert main(["sft", str(path)]) == 1  # training stops at the same check, before the model loads
    assert "it supports eager" in capsys.readouterr().err
