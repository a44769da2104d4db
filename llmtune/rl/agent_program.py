"""Rollouts of an agent program of your own (``agent.openai``): your agent, run once per rollout against the
OpenAI-compatible endpoint (:mod:`llmtune.rl.endpoint`), becomes trajectories (:mod:`llmtune.rl.recorder`).

The agent is either

- a Python callable ``module:function`` (or ``file.py:function``, found as reward functions are), called as
  ``fn(base_url, api_key, row, seed)`` in a thread of its own (an ``async def`` is run to completion on an event loop
  of its own), returning the rollout's reward (a finite number) or None; or
- an external command (argv list), run once per rollout in the working directory with ``OPENAI_BASE_URL``,
  ``OPENAI_API_KEY`` (which the ``openai`` client reads by itself), ``LLMTUNE_ROW`` (the row as JSON) and
  ``LLMTUNE_SEED`` in its environment; the last line of its stdout is the reward, or empty (None).

``row`` is what an environment's ``reset`` receives (the dataset row's own columns where the prompt data kept them,
then ``prompt``, ``messages``, ``reference``, ``index``); ``seed`` is the rollout's (from the run's seed, the
iteration and the row's position: a resumed run gives each rollout the seed the uninterrupted run gave it).

``agent.openai.concurrency`` agents run at once; their requests are sampled together in batches. An agent that
raises, exits non-zero, prints something other than a number or nothing as its last line, returns something other
than a number or None, runs past ``agent.openai.timeout_s`` (a command is killed; a Python thread cannot be: it is
abandoned, its key revoked, and counted) or makes no request is an **infrastructure failure**: the rollout abstains
from every reward source and trains nothing, and is counted (``agent/infrastructure_failures``), never scored 0.
Once llmtune refused one of the rollout's requests for the rollout's own limits (the budget, ``agent.max_turns``)
the agent may fail as it likes: the rollout is scored as cut (``length`` / ``turns``).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable

from llmtune.rl.types import SamplingParams, Trajectory
from llmtune.utils import AwaitTimeout, awaited, get_logger

log = get_logger("rl")
STDERR_TAIL = 800  # characters of a failed command's stderr kept in its failure
# how long the engine waits at most, once a request reaches it idle, for the other running agents' requests: it
# samples as soon as every running agent has one pending (agents in step: one engine call per wave, as the built-in
# loop's one call per turn), and a slow agent (a long tool call) holds the others back this long at most
LINGER_S = 0.5


class AgentSetupError(Exception):
    """The agent program named by ``agent.openai`` cannot be loaded or found (recipe key, what, the fix)."""


def load_agent(function: str | None, command: list[str] | None, recipe_dir: Any = None) -> AgentProgram:
    """The :class:`AgentProgram` of ``agent.openai``.

    Raises:
        AgentSetupError: the function cannot be imported (the import error, close names), is not callable or cannot
            take four positional arguments; the command's program is not found on PATH nor as a file.
    """
    import shutil

    if function:
        from llmtune.rl.toolbox import ToolSetupError, resolve_spec

        try:
            fn = resolve_spec(function, recipe_dir, "agent.openai.function")
        except ToolSetupError as exc:
            raise AgentSetupError(str(exc)) from None
        if not callable(fn) or inspect.isclass(fn):
            raise AgentSetupError(f"agent.openai.function: {function!r} is {type(fn).__name__}, not a function")
        try:
            inspect.signature(fn).bind("url", "key", {}, 0)
        except TypeError:
            raise AgentSetupError(f"agent.openai.function: {function!r} cannot be called as fn(base_url, api_key, row, "
                                  "seed): give it those four parameters") from None
        except ValueError:  # no signature (a builtin): try it at run time
            pass
        return AgentProgram(fn=fn, name=function)
    argv = [str(a) for a in command or []]
    if not argv:
        raise AgentSetupError("agent.openai: set function (module:function) or command ([program, args...])")
    if shutil.which(argv[0]) is None and not os.path.isfile(argv[0]):
        raise AgentSetupError(f"agent.openai.command: {argv[0]!r} is neither on PATH nor a file (the command runs in "
                              "the working directory)")
    return AgentProgram(argv=argv, name=" ".join(argv))


@dataclass
class AgentProgram:
    """A loaded agent: a Python callable (``fn``) or a command (``argv``)."""

    fn: Callable | None = None
    argv: list[str] | None = None
    name: str = ""

    def run(self, base_url: str, api_key: str, row: dict, seed: int, timeout_s: float
            ) -> tuple[float | None, str | None]:
        """Run the agent for one rollout: ``(reward or None, None)`` or ``(None, what failed)``."""
        if self.fn is not None:
            return self._call(base_url, api_key, row, seed, timeout_s)
        return self._command(base_url, api_key, row, seed, timeout_s)

    def _call(self, base_url, api_key, row, seed, timeout_s):
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                value = self.fn(base_url, api_key, row, seed)
                box["value"] = awaited(value, timeout_s) if inspect.isawaitable(value) else value
            except AwaitTimeout:
                box["expired"] = True
            except BaseException as exc:  # noqa: BLE001 - SystemExit in an agent must not vanish with its thread
                box["error"] = exc

        thread = threading.Thread(target=target, name="llmtune-agent", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive() or box.get("expired"):
            if thread.is_alive():
                with _ABANDONED_LOCK:
                    _ABANDONED.append(thread)
            return None, f"the agent did not return within agent.openai.timeout_s = {timeout_s:g} s"
        if "error" in box:
            exc = box["error"]
            return None, f"the agent raised {type(exc).__name__}: {_cut(str(exc))}"
        return _reward(box.get("value"), "returned")

    def _command(self, base_url, api_key, row, seed, timeout_s):
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key,
               "LLMTUNE_ROW": json.dumps(row, ensure_ascii=False, default=str), "LLMTUNE_SEED": str(seed)}
        try:
            proc = subprocess.Popen(self.argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except OSError as exc:
            return None, f"the agent command could not start: {exc}"
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            proc.communicate()
            return None, f"the agent command did not exit within agent.openai.timeout_s = {timeout_s:g} s (killed)"
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-STDERR_TAIL:]
            return None, f"the agent command exited with status {proc.returncode}" + (f": {tail}" if tail else "")
        lines = out.decode(errors="replace").splitlines()
        last = lines[-1].strip() if lines else ""
        if last in ("", "None", "null"):
            return None, None
        try:
            value = float(last)
        except ValueError:
            return None, (f"the agent command's last line of output is {_cut(last)!r}: print the reward (a number) "
                          "last, or an empty line for none")
        return _reward(value, "printed")


def _reward(value: Any, how: str) -> tuple[float | None, str | None]:
    if value is None:
        return None, None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(float(value)):
        return None, f"the agent {how} {_cut(repr(value))}; expected a finite number (the reward) or None"
    return float(value), None


def _kill(proc: subprocess.Popen) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _cut(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def abandoned_agent_threads() -> int:
    """Python agents of this process that ran past their timeout and are still running (a thread cannot be
    killed; its key is revoked, so it cannot reach the engine)."""
    with _ABANDONED_LOCK:
        _ABANDONED[:] = [t for t in _ABANDONED if t.is_alive()]
        return len(_ABANDONED)


_ABANDONED: list[threading.Thread] = []
_ABANDONED_LOCK = threading.Lock()


def endpoint_metrics(trajectories: list[Trajectory], batch_sizes: list[int] = ()) -> dict[str, float]:
    """Per-rollout means of an agent program's rollouts (this rank): ``agent/requests`` (requests answered),
    ``agent/joins`` (requests joined by ids onto the exchange before), ``agent/splits`` (requests that started a new
    segment), ``agent/segments`` (training rows per rollout), ``agent/sampling_overridden`` (share of requests
    whose sampling settings the run replaced), and ``agent/requests_per_engine_call`` (the mean of ``batch_sizes``,
    the requests of each engine call, when given)."""
    n = max(len(trajectories), 1)
    outcomes = [t.outcome for t in trajectories]
    requests = sum(o.requests for o in outcomes)
    return {"agent/requests": requests / n, "agent/joins": sum(o.joins for o in outcomes) / n,
            "agent/splits": sum(o.splits for o in outcomes) / n,
            "agent/segments": sum(max(len(t.segments), 1) for t in trajectories) / n,
            "agent/sampling_overridden": sum(o.sampling_overridden for o in outcomes) / requests if requests else 0.0,
            **({"agent/requests_per_engine_call": sum(batch_sizes) / len(batch_sizes)} if batch_sizes else {})}


@dataclass
class EndpointSettings:
    """``agent.openai`` resolved: concurrency, timeout, where the endpoint listens; the rollout limits
    (``agent.max_turns``: requests per rollout; the model length the engine takes)."""

    concurrency: int
    timeout_s: float
    host: str
    port: int
    max_turns: int
    model_len: int


class OpenAIAgentLoop:
    """Rollouts of an agent program (see the module docstring); the rollout side calls :meth:`run` as it calls the
    built-in loop's.

    Args:
        engine: the rollout engine. program: the :class:`AgentProgram`. renderer: the run's
            :class:`llmtune.rl.recorder.Renderer`. reader: the run's :class:`llmtune.rl.endpoint.Reader`.
        settings: :class:`EndpointSettings`.
    """

    def __init__(self, engine, program: AgentProgram, renderer, reader, settings: EndpointSettings):
        self.engine, self.program, self.renderer, self.reader, self.settings = engine, program, renderer, reader, \
            settings
        self.endpoint = None
        self.batch_sizes: list[int] = []  # requests per engine call in the last run()

    def _endpoint(self):
        if self.endpoint is None:
            from llmtune.rl.endpoint import Endpoint

            self.endpoint = Endpoint(self.settings.host, self.settings.port)
            log.info("agent endpoint: http://%s:%d/v1 (one key per rollout)", self.endpoint.host, self.endpoint.port)
        return self.endpoint

    def run(self, rows: list[dict], sampling: SamplingParams, groups: list[int] | None = None,
            version: int | None = None) -> list[Trajectory]:
        """One trajectory per prompt row, each sampled by one run of the agent program.

        Args:
            rows: B prompt rows. sampling: the run's settings (``max_new_tokens``: each segment's budget; greedy
                for the evaluation; ``seed``: the batch's seed, else drawn from torch's RNG, which the trainer seeds
                per iteration; request k of rollout b is seeded as the built-in loop's turn k). groups: (B,) group
                ids (a group's requests go to one server). version: the policy version to sample with.

        Raises:
            whatever the engine raised (the run stops: a rollout engine's failure is never an agent's).
        """
        import torch

        from llmtune.rl.agent import _row_columns, turn_seed
        from llmtune.rl.batcher import RequestBatcher
        from llmtune.rl.endpoint import Session
        from llmtune.rl.recorder import Recorder

        groups = list(range(len(rows))) if groups is None else list(groups)
        seed = int(torch.randint(0, 2**31 - 1, ()).item()) if sampling.seed is None else int(sampling.seed)  # (as
        # the built-in loop draws it: its turns' seeds, turn_seed(seed, b, t), are the requests')
        seeds = [turn_seed(seed, b, -1) for b in range(len(rows))]  # the agent programs' own (turn -1: no turn's)
        endpoint = self._endpoint()
        errors: list[BaseException] = []

        def engine_failed(exc: BaseException) -> None:
            errors.append(exc)
            endpoint.revoke_all()  # every agent fails fast; the run stops with the engine's error

        recorders = [Recorder(self.renderer, sampling.max_new_tokens, self.settings.model_len, self.settings.max_turns)
                     for _ in rows]
        finished = [0]
        lock = threading.Lock()

        def running() -> int:  # the agents that run now, or start as soon as a slot frees: each will send a request
            return min(self.settings.concurrency, len(rows) - finished[0])

        with RequestBatcher(self.engine, linger_s=LINGER_S, expect=running, session=True) as batcher:  # (the policy
            # is fixed while the agents run: hf merges the adapter once, a colocated vLLM engine sleeps once)
            sessions = [Session(r, batcher.submit, replace(sampling, seed=None), version, g, seed, b, self.reader,
                                engine_failed) for b, (r, g) in enumerate(zip(recorders, groups))]
            keys = [endpoint.register(session) for session in sessions]

            def one(b: int) -> tuple[float | None, str | None]:
                try:
                    return self.program.run(endpoint.base_url(keys[b]), keys[b], _row_columns(rows[b]), seeds[b],
                                            self.settings.timeout_s)
                finally:
                    endpoint.revoke(keys[b])  # the rollout is over: its late requests are refused
                    with lock:
                        finished[0] += 1
                    batcher.wake()  # one agent fewer to wait for

            try:
                with ThreadPoolExecutor(self.settings.concurrency, thread_name_prefix="llmtune-rollout") as pool:
                    results = list(pool.map(one, range(len(rows))))
            finally:
                for key in keys:
                    endpoint.revoke(key)
        self.batch_sizes = list(batcher.sizes)
        if errors:
            raise errors[0]
        out = []
        for row, group, recorder, (reward, failure) in zip(rows, groups, recorders, results):
            if failure is not None and recorder.cut is not None:  # refused for its own limits: scored as cut
                failure = None
            out.append(recorder.trajectory(row, group, version, failure, reward))
        return out

    def close(self) -> None:
        """Stop the endpoint (idempotent); the next rollout batch starts a new one."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
