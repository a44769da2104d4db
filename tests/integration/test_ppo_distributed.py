"""PPO under DeepSpeed ZeRO-2 and ZeRO-3 with two processes (gloo, through the CLI launcher): the policy and value
adapters on one base, the reference = adapters disabled, generation with the ZeRO-3 weights gathered.

Compared with a single-process run of the same recipe: one optimizer step per PPO iteration holds every rollout
(rollout_batch_size = global_batch_size, ppo_epochs 1), sampling keeps the top token only (top_k 1: each rank samples
its own rows with its own generator, so only a deterministic draw can equal the single process's), so both runs draw
the same responses, and advantages are whitened with statistics summed over the ranks; the per-step losses must
then agree to float rounding. Each distributed run starts 2 worker processes: marked slow (CI runs them).
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model
from llmtune.utils import read_jsonl

pytestmark = pytest.mark.slow

QA = [("What is 2 + 3?", "It is 5."), ("Say hello.", "Hello! How are you today?"),
      ("What is 12 * 7?", "12 * 7 = 84."), ("Name a color.", "The sea is blue.")]
REWARD = '''
def reward(prompts, completions):
    """Toy score in [0, 1]: the share of completion characters that are vowels (varies between responses)."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]
'''


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo_dist")
    model_dir = save_tiny_model(root / "model")
    (root / "toy_reward.py").write_text(REWARD)
    prompts = [{"prompt": f"{q} ({i})"} for i in range(4) for q, _ in QA]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    recipe = {
        "stage": "ppo", "model": {"name_or_path": str(model_dir)},
        "reward": {"function": f"{root / 'toy_reward.py'}:reward"},
        "data": {"datasets": [{"path": str(root / "prompts.jsonl")}], "max_length": 64, "val_size": 4},
        "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "ppo": {"rollout_batch_size": 4, "ppo_epochs": 1, "normalize_scores": True},
        "rollout": {"max_new_tokens": 6, "top_k": 1},
        "train": {"micro_batch_size": 1, "global_batch_size": 4, "max_steps": 3, "learning_rate": 2e-2,
                  "eval_batch_size": 2, "save_steps": 3},
        "output": {"dir": str(root / "ppo_1")},
    }
    (root / "ppo.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["ppo", str(root / "ppo.yaml")]) == 0
    return root


def losses(run):
    return {r["step"]: r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r}


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_ppo_two_processes_matches_single_process(ws, zero_stage):
    run = ws / f"ppo_z{zero_stage}"
    assert main(["ppo", str(ws / "ppo.yaml"), f"output.dir={run}", f"distributed.zero_stage={zero_stage}",
                 "--nproc-per-node", "2"]) == 0
    one, two = losses(ws / "ppo_1"), losses(run)
    assert sorted(two) == sorted(one) == [1, 2, 3]  # written once, by rank 0
    diff = max(abs(one[s] - two[s]) for s in one)
    print(f"\nppo zero{zero_stage}: max |loss diff| vs single process = {diff:.3g}")
    assert diff <= 1e-4, (one, two)
    records = list(read_jsonl(run / "metrics.jsonl"))
    single = list(read_jsonl(ws / "ppo_1" / "metrics.jsonl"))
    for key in ("score_mean", "kl", "response_length"):  # rollout metrics over both ranks' rollouts
        assert [r[key] for r in records if key in r] == pytest.approx([r[key] for r in single if key in r], abs=1e-4)
    evals = [r for r in records if "eval_score" in r]
    assert [r["step"] for r in evals] == [0, 3] and evals[0]["eval_kl"] == 0.0
    assert evals[-1]["eval_prompts"] == 4  # the 4 held-out prompts, sharded over 2 ranks, gathered
    policy = load_file(run / "adapter" / "adapter_model.safetensors")
    value = load_file(run / "adapter" / "value" / "adapter_model.safetensors")
    head = load_file(run / "adapter" / "value" / "value_head.safetensors")
    assert len(policy) == len(value) == 28 and all(v.numel() > 0 for v in (*policy.values(), *value.values()))
    assert head["weight"].numel() > 0 and head["weight"].abs().sum() > 0
    ref_policy = load_file(ws / "ppo_1" / "adapter" / "adapter_model.safetensors")
    for key, tensor in ref_policy.items():
        assert torch.allclose(policy[key], tensor, atol=1e-4), key
