"""`llmtune grpo` with multi-turn tool rollouts (agent:) through the CLI, on the tiny tool-calling model
(tests/integration/agent_workspace.py): validate checks the template before any weights; a run logs the agent
metrics and writes whole conversations to samples.jsonl; reward functions receive the conversation; a rollout whose
infrastructure failed abstains; a run resumed from its checkpoint reproduces the uninterrupted one; with the vLLM
engine killed mid-run, the same command resumes exactly."""

import hashlib
import json
import os
import re

import pytest
import yaml

from llmtune.commands.cli import main
from llmtune.rl.engines.vllm_client import vllm_python
from llmtune.utils import read_jsonl
from tests.integration.rl_workspace import cut_back_to_first_iteration
from tests.integration.agent_workspace import tool_calling_model

REWARDS = """import json, pathlib
seen = pathlib.Path(__file__).with_name("seen_messages.jsonl")

def answer(prompts, completions, references, messages, environments, rows):
    with seen.open("a") as f:  # what a reward function is given
        for m, env, row in zip(messages, environments, rows):
            f.write(json.dumps({"roles": [x["role"] for x in m], "environment": env is not None,
                                "row": sorted(row)}) + "\\n")
    return [1.0 if c.strip().endswith("#### 5") else float(len(c) % 3) / 4 for c in completions]
"""

BROKEN_TOOL = """from llmtune.rl.toolbox import InfrastructureError

calls = []

def calculator(expression: str) -> str:
    \"\"\"Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 * 7 + 3) / 2".
    \"\"\"
    calls.append(1)
    if len(calls) % 2:
        raise InfrastructureError("the sandbox is down")
    return "5"
"""  # the schema of llmtune.tools.calculator (the prompt the model learned); a sandbox down on every other call


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("agent_cli")
    tool_calling_model(root / "model")
    rows = [{"prompt": "What is 2 + 3?", "completion": "#### 5"}] * 4 + [
        {"prompt": f"What is {a} + {b}?", "completion": f"#### {a + b}"} for a in (3, 4) for b in (1, 2)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "memorised.jsonl").write_text("".join(json.dumps(rows[0]) + "\n" for _ in range(8)))
    (root / "answer_rewards.py").write_text(REWARDS)
    (root / "broken_tools.py").write_text(BROKEN_TOOL)
    return root


def recipe(root, name, max_steps=4, engine="hf", stage="grpo", **extra):
    doc = {"stage": stage, "model": {"name_or_path": str(root / "model")},
           "data": {"datasets": [{"path": str(root / "prompts.jsonl")}], "max_length": 256, "val_size": 2},
           "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
           "grpo": {"num_generations": 2, "rollout_batch_size": 4, "beta": 0.05},
           "rollout": {"max_new_tokens": 96, "engine": engine, "temperature": 1.0,
                       "vllm": {"dtype": "float32", "startup_timeout_s": 300, "request_timeout_s": 120}},
           "agent": {"tools": ["llmtune.tools:calculator"], "max_turns": 3, "max_tool_result_tokens": 32},
           "reward": {"functions": [str(root / "answer_rewards.py") + ":answer"]},
           "train": {"micro_batch_size": 2, "global_batch_size": 2, "max_steps": max_steps, "learning_rate": 1e-2,
                     "eval_batch_size": 2, "save_steps": 2, "save_total_limit": 5},
           "output": {"dir": str(root / name), "plot": False}}
    if stage == "ppo":
        doc.pop("grpo")
    for section, values in extra.items():
        doc[section] = {**doc.get(section, {}), **values}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def losses(run):
    return [(r["step"], r["loss"], r.get("reward_mean")) for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]


def adapter_sha(run):
    return hashlib.sha256((run / "adapter" / "adapter_model.safetensors").read_bytes()).hexdigest()


def test_validate_checks_the_template_before_any_weights(workspace, capsys):
    assert main(["validate", str(recipe(workspace, "v_ok"))]) == 0, capsys.readouterr().err
    assert main(["validate", str(recipe(workspace, "v_chatml", data={"chat_template": "chatml"}))]) == 1
    err = capsys.readouterr().err
    assert "data.chat_template: the chat template does not render the tool schemas and the tool calls" in err
    assert main(["validate", str(recipe(workspace, "v_badtool", agent={"tools": ["llmtune.tools:nope"]}))]) == 1
    assert "agent.tools.0" in capsys.readouterr().err


def test_a_multi_turn_run_logs_conversations_and_resumes_exactly(workspace):
    assert main(["grpo", str(recipe(workspace, "whole"))]) == 0
    run = workspace / "whole"
    logs = list(read_jsonl(run / "metrics.jsonl"))
    rollouts = [r for r in logs if "agent/turns" in r]
    # tool rounds in some iteration: at temperature 1 the tiny model's samples depend on the CPU's float rounding,
    # and on some CPUs one iteration writes only malformed calls
    assert len(rollouts) == 2 and any(r["agent/tool_calls"] > 0 and r["agent/turns"] > 1 for r in rollouts)
    assert all(r["agent/infrastructure_failures"] == 0 for r in rollouts)
    assert all(abs(sum(r[f"agent/finish_{k}"] for k in ("stop", "length", "turns", "error")) - 1) < 1e-6
               for r in rollouts)
    samples = list(read_jsonl(run / "samples.jsonl"))
    assert any([m["role"] for m in s["messages"]][:4] == ["user", "assistant", "tool", "assistant"]
               and s["turns"] >= 2 for s in samples)
    assert all({"messages", "turns", "finish_reason", "tool_calls", "tool_errors"} <= set(s) for s in samples)
    seen = list(read_jsonl(workspace / "seen_messages.jsonl"))
    assert seen and all(s["roles"][:3] == ["user", "assistant", "tool"] for s in seen if len(s["roles"]) > 2)
    assert {"prompt", "reference", "messages", "index"} <= set(seen[0]["row"])
    # the same run cut back to its first iteration (checkpoint-2) and resumed reproduces it (a run of max_steps 2
    # resumed with max_steps 4 would not: the learning-rate schedule follows max_steps)
    halves = workspace / "halves"
    cut_back_to_first_iteration(run, halves)
    assert main(["grpo", str(recipe(workspace, "halves")), "train.resume_from=latest"]) == 0
    assert losses(halves) == losses(run)
    assert adapter_sha(halves) == adapter_sha(run)


def test_an_infrastructure_failure_abstains_and_is_counted(workspace):
    path = recipe(workspace, "broken", max_steps=2, agent={"tools": [str(workspace / "broken_tools.py") + ":calculator"]},
                  data={"datasets": [{"path": str(workspace / "memorised.jsonl")}]}, rollout={"temperature": 0.3})
    assert main(["grpo", str(path)]) == 0
    logs = list(read_jsonl(workspace / "broken" / "metrics.jsonl"))
    rollouts = [r for r in logs if "agent/infrastructure_failures" in r]
    # the rollouts whose tool call met the sandbox down abstain (never scored 0) and are counted
    assert rollouts and 0 < rollouts[0]["agent/infrastructure_failures"] < 1
    assert rollouts[0]["rewards/abstained"] == pytest.approx(rollouts[0]["agent/infrastructure_failures"])
    assert rollouts[0]["trained_completion_fraction"] <= 1 - rollouts[0]["agent/infrastructure_failures"]
    samples = list(read_jsonl(workspace / "broken" / "samples.jsonl"))
    failed = [s for s in samples if s.get("infrastructure_error")]
    assert failed and all(s["reward"] is None and not s["trained"] and s["advantage"] == 0 for s in failed)
    assert all("the sandbox is down" in s["infrastructure_error"] for s in failed)


REWARDED_TOOL = """from llmtune.rl.toolbox import ToolOutput


def calculator(expression: str) -> str:  # the schema the model learned (a str result); the content is one
    \"\"\"Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 * 7 + 3) / 2".
    \"\"\"
    return ToolOutput("5", reward=0.25)  # a per-step reward for the turn that called it
"""


def test_ppo_with_tool_shaping_and_per_turn_rewards_logs_the_task_reward_apart(workspace):
    """PPO, the memorised question, the calculator returning a per-turn reward, a cost per call and a reward for
    well-formed calls: the shaping terms are logged apart from the task reward, the per-turn reward reaches the
    samples and the task reward (eval_score) but no shaping term does."""
    (workspace / "rewarded_tools.py").write_text(REWARDED_TOOL)
    path = recipe(workspace, "shaped_ppo", max_steps=2, stage="ppo",
                  agent={"tools": [str(workspace / "rewarded_tools.py") + ":calculator"], "max_tool_calls": 2,
                         "tool_call_cost": 0.1, "well_formed_call_reward": 0.2},
                  data={"datasets": [{"path": str(workspace / "memorised.jsonl")}]}, rollout={"temperature": 0.3},
                  ppo={"rollout_batch_size": 2, "ppo_epochs": 1})
    assert main(["ppo", str(path)]) == 0
    logs = list(read_jsonl(workspace / "shaped_ppo" / "metrics.jsonl"))
    rollouts = [r for r in logs if "rewards/task_mean" in r]
    assert rollouts and all(r["agent/tool_calls"] > 0 for r in rollouts)
    for r in rollouts:  # one call each, well formed: -0.1 per call, +0.2 x 1; the overlong default is on
        assert r["rewards/tool_cost_mean"] == pytest.approx(-0.1 * r["agent/tool_calls"])
        assert r["rewards/well_formed_calls_mean"] == pytest.approx(0.2)
        assert r["rewards/turns_mean"] == pytest.approx(0.25 * r["agent/tool_calls"])
        assert "rewards/overlong_penalty_mean" in r and r["score_mean"] == pytest.approx(r["rewards/task_mean"])
    samples = list(read_jsonl(workspace / "shaped_ppo" / "samples.jsonl"))
    assert any(s.get("turn_rewards") == [0.25, 0.0] for s in samples)
    evals = [r for r in logs if "eval_score" in r]
    greedy = [s for s in read_jsonl(workspace / "shaped_ppo" / "eval_samples_step0.jsonl")]
    # the eval's score is the task reward: the answer reward plus the per-turn return, no cost, no bonus
    assert evals[0]["eval_score"] == pytest.approx(sum(s["score"] for s in greedy) / len(greedy))
    assert all(s["score"] == pytest.approx(1.25) for s in greedy if s.get("turn_rewards") == [0.25, 0.0]
               and s["response"].strip().endswith("#### 5"))


@pytest.mark.slow
@pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (bash scripts/setup.sh)")
def test_vllm_engine_killed_mid_run_then_the_same_command_resumes_exactly(workspace, capfd):
    """Colocated vLLM engine; a reward function kills the engine process while iteration 1 is scored: iteration 1
    trains and is checkpointed, iteration 2 cannot sample: exit 69; then the same command resumes from checkpoint-2
    and gives the uninterrupted run's numbers."""
    os.environ["LLMTUNE_VLLM_ENGINE_ARGS"] = json.dumps({"kv_cache_memory_bytes": 64 << 20})
    try:
        assert main(["grpo", str(recipe(workspace, "vllm_whole", engine="vllm"))]) == 0
        (workspace / "killer.py").write_text(KILLER.format(marker=str(workspace / "kill_once")))
        (workspace / "kill_once").write_text("")
        path = recipe(workspace, "vllm_killed", engine="vllm",
                      reward={"functions": [str(workspace / "killer.py") + ":answer"]})
        assert main(["grpo", str(path)]) == 69
        err = capfd.readouterr().err
        lines = re.findall(r"error: [^\r\n]*", err)
        assert len(lines) == 1 and "rollout engine process" in lines[0] and "rerun the same command" in lines[0]
        run = workspace / "vllm_killed"
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["checkpoint-2"]
        assert main(["grpo", str(path)]) == 0
    finally:
        os.environ.pop("LLMTUNE_VLLM_ENGINE_ARGS", None)
    assert losses(run) == losses(workspace / "vllm_whole")
    assert adapter_sha(run) == adapter_sha(workspace / "vllm_whole")


KILLER = """import os, pathlib, signal
import psutil

calls = []

def answer(prompts, completions, references, messages):
    calls.append(1)
    marker = pathlib.Path({marker!r})
    if len(calls) == 2 and marker.is_file():  # the eval before training, then iteration 1 (checkpoint-2 follows)
        marker.unlink()
        for child in psutil.Process().children(recursive=True):
            if "vllm_server.py" in " ".join(child.cmdline()):
                os.killpg(child.pid, signal.SIGKILL)
    return [1.0 if c.strip().endswith("#### 5") else float(len(c) % 3) / 4 for c in completions]
"""
