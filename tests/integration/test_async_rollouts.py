"""Asynchronous rollouts (``rollout.max_staleness``) against a REAL vLLM engine through the CLI: the next rollout
batch is sampled while the trainer trains, every trained rollout is within the bound (measured per iteration), and a
trainer killed with SIGKILL while a rollout batch is in flight takes its colocated engine down with it and, resumed
with the same command, reproduces the uninterrupted run bit for bit (the checkpoint keeps the adapter the batch in
flight was sampled with). Several servers, several ranks: tests/integration/test_vllm_rl_cli.py.

Skipped only when no vLLM venv exists (bash scripts/setup.sh)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from llmtune.commands.cli import main
from llmtune.rl.engines.vllm_client import vllm_python
from llmtune.utils import read_jsonl
from tests.integration.rl_workspace import COMMON, rl_workspace, write_recipe

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (bash scripts/setup.sh)")]

ENGINE_ARGS = json.dumps({"kv_cache_memory_bytes": 64 << 20})


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    os.environ["LLMTUNE_VLLM_ENGINE_ARGS"] = ENGINE_ARGS  # read by the colocated engine's command line
    yield rl_workspace(tmp_path_factory.mktemp("async"), hidden_size=128)
    os.environ.pop("LLMTUNE_VLLM_ENGINE_ARGS", None)


def grpo(root, name, max_staleness, max_steps=4, **extra):
    # 4 prompts x 2 completions per iteration, one optimizer step each: 1 step per iteration
    return write_recipe(root, name, "grpo", model={"from_run": str(root / "sft")},
                        data={"datasets": [{"path": str(root / "prompts.jsonl")}], "max_length": 64, "val_size": 4},
                        reward={"functions": [{"function": str(root / "my_rewards.py") + ":length_reward"}]},
                        grpo={"num_generations": 2, "rollout_batch_size": 8, "beta": 0.1},
                        rollout={"engine": "vllm", "max_new_tokens": 8, "temperature": 0.9,
                                 "max_staleness": max_staleness, "vllm": {"dtype": "float32"}},
                        train={"micro_batch_size": 4, "global_batch_size": 8, "max_steps": max_steps,
                               "learning_rate": 5e-2, "save_steps": 1, "eval_steps": 1000, "eval_batch_size": 4,
                               "save_total_limit": 10},
                        output={"dir": str(root / name)}, **COMMON, **extra)


def losses(run):
    return [(r["step"], r["loss"], r.get("reward_mean")) for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def adapter_sha(run):
    return hashlib.sha256((run / "adapter" / "adapter_model.safetensors").read_bytes()).hexdigest()


def test_rollouts_sampled_ahead_train_within_the_bound(workspace):
    assert main(["grpo", str(grpo(workspace, "async", max_staleness=1))]) == 0
    rows = [r for r in read_jsonl(workspace / "async" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # iteration 0 is sampled from the policy of step 0 and trained at step 0; each later one was sampled one
    # iteration (= 1 optimizer step) earlier, while the trainer trained the one before
    assert [r["rollout/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["rollout/staleness_mean"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["rollout/stale_dropped_fraction"] == 0.0 for r in rows)
    assert all(r["rollout/wait_s"] >= 0 and r["rollout/engine_idle_s"] >= 0 for r in rows)
    # the off-policy gap is corrected: the engine's log-probs are of an older policy, the weights move off 1
    assert all(r["rollout/logprob_diff_max"] < 2e-4 for r in rows[:1])  # on-policy: fp32 engine == trainer
    assert any(r["rollout/logprob_diff_max"] > 1e-3 for r in rows[1:])  # one step stale: measurably different


def _trainer_children(pid: int) -> list[psutil.Process]:
    return [c for c in psutil.Process(pid).children(recursive=True) if "vllm_server.py" in " ".join(c.cmdline())]


def test_kill9_with_a_rollout_batch_in_flight_resumes_exactly(workspace):
    whole = grpo(workspace, "async_whole", max_staleness=1)
    assert main(["grpo", str(whole)]) == 0
    path = grpo(workspace, "async_killed", max_staleness=1)
    run = workspace / "async_killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = (workspace / "async_killed.log").open("w")
    trainer = subprocess.Popen([sys.executable, "-m", "llmtune", "grpo", str(path)], stdout=log,
                               stderr=subprocess.STDOUT, env=env)
    engines: list[psutil.Process] = []
    deadline = time.monotonic() + 900
    while not (run / "checkpoints" / "checkpoint-2").is_dir():  # iteration 1 trained, iteration 2 sampled ahead
        assert trainer.poll() is None and time.monotonic() < deadline, (workspace / "async_killed.log").read_text()
        engines = engines or _trainer_children(trainer.pid)
        time.sleep(0.05)
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    assert engines, "the colocated engine was not seen"
    gone, alive = psutil.wait_procs(engines, timeout=30)  # the engine does not outlive its trainer
    assert not alive, [p.pid for p in alive]
    checkpoint = run / "checkpoints" / "checkpoint-2"
    plan = json.loads((checkpoint / "rollout_snapshots" / "plan.json").read_text())
    assert plan["2"]["version"] == 1  # iteration 2's batch was sampled from the policy of step 1
    assert main(["grpo", str(path)]) == 0
    assert losses(run) == losses(workspace / "async_whole")
    assert adapter_sha(run) == adapter_sha(workspace / "async_whole")
