"""GRPO and PPO through the CLI with ``rollout.engine: vllm`` against a REAL vLLM engine (no mocks): one
``llmtune rollout-server`` process for the module (server mode: the server in another process, in its own venv),
an SFT run below GRPO (so the server's rollout base is the SFT chain merged in fp32). Each run trains 2 iterations,
checkpoints and resumes; the engine's log-probs of its samples match the trainer's (``rollout/logprob_diff_max``);
the server killed mid-run ends the run with exit code 69 and one ``error:`` line, the newest checkpoint intact, and
the same command (the server back) resumes.

Skipped only when no vLLM venv exists (see ``tests/integration/test_vllm_engine.py``).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import yaml

from llmtune.commands.cli import main
from llmtune.rl.engines.vllm_client import VLLMClient, vllm_python
from llmtune.utils import read_jsonl
from tests.integration.rl_workspace import COMMON, rl_workspace, write_recipe

pytestmark = pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (bash scripts/setup.sh sets up "
                                ".venv-vllm; LLMTUNE_VLLM_PYTHON names its python)")

ENGINE_ARGS = json.dumps({"kv_cache_memory_bytes": 64 << 20})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rl_recipe(root, name, stage, url, max_steps=4, **extra):
    train = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": max_steps, "learning_rate": 5e-2,
             "save_steps": 2, "eval_batch_size": 4, "save_total_limit": 5, "eval_steps": 1000}
    rollout = {"engine": "vllm", "max_new_tokens": 8, "temperature": 0.9,
               "vllm": {"mode": "server", "url": url, "dtype": "float32", "startup_timeout_s": 300,
                        "request_timeout_s": 120, "secret_file": str(root / "rollout_secret")}}
    if stage == "grpo":
        section = {"grpo": {"num_generations": 2, "rollout_batch_size": 8, "beta": 0.1}}
        reward = {"functions": [{"function": str(root / "my_rewards.py") + ":length_reward"}]}
    else:
        section = {"ppo": {"rollout_batch_size": 4, "ppo_epochs": 2, "kl_coef": 0.05}}
        reward = {"function": str(root / "my_rewards.py") + ":length_reward"}
    return write_recipe(root, name, stage, model={"from_run": str(root / "sft")},
                        data={"datasets": [{"path": str(root / "prompts.jsonl")}], "max_length": 64, "val_size": 4},
                        rollout=rollout, reward=reward, train=train, output={"dir": str(root / name)},
                        **section, **COMMON, **extra)


def start_server(root, recipe, port):
    env = {**os.environ, "LLMTUNE_VLLM_ENGINE_ARGS": ENGINE_ARGS}
    log = (root / f"server_{port}.log").open("w")
    process = subprocess.Popen([sys.executable, "-m", "llmtune", "rollout-server", str(recipe), "--port", str(port)],
                               stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    secret = (root / "rollout_secret").read_text().strip()  # the recipe's rollout.vllm.secret_file
    VLLMClient(f"http://127.0.0.1:{port}", 60, process, root / f"server_{port}.log", secret).wait_healthy(400)
    return process, VLLMClient(f"http://127.0.0.1:{port}", 60, secret=secret)


def stop(process):
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(30)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    # hidden 128 = head size 32: the smallest vLLM's CPU attention takes
    root = rl_workspace(tmp_path_factory.mktemp("vllm_rl"), hidden_size=128)
    (root / "rollout_secret").write_text("the-shared-secret-of-this-test\n")
    return root


@pytest.fixture(scope="module")
def server(workspace):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    process, client = start_server(workspace, rl_recipe(workspace, "server", "grpo", url), port)
    print(f"rollout server started in {time.perf_counter() - start:.1f} s")
    yield url, process, client
    stop(process)


def _check_run(run, steps):
    logs = list(read_jsonl(run / "metrics.jsonl"))
    assert [r["step"] for r in logs if "loss" in r] == list(range(1, steps + 1))
    rollouts = [r for r in logs if "rollout/logprob_diff_max" in r]
    assert rollouts
    for r in rollouts:  # fp32 engine and trainer: the engine's log-probs of its samples are the trainer's
        assert r["rollout/logprob_diff_max"] < 2e-4, r
    assert (run / "lineage.json").is_file() and (run / "adapter" / "adapter_model.safetensors").is_file()
    return logs


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_two_iterations_train_checkpoint_and_resume(workspace, server, stage):
    url, _, client = server
    recipe = rl_recipe(workspace, stage, stage, url, max_steps=4)  # 2 iterations of 2 optimizer steps
    assert main([stage, str(recipe)]) == 0
    run = workspace / stage
    _check_run(run, 4)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert client.health()["version"] == 4  # the last sync: the policy after 4 optimizer steps (final eval)
    # resume: the same run trained further picks up at step 4 and samples from the resumed policy
    assert main([stage, str(recipe), "train.max_steps=6", "train.resume_from=latest"]) == 0
    _check_run(run, 6)
    assert client.health()["version"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness", [0, 2])
def test_two_trainer_ranks_sample_through_one_server(workspace, server, max_staleness):
    """2 processes on gloo, one server: rank 0 uploads each version once, both ranks sample with it; with
    max_staleness, both sample ahead and every rollout's version tag is the step it was submitted at."""
    url, _, client = server
    name = f"two_ranks_{max_staleness}"
    # 2 optimizer steps per iteration (rollout batch 8 = 2 x global batch 4): max_staleness 2 = one iteration ahead
    recipe = rl_recipe(workspace, name, "grpo", url, max_steps=6)
    doc = yaml.safe_load(recipe.read_text())
    doc["rollout"]["max_staleness"] = max_staleness
    doc["train"]["logging_steps"] = 2  # one log per iteration
    recipe.write_text(yaml.safe_dump(doc))
    assert main(["grpo", str(recipe), "--nproc-per-node", "2"]) == 0
    logs = [r for r in read_jsonl(workspace / name / "metrics.jsonl") if "rollout/logprob_diff_max" in r]
    assert len(logs) == 3  # 3 iterations
    if max_staleness:  # iteration 0 from step 0; iterations 1, 2 sampled one iteration (2 steps) ahead, all ranks
        assert [r["rollout/staleness_mean"] for r in logs] == [0.0, 2.0, 2.0]
        assert all(r["rollout/stale_dropped_fraction"] == 0.0 for r in logs)
    else:
        assert all(r["rollout/logprob_diff_max"] < 2e-4 for r in logs)
        assert not any("rollout/staleness_mean" in r for r in logs)
    # one identity per version for both ranks: the server holds the last two versions, one adapter each
    health = client.health()
    assert health["version"] == 6 and len(health["adapters"]) == 2
    assert len({a.rsplit("-v", 1)[0] for a in health["adapters"]}) == 1


@pytest.mark.slow
def test_rollouts_spread_over_two_servers(workspace, server):
    url, _, client = server
    port = _free_port()
    second_process, second = start_server(workspace, workspace / "server.yaml", port)
    try:
        urls = [url, f"http://127.0.0.1:{port}"]
        recipe = rl_recipe(workspace, "two_servers", "grpo", urls, max_steps=2)
        before = [client.health(), second.health()]
        assert main(["grpo", str(recipe)]) == 0
        logs = [r for r in read_jsonl(workspace / "two_servers" / "metrics.jsonl") if "loss" in r]
        assert [r["step"] for r in logs] == [1, 2]
        diffs = [r["rollout/logprob_diff_max"] for r in logs if "rollout/logprob_diff_max" in r]
        assert diffs and all(d < 2e-4 for d in diffs)  # both serve the policy of the step
        # every server holds the run's versions: the same identity on both
        after = [client.health(), second.health()]
        assert after[0]["version"] == after[1]["version"] == 2
        assert after[0]["adapters"] == after[1]["adapters"] and after[0]["adapters"] != before[0]["adapters"]
        # both sampled: the iteration's 8 prompts + 4 greedy eval prompts per evaluation, spread over the two
        evals = [r for r in read_jsonl(workspace / "two_servers" / "metrics.jsonl") if "eval_reward" in r]
        served = [a["prompts_served"] - b["prompts_served"] for a, b in zip(after, before)]
        assert sum(served) == 8 + 4 * len(evals) and min(served) > 0, (served, len(evals))
    finally:
        stop(second_process)


def test_a_server_of_another_base_is_refused(workspace, server, capfd):
    from llmtune.config import load_recipe
    from llmtune.rl.engines.vllm_base import base_identity

    url, _, client = server
    # the server states the identity of the base it serves: the SFT chain of its recipe
    assert client.health()["base_id"] == base_identity(load_recipe(workspace / "server.yaml"))
    # a run of the plain model (no SFT adapter below its policy) must not sample from the SFT chain's server
    recipe = rl_recipe(workspace, "other_base", "grpo", url, max_steps=2)
    doc = yaml.safe_load(recipe.read_text())
    doc["model"] = {"name_or_path": str(workspace / "model")}
    recipe.write_text(yaml.safe_dump(doc))
    code = main(["grpo", str(recipe)])
    err = capfd.readouterr().err
    assert code == 69
    lines = re.findall(r"error: [^\r\n]*", err)
    assert len(lines) == 1 and f"the rollout server {url} serves another base model" in lines[0], err[-3000:]
    assert not list((workspace / "other_base").glob("checkpoints/checkpoint-*"))  # refused before training


def test_the_real_server_lets_no_one_in(workspace, server, capfd):
    import base64
    import pickle

    from llmtune.rl.engines.vllm_client import RolloutEngineError, _HTTPStatus

    url, _, client = server
    for secret in (None, "another-secret"):  # over HTTP, against the running vLLM server: 401, with the fix
        with pytest.raises(RolloutEngineError, match=r"refused this trainer's secret \(HTTP 401\)"):
            VLLMClient(url, 10, secret=secret).health()
    version = client.health()["version"]
    for weights in (pickle.dumps({"lora_A": [0.0]}), b"\0" * 64):  # not safetensors: 400, nothing loaded
        body = {"version": 99, "adapter_id": "intruder", "adapter_config": {"peft_type": "LORA", "r": 4},
                "adapter_model": base64.b64encode(weights).decode()}
        with pytest.raises(_HTTPStatus, match="safetensors") as refused:
            client._request("POST", "/adapter", body)
        assert refused.value.code == 400
    assert client.health()["version"] == version and "intruder" not in client.health()["adapters"]
    # a trainer with the wrong secret: exit 1 (a configuration problem a retry cannot fix, not 69), one error line
    # naming the fix, nothing trained
    (workspace / "wrong_secret").write_text("not-the-servers-secret")
    recipe = rl_recipe(workspace, "wrong_secret_run", "grpo", url, max_steps=2)
    code = main(["grpo", str(recipe), f"rollout.vllm.secret_file={workspace / 'wrong_secret'}"])
    err = capfd.readouterr().err
    lines = re.findall(r"error: [^\r\n]*", err)
    assert code == 1 and len(lines) == 1 and "refused this trainer's secret" in lines[0], err[-3000:]
    assert not (workspace / "wrong_secret_run" / "adapter").exists()
    assert "the-shared-secret" not in err and "not-the-servers-secret" not in err  # never printed


def test_rollout_server_beyond_loopback_needs_a_secret_and_prints_a_reachable_url(workspace, capfd, monkeypatch):
    monkeypatch.delenv("LLMTUNE_ROLLOUT_SECRET", raising=False)
    recipe = rl_recipe(workspace, "remote", "grpo", "http://127.0.0.1:1", max_steps=2)
    doc = yaml.safe_load(recipe.read_text())
    del doc["rollout"]["vllm"]["secret_file"]
    recipe.write_text(yaml.safe_dump(doc))
    code = main(["rollout-server", str(recipe), "--host", "0.0.0.0", "--print-only"])
    err = capfd.readouterr().err
    assert code != 0 and "not loopback" in err and "Traceback" not in err
    assert not (workspace / "remote.rollout_base").exists()  # refused before building anything
    monkeypatch.setenv("LLMTUNE_ROLLOUT_SECRET", "from-the-environment")
    assert main(["rollout-server", str(recipe), "--host", "0.0.0.0", "--port", "8123", "--print-only"]) == 0
    err = capfd.readouterr().err
    assert f"http://{socket.getfqdn()}:8123" in err and "0.0.0.0:8123" not in err.split("\n")[0]
    assert "from-the-environment" not in err  # the secret reaches the server in its environment only
    assert "--gpu-memory-utilization" not in err or "--gpu-memory-utilization 0.9" in err


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_server_killed_mid_run_then_the_same_command_resumes(workspace, server, capfd, request, max_staleness):
    """Synchronous, and asynchronous (issue 33: the server dies while the next batch is sampled ahead in the
    background): exit 69, one error line, a checkpoint that resumes. A server of its own (killed here), started
    from the ``server`` fixture's recipe (``server.yaml``)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process, _ = start_server(workspace, workspace / "server.yaml", port)
    request.addfinalizer(lambda: process.poll() is None and stop(process))  # a failure before the kill
    name = f"killed{max_staleness}"
    recipe = rl_recipe(workspace, name, "grpo", url, max_steps=6)
    # the reward function kills the server at its second call (the first: the evaluation before training), while
    # scoring iteration 1: iteration 1 trains and is checkpointed, iteration 2 cannot sample
    marker = workspace / "kill_at_call_2"
    marker.write_text(str(process.pid))
    (workspace / "killer.py").write_text(f"""import os, pathlib, signal
calls = []
def reward(prompts, completions):
    calls.append(1)
    marker = pathlib.Path({str(marker)!r})
    if len(calls) == 2 and marker.is_file():
        os.killpg(int(marker.read_text()), signal.SIGKILL)
        marker.unlink()
    return [float(len(c) % 7) for c in completions]
""")
    doc = yaml.safe_load(recipe.read_text())
    doc["reward"] = {"functions": [{"function": str(workspace / "killer.py") + ":reward"}]}
    doc["rollout"]["max_staleness"] = max_staleness  # 2 = the optimizer steps of one rollout batch (8 / 4)
    recipe.write_text(yaml.safe_dump(doc))
    code = main(["grpo", str(recipe)])
    err = capfd.readouterr().err
    assert code == 69
    lines = re.findall(r"error: [^\r\n]*", err)  # (progress bars share stderr: not always at a line start)
    assert len(lines) == 1 and f"the rollout server {url} is unreachable or died" in lines[0], err[-3000:]
    assert "llmtune rollout-server" in lines[0] and "rerun the same command" in lines[0]
    run = workspace / name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-2"]
    # the server comes back (same port) and the same command resumes from step 2
    process.wait()
    new, _ = start_server(workspace, workspace / "server.yaml", port)
    try:
        assert main(["grpo", str(recipe)]) == 0
    finally:
        stop(new)
    logs = list(read_jsonl(run / "metrics.jsonl"))
    assert [r["step"] for r in logs if "loss" in r] == [1, 2, 3, 4, 5, 6]  # steps 1-2, then resumed 3-6
