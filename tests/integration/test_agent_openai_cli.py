"""`llmtune grpo` / `llmtune ppo` with an agent program of your own (agent.openai) through the CLI, on the tiny
tool-calling model (tests/integration/agent_workspace.py): validate refuses what cannot work before any weights; a
run logs the joins, splits and segments of the agents' requests and trains on every segment; an agent's reward is
the source `agent`; PPO trains segments too; a run resumed from its checkpoint reproduces the uninterrupted one."""

import json

import pytest

from llmtune.commands.cli import main
from llmtune.utils import read_jsonl
from tests.integration.rl_workspace import cut_back_to_first_iteration
from tests.integration.test_agent_cli import adapter_sha, losses, recipe, workspace  # noqa: F401 - fixture

pytest.importorskip("openai")

AGENT = """import json
from openai import BadRequestError, OpenAI
from transformers.utils import get_json_schema

from llmtune.tools import calculator

TOOLS = [get_json_schema(calculator)]


def solve(base_url, api_key, row, seed):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["messages"])
    for _ in range(3):
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        except BadRequestError:
            return None
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculator(**json.loads(call.function.arguments))
            except Exception as exc:
                result = f"Error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return 1.0 if (message.content or "").strip().endswith("#### 5") else None


def rewrites(base_url, api_key, row, seed):
    \"\"\"Asks, then summarises its memory and asks again: two segments per rollout.\"\"\"
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    question = list(row["messages"])
    first = client.chat.completions.create(model="policy", messages=question, tools=TOOLS, max_tokens=24)
    summary = [{"role": "system", "content": "Notes: " + (first.choices[0].message.content or "a call")[:40]},
               *question]
    last = client.chat.completions.create(model="policy", messages=summary, tools=TOOLS, max_tokens=24)
    return float(len(last.choices[0].message.content or "") % 3) / 2
"""


@pytest.fixture(scope="module")
def agents(workspace):  # noqa: F811 - the fixture of test_agent_cli
    (workspace / "my_agent.py").write_text(AGENT)
    return workspace


def program(root, name, function="my_agent.py:solve", concurrency=4, **extra):
    agent = {"tools": [], "openai": {"function": str(root / function.split(":")[0]) + ":" + function.split(":")[1],
                                     "concurrency": concurrency, "timeout_s": 120}, "max_turns": 3}
    path = recipe(root, name, **extra)
    import yaml

    doc = yaml.safe_load(path.read_text())
    doc["agent"] = {**agent, **extra.get("agent", {})}
    path.write_text(yaml.safe_dump(doc))
    return path


def test_validate_refuses_an_agent_program_beside_llmtunes_tools_and_a_missing_function(agents, capsys):
    assert main(["validate", str(program(agents, "v_prog"))]) == 0, capsys.readouterr().err
    bad = program(agents, "v_both", agent={"tools": ["llmtune.tools:calculator"]})
    assert main(["validate", str(bad)]) == 1
    assert "agent.openai: an agent program runs its own tools" in capsys.readouterr().err
    assert main(["validate", str(program(agents, "v_missing", function="my_agent.py:sovle"))]) == 1
    err = capsys.readouterr().err
    assert "agent.openai.function" in err and "did you mean solve" in err


def test_a_run_trains_every_segment_and_logs_joins_and_splits(agents):
    assert main(["grpo", str(program(agents, "segments", function="my_agent.py:rewrites", max_steps=2))]) == 0
    run = agents / "segments"
    rollouts = [r for r in read_jsonl(run / "metrics.jsonl") if "agent/requests" in r]
    assert len(rollouts) == 1  # one iteration: 4 rollouts = 2 optimizer steps of 2
    for r in rollouts:
        assert (r["agent/requests"], r["agent/joins"], r["agent/splits"], r["agent/segments"]) == (2, 0, 1, 2)
        assert r["agent/infrastructure_failures"] == 0 and "rewards/agent_mean" in r
    samples = list(read_jsonl(run / "samples.jsonl"))
    assert all(s["rewards"]["agent"] is not None and s["messages"][0]["role"] == "system" for s in samples)
    assert (run / "adapter" / "adapter_model.safetensors").is_file()


def test_ppo_trains_an_agent_programs_segments(agents):
    path = program(agents, "ppo_segments", function="my_agent.py:rewrites", max_steps=1, stage="ppo",
                   ppo={"rollout_batch_size": 2, "ppo_epochs": 1})
    assert main(["ppo", str(path)]) == 0
    rollouts = [r for r in read_jsonl(agents / "ppo_segments" / "metrics.jsonl") if "agent/segments" in r]
    assert rollouts and rollouts[0]["agent/segments"] == 2 and "kl" in rollouts[0]


@pytest.mark.slow
def test_a_run_with_an_agent_program_resumes_exactly(agents):
    """Every request draws from its own seed (the built-in loop's turn seed, from the seed the trainer draws per
    iteration), so a resumed run samples what the uninterrupted one sampled; one agent at a time (concurrency 1),
    so that no engine call pads a prompt to another width (which moves a logit by float rounding)."""
    assert main(["grpo", str(program(agents, "whole_prog", concurrency=1))]) == 0
    run = agents / "whole_prog"
    rollouts = [r for r in read_jsonl(run / "metrics.jsonl") if "agent/requests" in r]
    # tool rounds, joined by ids, in some iteration: at temperature 1 the tiny model's samples depend on the CPU's
    # float rounding, and on some CPUs one iteration writes only malformed calls (no tool round to join)
    assert rollouts and any(r["agent/joins"] > 0 for r in rollouts)
    halves = agents / "halves_prog"
    cut_back_to_first_iteration(run, halves)
    resumed = program(agents, "halves_prog", concurrency=1)
    assert main(["grpo", str(resumed), "train.resume_from=latest"]) == 0
    assert losses(halves) == losses(run)
    assert adapter_sha(halves) == adapter_sha(run)
    assert json.loads((halves / "lineage.json").read_text())["stage"] == "grpo"
