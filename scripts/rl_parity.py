"""Parity hashes of online RL: a few steps of GRPO and PPO on tiny models with fixed seeds, each run's per-step losses
and metrics hashed, so that a refactor of the RL layer can show it changed no number.

Runs (each a fresh ``python -m llmtune`` process, ``OMP_NUM_THREADS=1``):

- ``grpo_hf``: GRPO, hf engine, two weighted reward functions, beta 0.1, clip-higher (4 steps = 2 iterations).
- ``grpo_hf_shaped``: GRPO, hf, an abstaining reward function, ``missing_eos_penalty``, DAPO's overlong penalty,
  ``dynamic_sampling: resample``, ``num_iterations`` 2 (old log-probs), ``scale_rewards: batch``.
- ``grpo_hf_masked``: GRPO, hf, ``mask_truncated_completions``, ``dynamic_sampling: drop``, rloo, sequence_mean.
- ``ppo_hf``: PPO, hf, a reward function, ``missing_eos_penalty``, ``normalize_scores``, adaptive KL.
- ``grpo_vllm``: GRPO, vLLM colocated (CPU build, ``.venv-vllm``; skipped when vLLM is not installed), with the
  engine's importance-sampling correction.
- ``agent_grpo_hf`` / ``agent_ppo_hf``: multi-turn tool rollouts (the tiny tool-calling model of
  ``tests/integration/agent_workspace.py``); ``agent_grpo_broken``: a tool whose infrastructure fails every other call.

The hash of a run: sha256 over the JSON of its training and eval records reduced to the keys of :data:`KEYS` (losses,
rewards, KL, clipping, lengths: never timings), plus the final adapter's sha256; the first 16 hex digits are printed.
``--dump DIR`` writes each run's reduced records, to diff two trees when a hash differs.

    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 PYTHONPATH=. python scripts/rl_parity.py [--only grpo_hf,ppo_hf] [--dump d]

(the vLLM run needs ``LLMTUNE_VLLM_PYTHON`` or ``.venv-vllm`` beside the repository; ``--agent-set KEY=VALUE`` adds a
recipe override to the agent runs, e.g. a default that changed on purpose.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# the numbers compared: what a loss path computes (never a timing, never a metric that only describes speed)
KEYS = ("step", "loss", "grad_norm", "policy_loss", "value_loss", "kl", "entropy", "policy_entropy",
        "clip_fraction_low", "clip_fraction_high", "clipfrac", "vf_clipfrac", "approx_kl", "reward_mean", "reward_std",
        "score_mean", "score_std", "non_score_reward", "kl_coef", "completion_length", "response_length",
        "truncated_fraction", "trained_completion_fraction", "trained_response_fraction", "all_equal_group_fraction",
        "rewards/abstained", "rewards/overlong_penalty_mean", "rollout_kl", "explained_variance",
        "rollout/logprob_diff_max", "rollout/is_weight_mean", "eval_reward", "eval_score", "eval_kl",
        "eval_truncated_fraction", "agent/turns", "agent/tool_calls", "agent/infrastructure_failures")

REWARDS = """def length_reward(prompts, completions):
    return [float(len(c) % 7) for c in completions]


def sometimes(prompts, completions):  # abstains (None) on completions of even length
    return [None if len(c) % 2 == 0 else float(len(c) % 7) for c in completions]


def answer(prompts, completions, references, messages):
    return [1.0 if c.strip().endswith("#### 5") else float(len(c) % 3) / 4 for c in completions]
"""

BROKEN_TOOL = '''from llmtune.rl.toolbox import InfrastructureError

calls = []

def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 * 7 + 3) / 2".
    """
    calls.append(1)
    if len(calls) % 2:
        raise InfrastructureError("the sandbox is down")
    return "5"
'''

ADAPTER = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
TRAIN = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 4, "learning_rate": 5e-2, "save_steps": 2,
         "eval_batch_size": 4, "save_total_limit": 5}


def _write(root: Path, name: str, doc: dict) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _llmtune(*args: str) -> None:
    """``python -m llmtune ARGS`` in a fresh process (exits on failure, printing its log's end)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "LLMTUNE_VLLM_ENGINE_ARGS": json.dumps({"kv_cache_memory_bytes": 64 << 20})}
    proc = subprocess.run([sys.executable, "-m", "llmtune", *args], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-6000:])
        raise SystemExit(f"llmtune {' '.join(args)} failed ({proc.returncode})")


def workspace(root: Path) -> None:
    """A tiny model (hidden 128: vLLM's CPU attention), an SFT run of it, prompts, reward files, the tool model."""
    from llmtune.models.tiny import save_tiny_model
    from tests.integration.agent_workspace import tool_calling_model

    save_tiny_model(root / "model", hidden_size=128)
    (root / "rewards.py").write_text(REWARDS)
    (root / "broken_tools.py").write_text(BROKEN_TOOL)
    chats = [{"messages": [{"role": "user", "content": f"What is {a} + 1?"},
                           {"role": "assistant", "content": f"{a} + 1 = {a + 1}. #### {a + 1}"}]} for a in range(8)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    prompts = [{"prompt": f"What is {a} + {b}?", "completion": f"#### {a + b}"} for a in range(4) for b in range(4)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    _llmtune("sft", str(_write(root, "sft", {
        "stage": "sft", "model": {"name_or_path": str(root / "model")},
        "data": {"datasets": [{"path": str(root / "sft.jsonl")}], "max_length": 64},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2},
        "adapter": ADAPTER, "output": {"dir": str(root / "sft"), "plot": False}})))
    tool_calling_model(root / "tool_model", steps=1500)  # 200 steps leave it at loss ~0.45 here: no real calls
    rows = [{"prompt": "What is 2 + 3?", "completion": "#### 5"}] * 8 + [
        {"prompt": f"What is {a} + {b}?", "completion": f"#### {a + b}"} for a in (3, 4) for b in (1, 2)]
    (root / "agent_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "memorised.jsonl").write_text("".join(json.dumps(rows[0]) + "\n" for _ in range(8)))


def single_turn(root: Path, name: str, stage: str, engine: str = "hf", **sections) -> dict:
    rewards = str(root / "rewards.py")
    doc = {"stage": stage, "model": {"from_run": str(root / "sft")},
           "data": {"datasets": [{"path": str(root / "prompts.jsonl")}], "max_length": 64, "val_size": 4},
           "adapter": ADAPTER, "train": dict(TRAIN), "output": {"dir": str(root / name), "plot": False},
           "rollout": {"engine": engine, "max_new_tokens": 8, "temperature": 0.9,
                       **({"vllm": {"mode": "colocate", "dtype": "float32", "startup_timeout_s": 600,
                                    "request_timeout_s": 300, "importance_sampling_correction": True}}
                          if engine == "vllm" else {})}}
    if stage == "grpo":
        doc["grpo"] = {"num_generations": 2, "rollout_batch_size": 8, "beta": 0.1, "epsilon_high": 0.28}
        doc["reward"] = {"functions": [{"function": rewards + ":length_reward", "weight": 1.0},
                                       {"function": "llmtune.rewards:format_reward", "weight": 0.5}]}
    else:
        doc["ppo"] = {"rollout_batch_size": 4, "ppo_epochs": 2, "kl_coef": 0.05, "kl_target": 1.0,
                      "missing_eos_penalty": -1.0, "normalize_scores": True}
        doc["reward"] = {"function": rewards + ":length_reward"}
        doc["train"]["learning_rate"] = 1e-2
    for section, values in sections.items():
        doc[section] = {**doc.get(section, {}), **values}
    return doc


def agent(root: Path, name: str, stage: str, **sections) -> dict:
    doc = {"stage": stage, "model": {"name_or_path": str(root / "tool_model")},
           "data": {"datasets": [{"path": str(root / "agent_prompts.jsonl")}], "max_length": 256, "val_size": 2},
           "adapter": ADAPTER, "rollout": {"max_new_tokens": 96, "temperature": 0.6},
           "agent": {"tools": ["llmtune.tools:calculator"], "max_turns": 3, "max_tool_result_tokens": 32},
           "reward": {"functions": [str(root / "rewards.py") + ":answer"]},
           "train": {"micro_batch_size": 2, "global_batch_size": 2, "max_steps": 4, "learning_rate": 1e-2,
                     "eval_batch_size": 2, "save_steps": 2, "save_total_limit": 5},
           "output": {"dir": str(root / name), "plot": False}}
    if stage == "grpo":
        doc["grpo"] = {"num_generations": 2, "rollout_batch_size": 4, "beta": 0.05}
    else:
        doc["ppo"] = {"rollout_batch_size": 2, "ppo_epochs": 2, "kl_coef": 0.05}
        doc["reward"] = {"function": str(root / "rewards.py") + ":answer"}
    for section, values in sections.items():
        doc[section] = {**doc.get(section, {}), **values}
    return doc


def runs(root: Path) -> dict[str, dict]:
    rewards = str(root / "rewards.py")
    return {
        "grpo_hf": single_turn(root, "grpo_hf", "grpo"),
        "grpo_hf_shaped": single_turn(
            root, "grpo_hf_shaped", "grpo",
            grpo={"missing_eos_penalty": -0.5, "overlong_buffer_tokens": 4, "overlong_penalty_factor": 1.0,
                  "dynamic_sampling": "resample", "num_iterations": 2, "scale_rewards": "batch"},
            train={"max_steps": 8, "save_steps": 4}, rollout={"max_new_tokens": 12},
            reward={"functions": [{"function": rewards + ":sometimes", "weight": 1.0},
                                  {"function": "llmtune.rewards:format_reward", "weight": 0.5}]}),
        "grpo_hf_masked": single_turn(
            root, "grpo_hf_masked", "grpo",
            grpo={"mask_truncated_completions": True, "dynamic_sampling": "drop", "advantage_estimator": "rloo",
                  "loss_aggregation": "sequence_mean"},
            rollout={"max_new_tokens": 24, "temperature": 1.2},
            reward={"functions": [{"function": rewards + ":sometimes", "weight": 1.0}]}),
        "ppo_hf": single_turn(root, "ppo_hf", "ppo"),
        "grpo_vllm": single_turn(root, "grpo_vllm", "grpo", engine="vllm"),
        "agent_grpo_hf": agent(root, "agent_grpo_hf", "grpo"),
        "agent_ppo_hf": agent(root, "agent_ppo_hf", "ppo"),
        "agent_grpo_broken": agent(root, "agent_grpo_broken", "grpo",
                                   agent={"tools": [str(root / "broken_tools.py") + ":calculator"]},
                                   data={"datasets": [{"path": str(root / "memorised.jsonl")}]},
                                   rollout={"temperature": 0.3}),
    }


def reduced(run: Path) -> list[dict]:
    """The run's training and eval records, keys of :data:`KEYS` only (the final summary record left out)."""
    out = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "train_runtime" in record:
            continue
        kept = {k: record[k] for k in KEYS if k in record}
        if len(kept) > 1:
            out.append(kept)
    return out


def run_hash(run: Path) -> tuple[str, list[dict]]:
    records = reduced(run)
    adapter = hashlib.sha256((run / "adapter" / "adapter_model.safetensors").read_bytes()).hexdigest()
    blob = json.dumps({"records": records, "adapter": adapter}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16], records


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated run names (default all)")
    parser.add_argument("--dump", help="write each run's reduced records (JSON) into this directory")
    parser.add_argument("--keep", help="work in this directory (kept) instead of a temporary one")
    parser.add_argument("--agent-set", action="append", default=[], metavar="KEY=VALUE",
                        help="a recipe override for the agent runs (e.g. to turn off a default that changed on "
                        "purpose); applied to the runs whose stage the key's section names, or any section not a stage")
    args = parser.parse_args()
    from llmtune.rl.engines.vllm_client import vllm_python

    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="rl_parity_"))
    root.mkdir(parents=True, exist_ok=True)
    workspace(root)
    wanted = set(args.only.split(",")) if args.only else None
    results = {}
    for name, doc in runs(root).items():
        if wanted is not None and name not in wanted:
            continue
        if doc["rollout"].get("engine") == "vllm" and vllm_python() is None:
            print(f"{name:20s} skipped (vLLM not installed)", flush=True)
            continue
        overrides = [o for o in args.agent_set if "agent" in doc
                     and o.split(".")[0] not in ({"grpo", "ppo"} - {doc["stage"]})]
        _llmtune(doc["stage"], str(_write(root, name, doc)), *overrides)
        digest, records = run_hash(root / name)
        results[name] = digest
        print(f"{name:20s} {digest}  ({len(records)} records)", flush=True)
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            (Path(args.dump) / f"{name}.json").write_text(json.dumps(records, indent=1))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
