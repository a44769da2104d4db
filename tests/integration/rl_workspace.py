"""What the online-RL CLI tests share: a tiny model, an SFT run of it, GSM8K-like prompts and reward functions."""

import json
import shutil

import yaml

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model
from llmtune.utils import read_jsonl

COMMON = {"adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0}}
# a reward that varies between completions of a random model (so groups carry signal) + the shipped format reward
REWARD_FILE = """def length_reward(prompts, completions):
    return [float(len(c) % 7) for c in completions]


def only_ones(prompts, completions):  # signal for prompts 'What is 1 + b?' only: the other groups are all-equal
    return [float(len(c) % 7) if p.startswith("What is 1 ") else 0.0 for p, c in zip(prompts, completions)]


def sometimes(prompts, completions):  # abstains (None) on completions of even length
    return [None if len(c) % 2 == 0 else float(len(c) % 7) for c in completions]
"""


def write_recipe(root, name, stage, **sections):
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"stage": stage, **sections}))
    return path


def rl_workspace(root, **tiny):
    """``root`` with ``model/`` (a tiny model, ``tiny`` = :func:`save_tiny_model` arguments), ``my_rewards.py``,
    ``prompts.jsonl`` (16 prompts with ``#### n`` references) and ``sft/`` (a 2-step SFT run of the model)."""
    model_dir = save_tiny_model(root / "model", **tiny)
    (root / "my_rewards.py").write_text(REWARD_FILE)
    chats = [{"messages": [{"role": "user", "content": f"What is {a} + 1?"},
                           {"role": "assistant", "content": f"{a} + 1 = {a + 1}. #### {a + 1}"}]} for a in range(8)]
    (root / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in chats) + "\n")
    prompts = [{"prompt": f"What is {a} + {b}?", "completion": f"#### {a + b}"} for a in range(4) for b in range(4)]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    sft = write_recipe(root, "sft", "sft", model={"name_or_path": str(model_dir)},
                       data={"datasets": [{"path": str(root / "sft.jsonl")}], "max_length": 64},
                       train={"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2},
                       output={"dir": str(root / "sft")}, **COMMON)
    assert main(["sft", str(sft)]) == 0
    return root


def cut_back_to_first_iteration(run, copy):
    """Copy a finished run of 4 optimizer steps (2 iterations, checkpoints every 2 steps) to ``copy`` as if it had
    been stopped after its first iteration: the later checkpoints, the adapter, the lineage and the metrics past
    step 2 removed. Resuming ``copy`` must reproduce ``run``."""
    shutil.copytree(run, copy)
    for name in ("adapter", "checkpoints/checkpoint-4", "checkpoints/checkpoint-3"):
        shutil.rmtree(copy / name, ignore_errors=True)
    (copy / "lineage.json").unlink()
    kept = [r for r in read_jsonl(copy / "metrics.jsonl") if r.get("step", 0) <= 2 and "train_runtime" not in r]
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
