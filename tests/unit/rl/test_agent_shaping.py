"""What the multi-turn loop does for reward shaping of tool use (issue 39): a call that could not be read is not run,
a cap on calls per rollout, whose fault a timeout is (per tool), rewards a call returns for its turn. Scripted turns
through the real loop (llmtune.rl.agent), the tiny tokenizer under chatml_tools."""

from __future__ import annotations

import threading

import pytest

from llmtune.data.prompts import prompt_ids
from llmtune.data.templates import stop_token_ids
from llmtune.rl.agent import AgentLoop, AgentSettings
from llmtune.rl.chat import ToolTurns
from llmtune.rl.toolbox import ToolOutput, ToolSetupError, tool_schemas
from llmtune.rl.types import ERROR, LENGTH, STOP
from tests.unit.rl.test_agent import ScriptedEngine, add, call, run, tok  # noqa: F401 - tok is a fixture


def loop(tok, turns, tools, budget_turns=4, max_tool_calls=None, infrastructure_timeouts=(), timeout_s=5.0):
    schemas = tool_schemas(list(tools))
    settings = AgentSettings(budget_turns, 64, timeout_s, "hermes", False, max_tool_calls, tuple(infrastructure_timeouts))
    return AgentLoop(ScriptedEngine(tok, turns), tok, ToolTurns(tok, schemas, stop_token_ids(tok)), list(tools), None,
                     settings, lambda messages: prompt_ids(tok, messages, tools=schemas), 512)


def recorder(ran):
    def record(a: int) -> str:
        """Record a call (a side effect).

        Args:
            a: anything
        """
        ran.append(a)
        return "ok"

    return record


def test_a_call_whose_result_could_not_be_read_is_not_run(tok):
    """A turn that calls a tool with no budget left to sample after its result: the tool is not run (it may have
    side effects) and the rollout ends (length). One token more and it runs. The old loop ran it, then cut."""
    text = call("record", {"a": 1})
    turn = len(tok(text, add_special_tokens=False)["input_ids"]) + 1  # the turn's ids and its stop token
    turns = ToolTurns(tok, tool_schemas([recorder([])]), stop_token_ids(tok))
    frame = len(turns.continuation_ids([{"role": "tool", "name": "record", "content": ""}]))  # an empty result
    ran = []
    [t] = run(tok, loop(tok, [text, "Done."], (recorder(ran),)), turn + frame)  # room == the empty result's frame
    assert ran == [] and t.finish_reason == LENGTH and t.outcome.tool_calls == 0 and t.turns == 1
    assert len(t.completion_ids) == turn and t.loss_mask == [1] * turn  # nothing appended after the turn
    assert t.outcome.messages[-1]["tool_calls"][0]["function"]["name"] == "record"  # what the model wrote stays
    [t] = run(tok, loop(tok, [text, "Done."], (recorder(ran),)), turn + frame + 1)  # room for one more token
    assert ran == [1] and t.outcome.tool_calls == 1


def test_calls_beyond_the_cap_are_not_run_and_the_model_reads_why(tok):
    ran = []
    two = call("record", {"a": 1}) + "\n" + call("record", {"a": 2})
    [t] = run(tok, loop(tok, [two, call("record", {"a": 3}), "Done."], (recorder(ran),), max_tool_calls=1), 4096)
    assert ran == [1]  # the second call of turn 1 and the call of turn 2 are over the cap
    assert t.finish_reason == STOP and t.turns == 3
    assert t.outcome.tool_calls == 3 and t.outcome.tool_errors == {"over_limit": 2}
    results = [m["content"] for m in t.outcome.messages if m["role"] == "tool"]
    assert results == ["ok"] + ["Error: tool call limit reached (1 per rollout); answer with what you have"] * 2
    assert (t.outcome.checked_calls, t.outcome.well_formed_calls) == (1, 1)  # refused calls are not checked


def test_a_timeout_is_the_models_fault_or_the_infrastructures_as_the_recipe_says(tok):
    release = threading.Event()

    def slow_search(q: str) -> str:
        """Search (hangs).

        Args:
            q: the query
        """
        release.wait(30)
        return "late"

    def slow_math(x: int) -> str:
        """Compute (hangs).

        Args:
            x: a number
        """
        release.wait(30)
        return "late"

    tools = (slow_search, slow_math)
    try:
        [model] = run(tok, loop(tok, [call("slow_math", {"x": 1}), "Done."], tools, timeout_s=0.1,
                                infrastructure_timeouts=["slow_search"]), 4096)
        assert model.finish_reason == STOP and model.outcome.tool_errors == {"timeout": 1}  # fed back, scored
        assert not model.outcome.failed
        [infra] = run(tok, loop(tok, [call("slow_search", {"q": "a"}), "Done."], tools, timeout_s=0.1,
                                infrastructure_timeouts=["slow_search"]), 4096)
        assert infra.finish_reason == ERROR and infra.turns == 1  # abstains: not the model's fault
        assert infra.outcome.infrastructure_error == "tool slow_search: Error: slow_search did not return within 0.1 s"
    finally:
        release.set()


def test_a_tool_output_reward_goes_to_the_turn_that_called_it(tok):
    def guess(n: int) -> ToolOutput:
        """Guess the number.

        Args:
            n: the guess
        """
        return ToolOutput("higher" if n < 7 else "right", reward=-0.1 if n < 7 else 1.0)

    turns = [call("guess", {"n": 3}), call("guess", {"n": 5}) + "\n" + call("guess", {"n": 7}), "It is 7."]
    [t] = run(tok, loop(tok, turns, (guess,)), 4096)
    assert t.finish_reason == STOP and t.turns == 3
    assert t.outcome.turn_rewards == pytest.approx([-0.1, 0.9, 0.0])  # turn 2's two calls add up
    assert [m["content"] for m in t.outcome.messages if m["role"] == "tool"] == ["higher", "higher", "right"]
    assert len(t.turn_ends) == 3 and all(t.loss_mask[e] == 1 for e in t.turn_ends)
    [plain] = run(tok, loop(tok, [call("add", {"a": 2}), "Done."], (add,)), 4096)
    assert plain.outcome.turn_rewards == []  # no call returned a reward


def test_a_tool_output_reward_that_is_not_a_finite_number_stops_the_run(tok):
    def bad(n: int) -> ToolOutput:
        """Return a bad reward.

        Args:
            n: anything
        """
        return ToolOutput("x", reward=float("nan"))

    with pytest.raises(ToolSetupError, match=r"tool bad returned ToolOutput\(reward=nan\)"):
        run(tok, loop(tok, [call("bad", {"n": 1}), "Done."], (bad,)), 4096)
