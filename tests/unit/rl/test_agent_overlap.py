"""Multi-turn rollouts that advance on their own (llmtune.rl.agent, issue 40): a rollout whose tool returns at once
finishes all its turns while another's tool still runs; async tools are awaited together and plain tools run in a
pool of agent.tool_threads threads; an environment's slow set-up delays only its own rollout; every turn carries a
seed of (batch seed, rollout, turn), the same whatever the timing; the trajectories (ids, masks, outcome) are those
of the lock-step loop; an engine error or a tool's bug reaches the caller. A scripted engine (a RolloutEngine: it
takes the per-turn seeds) answers each rollout's turn t from its own script, on the tiny tokenizer (chatml_tools)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from llmtune.data.prompts import prompt_ids
from llmtune.data.templates import stop_token_ids
from llmtune.rl.agent import AgentLoop, AgentSettings, turn_seed
from llmtune.rl.chat import ToolTurns
from llmtune.rl.engines.base import RolloutEngine
from llmtune.rl.toolbox import ToolOutput, ToolSetupError, tool_schemas
from llmtune.rl.types import ERROR, STOP, Completion, SamplingParams
from tests.unit.rl.test_agent import call, tok  # noqa: F401 - tok is a fixture


class ScriptEngine(RolloutEngine):
    """Answers turn t of the rollout whose question names script ``k`` with ``scripts[k][t]`` (+ the stop token),
    whatever batch it comes in; records every call (the scripts and turns it held, their seeds) in order."""

    seeds_per_prompt = True

    def __init__(self, tok, scripts: dict[str, list[str]], on_turn=None):
        self.tok, self.scripts, self.on_turn = tok, scripts, on_turn
        self.stop = stop_token_ids(tok)[0]
        self.calls: list[list[tuple[str, int, int | None]]] = []
        self.lock = threading.Lock()

    def generate(self, prompts, sampling, budgets=None, keys=None, version=None, seeds=None):
        out, batch = [], []
        for b, prompt in enumerate(prompts):
            text = self.tok.decode(prompt)
            name = next(k for k in self.scripts if f"script {k}." in text)
            turn = text.count("<|im_start|>assistant") - 1  # the generation prompt's header is the last one
            batch.append((name, turn, None if seeds is None else seeds[b]))
            ids = self.tok(self.scripts[name][turn], add_special_tokens=False)["input_ids"] + [self.stop]
            limit = budgets[b] if budgets else sampling.max_new_tokens
            out.append(Completion(ids[:limit], None, STOP if len(ids) <= limit else "length", 0))
            if self.on_turn is not None:
                self.on_turn(name, turn)
        with self.lock:
            self.calls.append(batch)
        return out

    def sync(self, version):
        pass

    def close(self):
        pass


def loop(tok, engine, tools, lockstep=False, tool_threads=32, timeout_s=10.0, environment=None):
    schemas = tool_schemas(list(tools), environment)
    settings = AgentSettings(6, 64, timeout_s, "hermes", False, None, (), tool_threads, lockstep)
    return AgentLoop(engine, tok, ToolTurns(tok, schemas, stop_token_ids(tok)), list(tools), environment, settings,
                     lambda messages: prompt_ids(tok, messages, tools=schemas), 512)


def rows(tok, names, tools, environment=None):
    schemas = tool_schemas(list(tools), environment)
    out = []
    for i, name in enumerate(names):
        messages = [{"role": "user", "content": f"Run script {name}."}]
        out.append({"input_ids": prompt_ids(tok, messages, tools=schemas), "messages": json.dumps(messages),
                    "prompt": messages[0]["content"], "reference": "", "index": i})
    return out


def sampling(tok, seed=1234):
    return SamplingParams(4096, tuple(stop_token_ids(tok)), temperature=0.7, seed=seed)


# ---- ordering ----------------------------------------------------------------------------------------------
def test_a_fast_rollout_finishes_its_turns_while_a_slow_tool_still_runs(tok):
    """Rollout "slow" calls a tool that returns only once rollout "fast" has sampled its LAST turn (or after 5 s).
    Each rollout on its own: "fast" samples its three turns while "slow" waits, then "slow" goes on. In lock-step
    (main before issue 40) "fast"'s second turn waits for "slow"'s tool: the tool gives up after 5 s."""
    fast_done = threading.Event()

    def quick(x: int) -> str:
        """Answer at once.

        Args:
            x: anything
        """
        return "ok"

    def wait_for_fast(x: int) -> str:
        """Answer once the fast rollout is done.

        Args:
            x: anything
        """
        return "after fast" if fast_done.wait(5) else "gave up"

    scripts = {"fast": [call("quick", {"x": 1}), call("quick", {"x": 2}), "Done fast."],
               "slow": [call("wait_for_fast", {"x": 1}), "Done slow."]}
    engine = ScriptEngine(tok, scripts, on_turn=lambda name, turn: name == "fast" and turn == 2 and fast_done.set())
    agent = loop(tok, engine, (quick, wait_for_fast))
    slow, fast = agent.run(rows(tok, ["slow", "fast"], (quick, wait_for_fast)), sampling(tok))
    assert slow.outcome.messages[2]["content"] == "after fast"  # its tool saw "fast" finish first
    assert (fast.turns, fast.finish_reason, slow.turns, slow.finish_reason) == (3, STOP, 2, STOP)
    order = [(n, t) for batch in engine.calls for n, t, _ in batch]
    assert order.index(("fast", 2)) < order.index(("slow", 1))  # fast's last turn before slow's second
    assert engine.calls[0] == [("slow", 0, turn_seed(1234, 0, 0)), ("fast", 0, turn_seed(1234, 1, 0))]  # one batch


def test_lockstep_waits_for_every_tool_of_the_turn(tok):
    """agent.lockstep: one engine call per turn for every active rollout; the tools of a turn are called one after
    another (the loop as it was before issue 40)."""
    ran = []

    def quick(x: int) -> str:
        """Record a call.

        Args:
            x: anything
        """
        ran.append(x)
        return "ok"

    scripts = {"a": [call("quick", {"x": 1}), call("quick", {"x": 3}), "A."], "b": [call("quick", {"x": 2}), "B."]}
    engine = ScriptEngine(tok, scripts)
    a, b = loop(tok, engine, (quick,), lockstep=True).run(rows(tok, ["a", "b"], (quick,)), sampling(tok))
    assert [[(n, t) for n, t, _ in batch] for batch in engine.calls] == [
        [("a", 0), ("b", 0)], [("a", 1), ("b", 1)], [("a", 2)]]
    assert ran == [1, 2, 3] and (a.turns, b.turns) == (3, 2)


# ---- tools: async awaited together, plain ones in a bounded pool -----------------------------------------------
def test_async_tools_are_awaited_together_and_not_bounded_by_the_tool_threads(tok):
    """Four rollouts, each calling an async tool that returns only when all four calls are in flight at once:
    awaited concurrently on the rollouts' event loop, even with a single tool thread."""
    state = {"in_flight": 0, "most": 0}

    async def gather(x: int) -> str:
        """Wait for the other calls.

        Args:
            x: anything
        """
        state["in_flight"] += 1
        state["most"] = max(state["most"], state["in_flight"])
        deadline = time.monotonic() + 5
        while state["most"] < 4 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        state["in_flight"] -= 1
        return "together" if state["most"] >= 4 else "alone"

    names = ["a", "b", "c", "d"]
    engine = ScriptEngine(tok, {n: [call("gather", {"x": 1}), "Done."] for n in names})
    trajectories = loop(tok, engine, (gather,), tool_threads=1).run(rows(tok, names, (gather,)), sampling(tok))
    assert [t.outcome.messages[2]["content"] for t in trajectories] == ["together"] * 4
    assert state["most"] == 4


def test_plain_tools_run_in_a_pool_of_tool_threads(tok):
    """Four rollouts call a plain tool at once: at most agent.tool_threads = 2 of them run together, and more than
    one does (in lock-step they ran one after another)."""
    lock, state = threading.Lock(), {"in_flight": 0, "most": 0}

    def busy(x: int) -> str:
        """Take a while.

        Args:
            x: anything
        """
        with lock:
            state["in_flight"] += 1
            state["most"] = max(state["most"], state["in_flight"])
        time.sleep(0.3)
        with lock:
            state["in_flight"] -= 1
        return "done"

    names = ["a", "b", "c", "d"]
    engine = ScriptEngine(tok, {n: [call("busy", {"x": 1}), "Done."] for n in names})
    trajectories = loop(tok, engine, (busy,), tool_threads=2).run(rows(tok, names, (busy,)), sampling(tok))
    assert all(t.outcome.tool_errors == {} and t.turns == 2 for t in trajectories)
    assert state["most"] == 2


# ---- environments ---------------------------------------------------------------------------------------------
class Sandbox:
    """An environment whose set-up takes long for one rollout: the others go on meanwhile."""

    started = threading.Event()
    done: list[str] = []

    def reset(self, prompt: str) -> None:
        self.name = prompt.split()[-1].rstrip(".")
        if self.name == "slowstart":
            Sandbox.started.wait(5)  # released when "quick" has finished all its turns

    def step(self, x: int) -> str:
        """Act.

        Args:
            x: anything
        """
        return f"{self.name} acted"


def test_a_slow_environment_set_up_delays_only_its_own_rollout(tok):
    Sandbox.started.clear()
    scripts = {"quick": [call("step", {"x": 1}), "Done."], "slowstart": [call("step", {"x": 1}), "Done."]}
    engine = ScriptEngine(tok, scripts, on_turn=lambda n, t: n == "quick" and t == 1 and Sandbox.started.set())
    slow, quick = loop(tok, engine, (), environment=Sandbox).run(rows(tok, ["slowstart", "quick"], (), Sandbox),
                                                                 sampling(tok))
    order = [(n, t) for batch in engine.calls for n, t, _ in batch]
    assert order.index(("quick", 1)) < order.index(("slowstart", 0))  # quick finished before slowstart began
    assert [m["content"] for m in slow.outcome.messages if m["role"] == "tool"] == ["slowstart acted"]
    assert (slow.turns, quick.turns) == (2, 2)


# ---- seeds, and the same trajectories as lock-step ----------------------------------------------------------------
def test_every_turn_is_seeded_by_its_rollout_and_turn_whatever_the_timing(tok):
    """The same batch with the slow tool on rollout 0, then on rollout 1: the engine's batches differ, the seed of
    every (rollout, turn) does not, and it is turn_seed(batch seed, rollout, turn)."""

    def run(slow_name):
        def work(x: int) -> str:
            """Work.

            Args:
                x: which rollout
            """
            time.sleep(0.4 if x == slow_name else 0.0)
            return "worked"

        scripts = {n: [call("work", {"x": i}), call("work", {"x": i}), "Done."] for i, n in enumerate(["p", "q"])}
        engine = ScriptEngine(tok, scripts)
        loop(tok, engine, (work,)).run(rows(tok, ["p", "q"], (work,)), sampling(tok, seed=99))
        return engine

    first, second = run(0), run(1)
    seeds = lambda engine: sorted((n, t, s) for batch in engine.calls for n, t, s in batch)  # noqa: E731
    assert seeds(first) == seeds(second) == sorted((n, t, turn_seed(99, b, t)) for b, n in enumerate("pq")
                                                   for t in range(3))
    assert len({s for _, _, s in seeds(first)}) == 6  # no two turns share a seed
    assert [len(b) for b in first.calls] != [2, 2, 2]  # the batches did follow the timing


def test_the_trajectories_are_the_lockstep_loops(tok):
    """Ids, loss masks, turns, finish reasons and outcomes (messages, calls, errors, per-turn rewards) of the same
    scripted rollouts: identical in both schedules."""

    def scored(x: int) -> ToolOutput:
        """Answer with a reward.

        Args:
            x: anything
        """
        return ToolOutput(f"value {x}", reward=0.5 * x)

    scripts = {"a": [call("scored", {"x": 1}), call("scored", {"y": 2}), "A done."],
               "b": [call("nope", {}), "B done."], "c": ["Straight answer."]}
    names = ["a", "b", "c"]
    got = [loop(tok, ScriptEngine(tok, scripts), (scored,), lockstep=lockstep).run(rows(tok, names, (scored,)),
                                                                                    sampling(tok))
           for lockstep in (True, False)]
    for old, new in zip(*got):
        assert (old.completion_ids, old.loss_mask, old.turns, old.finish_reason) == \
            (new.completion_ids, new.loss_mask, new.turns, new.finish_reason)
        o, n = old.outcome, new.outcome
        assert (o.messages, o.tool_calls, o.tool_errors, o.turn_rewards) == \
            (n.messages, n.tool_calls, n.tool_errors, n.turn_rewards)
    assert got[1][0].outcome.turn_rewards == [0.5, 0.0, 0.0] and got[1][0].outcome.tool_errors == {"bad_arguments": 1}


# ---- failures ------------------------------------------------------------------------------------------------
def test_an_infrastructure_failure_ends_only_its_rollout(tok):
    from llmtune.rl.toolbox import InfrastructureError

    def fragile(x: int) -> str:
        """Fail for x = 0.

        Args:
            x: anything
        """
        if x == 0:
            raise InfrastructureError("the sandbox is down")
        return "fine"

    scripts = {"down": [call("fragile", {"x": 0}), "never"], "up": [call("fragile", {"x": 1}), "Done."]}
    down, up = loop(tok, ScriptEngine(tok, scripts), (fragile,)).run(rows(tok, ["down", "up"], (fragile,)),
                                                                     sampling(tok))
    assert down.finish_reason == ERROR and "the sandbox is down" in down.outcome.infrastructure_error
    assert up.finish_reason == STOP and up.turns == 2


class Broken(ScriptEngine):
    def generate(self, prompts, *args, **kwargs):
        if len(self.calls) == 1:
            self.calls.append([])
            raise RuntimeError("the engine died")
        return super().generate(prompts, *args, **kwargs)


def test_an_engine_error_or_a_tools_bug_reaches_the_caller_and_the_loop_goes_on(tok):
    def quick(x: int) -> str:
        """Answer at once.

        Args:
            x: anything
        """
        return "ok"

    def buggy(x: int) -> ToolOutput:
        """Return a reward that is not a number.

        Args:
            x: anything
        """
        return ToolOutput("x", reward=float("nan"))

    scripts = {"a": [call("quick", {"x": 1}), "Done."], "b": [call("buggy", {"x": 1}), "Done."]}
    agent = loop(tok, Broken(tok, scripts), (quick, buggy))
    with pytest.raises(RuntimeError, match="the engine died"):
        agent.run(rows(tok, ["a"], (quick, buggy)), sampling(tok))
    with pytest.raises(ToolSetupError, match="a reward must be a finite number"):
        agent.run(rows(tok, ["b", "a"], (quick, buggy)), sampling(tok))
    agent.engine = ScriptEngine(tok, scripts)
    [a] = agent.run(rows(tok, ["a"], (quick, buggy)), sampling(tok))  # the same loop still works
    assert a.turns == 2 and a.finish_reason == STOP
