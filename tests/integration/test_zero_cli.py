"""Two processes on this CPU (gloo), through the CLI launcher: DeepSpeed ZeRO-2/ZeRO-3 SFT and DPO on a tiny Llama.

Every distributed run is compared with a single-process run of the same recipe (same global batch, same seed; the
single process accumulates twice as many micro-batches). Steps hold the same rows in both (the length-grouped order
is built for the global batch and dealt out to the ranks), so the per-step losses must agree to float rounding.
The "gathered in-training model" is rebuilt from the ZeRO checkpoint's partitions by DeepSpeed's own
``zero_to_fp32`` (each rank's fp32 master shard): the saved adapter must reload with the same logits.

Each test starts 2 worker processes (~30-50 s on 2 shared cores, mostly imports): all are marked slow; CI runs them.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch
import yaml

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model
from llmtune.utils import read_jsonl

pytestmark = pytest.mark.slow

TOLERANCE = 1e-4  # per-step loss, distributed vs single process
QA = [("What is 2 + 3?", "It is 5.", "It is 7."), ("Say hello.", "Hello! How are you today?", "No."),
      ("What is 12 * 7?", "12 * 7 = 84. #### 84", "12 * 7 = 74."), ("Name a color.", "The sea is blue.", "Dog."),
      ("Write one sentence about the sea.", "The sea is wide and blue, and the waves come in and out.", "Sea."),
      ("How many eggs does Janet sell?", "Janet sells 16 - 3 - 4 = 9 eggs. #### 9", "She sells 12.")]
ADAPTER = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
MAX_DIFFS: dict[str, float] = {}


def write_recipe(root, name, recipe):
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    """Tiny model, 54 chat rows (lengths vary), 12 preference pairs, and the single-process SFT and DPO runs."""
    root = tmp_path_factory.mktemp("dist")
    model_dir = save_tiny_model(root / "model")
    chats = [{"messages": [{"role": "user", "content": f"{q} ({i})"},
                           {"role": "assistant", "content": c * (1 + i % 2)}]} for i in range(9) for q, c, _ in QA]
    (root / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in chats) + "\n")
    pairs = [{"prompt": f"{q} ({i})", "chosen": c, "rejected": r} for i in range(2) for q, c, r in QA]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    # 52 train rows (2 held out), 8 per step. transformers' length grouping alone would sort groups of 12 rows with
    # 2 ranks (4 x mega-batch multiplier 3) but of 8 rows in one process: different rows per step. Ours: 8 in both.
    sft = write_recipe(root, "sft", {
        "stage": "sft", "model": {"name_or_path": str(model_dir)},
        "data": {"datasets": [{"path": str(root / "sft.jsonl")}], "max_length": 64, "val_size": 2},
        "adapter": ADAPTER,
        "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 3, "learning_rate": 1e-2,
                  "save_steps": 1, "save_total_limit": 5},
        "output": {"dir": str(root / "sft_1")}})
    dpo = write_recipe(root, "dpo", {
        "stage": "dpo", "model": {"from_run": str(root / "sft_1")},  # chain merge: whole weights even under ZeRO-3
        "data": {"datasets": [{"path": str(root / "pairs.jsonl"), "format": "preference"}], "max_length": 64,
                 "val_size": 2},
        "adapter": ADAPTER,
        "train": {"micro_batch_size": 1, "global_batch_size": 4, "max_steps": 3, "learning_rate": 5e-2},
        "output": {"dir": str(root / "dpo_1")}})
    assert main(["sft", str(sft)]) == 0
    assert main(["dpo", str(dpo)]) == 0
    return root


def losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


def assert_same_losses(ws, single: str, dist: str, label: str) -> None:
    one, two = losses(ws / single), losses(ws / dist)
    assert sorted(two) == sorted(one) == [1, 2, 3]  # one record per step: written once, by rank 0
    diff = max(abs(one[s] - two[s]) for s in one)
    MAX_DIFFS[label] = diff
    print(f"\n{label}: max |loss diff| vs single process = {diff:.3g} over steps {sorted(one)}")
    assert diff <= TOLERANCE, (label, one, two)
    assert len({round(v, 6) for v in one.values()}) == 3  # the steps differ: the comparison is not trivially equal


def logits_of(model_dir, adapter_state=None, adapter_dir=None, ids=None):
    """Logits (1, T, V) of base + adapter: loaded with peft from a directory, or from a raw peft state dict."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(base, adapter_dir)
    else:
        cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        model = get_peft_model(base, cfg)
        result = model.load_state_dict(adapter_state, strict=False)
        assert not result.unexpected_keys
        assert not [k for k in result.missing_keys if "lora_" in k]  # every LoRA weight came from the checkpoint
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 120]])


def test_sft_zero2_two_processes_matches_single_process(ws):
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={ws / 'sft_z2'}", "distributed.zero_stage=2",
                 "--nproc-per-node", "2"]) == 0
    assert_same_losses(ws, "sft_1", "sft_z2", "sft zero2")
    summary = json.loads((ws / "sft_z2" / "lineage.json").read_text())["summary"]
    assert summary["batch"] == {"global_batch_size": 8, "micro_batch_size": 2, "accumulation_steps": 2, "world_size": 2}
    assert summary["zero_stage"] == 2
    single = json.loads((ws / "sft_1" / "lineage.json").read_text())["summary"]["batch"]
    assert single["accumulation_steps"] == 4 and single["world_size"] == 1
    resolved = yaml.safe_load((ws / "sft_z2" / "recipe.resolved.yaml").read_text())
    assert resolved["distributed"]["nproc_per_node"] == 2  # what the job was, recorded once
    # gathered in-training weights (ZeRO-2 checkpoint partitions) == saved adapter == single-process adapter
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(ws / "sft_z2" / "checkpoints" / "checkpoint-3"))
    saved = logits_of(ws / "model", adapter_dir=ws / "sft_z2" / "adapter", ids=IDS)
    torch.testing.assert_close(saved, logits_of(ws / "model", adapter_state=state, ids=IDS), atol=1e-6, rtol=0)
    torch.testing.assert_close(saved, logits_of(ws / "model", adapter_dir=ws / "sft_1" / "adapter", ids=IDS),
                               atol=1e-4, rtol=0)


def test_sft_zero3_two_processes_saves_gathered_adapter(ws):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from llmtune.models.verify import verify_saved_adapter

    run = ws / "sft_z3"
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={run}", "distributed.zero_stage=3",
                 "--nproc-per-node", "2"]) == 0
    assert_same_losses(ws, "sft_1", "sft_z3", "sft zero3")
    assert sorted(p.name for p in run.iterdir()) == sorted([
        "recipe.resolved.yaml", "data_report.json", "metrics.jsonl", "plots", "checkpoints", "adapter",
        "lineage.json"])
    ckpt = run / "checkpoints" / "checkpoint-3"
    assert sorted(p.name for p in (ckpt / "global_step3").iterdir()) == sorted(
        f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim"))
    weights = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert len(weights) == 28 and all(v.numel() > 0 for v in weights.values())  # 2 layers x 7 linears x (A, B)
    assert all(v.abs().sum() > 0 for k, v in weights.items() if "lora_B" in k)  # trained (lora_B starts at 0)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ws / "model"), run / "adapter")
    assert verify_saved_adapter(run / "adapter", reference) == 28
    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))  # the partitions of every rank, gathered
    assert len(state) == 28  # only the trainable LoRA weights are in the checkpoint (frozen base excluded)
    saved = logits_of(ws / "model", adapter_dir=run / "adapter", ids=IDS)
    torch.testing.assert_close(saved, logits_of(ws / "model", adapter_state=state, ids=IDS), atol=1e-6, rtol=0)
    torch.testing.assert_close(saved, logits_of(ws / "model", adapter_dir=ws / "sft_1" / "adapter", ids=IDS),
                               atol=1e-4, rtol=0)
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if "eval_loss" in r]
    single = [r for r in read_jsonl(ws / "sft_1" / "metrics.jsonl") if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 3]  # the baseline eval runs inside train() under DeepSpeed
    assert evals[0]["eval_loss"] == pytest.approx(single[0]["eval_loss"], abs=1e-5)
    assert evals[-1]["eval_loss"] == pytest.approx(single[-1]["eval_loss"], abs=1e-4)


def test_zero3_resume_from_zero_checkpoint(ws):
    """Resume checkpoint-2 of the ZeRO-3 run (per-rank partitions + optimizer shards) in a new run dir."""
    run = ws / "sft_z3r"
    src = ws / "sft_z3" / "checkpoints" / "checkpoint-2"
    if not src.is_dir():
        pytest.fail("needs test_sft_zero3_two_processes_saves_gathered_adapter to have run first")
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={run}", "distributed.zero_stage=3",
                 f"train.resume_from={src}", "--nproc-per-node", "2"]) == 0
    resumed, original = losses(run), losses(ws / "sft_z3")
    assert sorted(resumed) == [3]
    assert resumed[3] == pytest.approx(original[3], abs=1e-6)
    torch.testing.assert_close(logits_of(ws / "model", adapter_dir=run / "adapter", ids=IDS),
                               logits_of(ws / "model", adapter_dir=ws / "sft_z3" / "adapter", ids=IDS),
                               atol=1e-6, rtol=0)


def test_zero3_resume_with_more_steps_follows_the_longer_schedule(ws):
    """DeepSpeed restores the optimizer (its LR included) from its own shards: the first resumed step must still run at
    the new schedule's LR (old code: step 3 at the finished 3-step cosine's 2.5e-3 instead of the 5-step's 6.5e-3)."""
    import math

    run = ws / "sft_z3x"
    src = ws / "sft_z3" / "checkpoints" / "checkpoint-2"
    if not src.is_dir():
        pytest.fail("needs test_sft_zero3_two_processes_saves_gathered_adapter to have run first")
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={run}", "distributed.zero_stage=3",
                 f"train.resume_from={src}", "train.max_steps=5", "--nproc-per-node", "2"]) == 0
    logged = {r["step"]: r["learning_rate"] for r in read_jsonl(run / "metrics.jsonl") if "learning_rate" in r}
    assert logged == pytest.approx({k: 1e-2 * (1 + math.cos(math.pi * (k - 1) / 5)) / 2 for k in (3, 4, 5)}, rel=1e-6)


def test_dpo_zero3_two_processes_matches_single_process(ws):
    """DPO from an SFT run (the SFT adapter merged into whole weights, then partitioned) with the reference = the
    adapter-disabled policy inside the ZeRO-3 engine."""
    run = ws / "dpo_z3"
    assert main(["dpo", str(ws / "dpo.yaml"), f"output.dir={run}", "distributed.zero_stage=3",
                 "--nproc-per-node", "2"]) == 0
    assert_same_losses(ws, "dpo_1", "dpo_z3", "dpo zero3")
    records = read_jsonl(run / "metrics.jsonl")
    single = read_jsonl(ws / "dpo_1" / "metrics.jsonl")
    for key in ("rewards/margins", "logps/chosen"):  # per-step means over the step's pairs (both ranks)
        got = [r[key] for r in records if "loss" in r]
        want = [r[key] for r in single if "loss" in r]
        assert got == pytest.approx(want, abs=1e-4), key
    torch.testing.assert_close(logits_of(ws / "model", adapter_dir=run / "adapter", ids=IDS),
                               logits_of(ws / "model", adapter_dir=ws / "dpo_1" / "adapter", ids=IDS),
                               atol=1e-4, rtol=0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dpo_zero2_simulated_two_nodes(ws):
    """Two launches with --nnodes 2 on 127.0.0.1 (node ranks 0 and 1, one process each): one set of artifacts."""
    run = ws / "dpo_2n"
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "llmtune.commands.cli", "dpo", str(ws / "dpo.yaml"), f"output.dir={run}",
         "distributed.zero_stage=2", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(rank),
         "--master-addr", "127.0.0.1", "--master-port", str(port)],
        cwd=ws, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for rank in (0, 1)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert sorted(p.name for p in run.iterdir()) == sorted([
        "recipe.resolved.yaml", "data_report.json", "metrics.jsonl", "plots", "checkpoints", "adapter",
        "lineage.json"])
    assert "llmtune dpo: done" in outputs[0] and "llmtune dpo: done" not in outputs[1]  # the summary once
    assert_same_losses(ws, "dpo_1", "dpo_2n", "dpo zero2, 2 nodes")
    evals = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if "eval_loss" in r]
    assert evals == [0, 3]
    lineage = json.loads((run / "lineage.json").read_text())
    assert lineage["summary"]["batch"]["world_size"] == 2 and lineage["summary"]["zero_stage"] == 2
    resolved = yaml.safe_load((run / "recipe.resolved.yaml").read_text())
    assert resolved["distributed"]["nnodes"] == 2
