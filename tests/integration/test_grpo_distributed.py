"""GRPO with two processes under DeepSpeed ZeRO-3 (gloo, through the CLI launcher): generation with the partitioned
weights gathered, groups sampled on the rank that holds their prompt, the reward std of ``scale_rewards: batch``
and the step normaliser gathered over ranks, metrics and the held-out eval gathered, the adapter saved once.

(Equality with a single process cannot be shown here: the ranks sample with their own generators, and with a
deterministic draw every completion of a group is the same, so the gradient is 0. Exactness over ranks follows
from the normaliser counted over all ranks, the same mechanism the 4x1 == 1x4 test checks over micro-batches and
tests/integration/test_ppo_distributed.py checks over ranks.) Marked slow: it starts 2 worker processes.
"""

from __future__ import annotations

import json
import math

import pytest
import yaml
from safetensors.torch import load_file

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model
from llmtune.utils import read_jsonl

pytestmark = pytest.mark.slow

REWARD = '''
def length(prompts, completions):
    """Toy reward that differs between sampled completions."""
    return [float(len(c) % 5) for c in completions]
'''


def test_grpo_two_processes_zero3(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    (tmp_path / "toy_reward.py").write_text(REWARD)
    prompts = [{"prompt": f"What is {a} + {b}?"} for a in range(4) for b in range(3)]
    (tmp_path / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    recipe = {
        "stage": "grpo", "model": {"name_or_path": str(model_dir)},
        "reward": {"function": f"{tmp_path / 'toy_reward.py'}:length"},
        "data": {"datasets": [{"path": str(tmp_path / "prompts.jsonl")}], "max_length": 64, "val_size": 4},
        "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "grpo": {"num_generations": 2, "rollout_batch_size": 8, "beta": 0.1,
                 "scale_rewards": "batch", "loss_aggregation": "sequence_mean"},
        "rollout": {"max_new_tokens": 6},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 2e-2,
                  "eval_batch_size": 2, "save_steps": 2},
        "output": {"dir": str(tmp_path / "grpo_z3")},
    }
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["grpo", str(tmp_path / "grpo.yaml"), "distributed.zero_stage=3", "--nproc-per-node", "2"]) == 0
    run = tmp_path / "grpo_z3"
    records = list(read_jsonl(run / "metrics.jsonl"))
    train = [r for r in records if "policy_loss" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["loss"]) for r in train)  # rank 0 logs
    assert train[0]["kl"] == pytest.approx(0.0, abs=1e-7) and 0 <= train[0]["all_equal_group_fraction"] <= 1
    evals = [r for r in records if "eval_reward" in r]
    assert [r["step"] for r in evals] == [0, 2] and evals[0]["eval_kl"] == 0.0
    assert evals[-1]["eval_prompts"] == 4  # the 4 held-out prompts, sharded over 2 ranks, gathered
    samples = list(read_jsonl(run / "samples.jsonl"))
    assert len(samples) == 4 and {s["iteration"] for s in samples} == {0}  # written once (rank 0), 2 groups
    policy = load_file(run / "adapter" / "adapter_model.safetensors")
    assert len(policy) == 28 and any(v.abs().sum() > 0 for k, v in policy.items() if "lora_B" in k)
