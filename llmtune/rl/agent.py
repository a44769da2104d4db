"""The multi-turn agent loop: rollouts in which the policy calls tools or acts in an environment over several turns,
token-in/token-out.

Each rollout advances on its own (verl's, SkyRL's and prime-rl's agent loops do the same): one coroutine per
rollout on the loop's event loop asks the engine for its next turn (its ids so far: prompt + completion so far) as
soon as its own tool calls have returned, while the others still wait for theirs; a
:class:`~llmtune.rl.batcher.RequestBatcher` samples whatever turns are pending as one engine call, so a slow tool
stalls only its own rollout. ``async def`` tools are awaited on that event loop (concurrently: they must not
block), plain tools and environment set-ups run in a bounded thread pool (``agent.tool_threads``); the calls of one
turn run one after another, in the order the model wrote them. Every turn carries its own seed, a function of
(the batch's seed, the rollout's index, the turn), so that the engines that take one per prompt (hf, vLLM) draw the
same tokens whatever batch a turn happens to share. ``agent.lockstep`` keeps the loop as it was before: one engine
call per turn for all active rollouts, their tools called one after another (the engine's batches are then the
same in every run: bit-for-bit reproducible on hf, and the baseline of ``scripts/bench_agent.py``).

A turn that ends on its stop token is read for tool calls (:func:`llmtune.rl.tool_calls.parse_tool_calls`,
the template family's format); the calls run in the rollout's own toolbox (:class:`llmtune.rl.toolbox.Toolbox`: the
plain tool functions and the rollout's fresh environment instance) and their results go back as the template's tool
messages, whose ids come from :class:`llmtune.rl.chat.ToolTurns` (never from decoding and re-encoding the
conversation). The next turn's input is the previous ids + the sampled ids + those ids.

What is trained: the tokens the policy sampled (``loss_mask`` 1); tool results, the template's text around them and
the next assistant header are context (``loss_mask`` 0, no engine log-prob). The completion budget
(``rollout.max_new_tokens``) counts EVERY token after the prompt, so a trajectory never exceeds prompt + budget
(the vLLM engine's ``max_model_len``).

A rollout ends: ``stop`` (a turn ended on its stop token without a tool call: the final answer), ``length`` (the
budget ran out, in a turn or in a tool result; a turn cut by the budget is still part of the conversation, as an
assistant message of its text as decoded, with no tool call run: it is what the model last wrote; a turn whose calls
would leave no token to sample after their results, even empty ones, ends the rollout too, WITHOUT running the calls:
a tool may have side effects, and a result the model can never read is worth none), ``turns`` (it called a tool at
``agent.max_turns``) or ``error`` (its environment or tool infrastructure failed:
:class:`llmtune.rl.toolbox.InfrastructureError`, ``reset`` raising, a timeout of a tool in
``agent.infrastructure_timeouts``; the rollout then abstains from the reward: its group's statistics never see it,
and it is counted). A malformed call, an unknown tool, bad arguments, a tool that raises or times out (any other
tool), a call beyond ``agent.max_tool_calls`` are the model's doing: the error goes back to it as the tool result,
and is counted. A call may return a reward with its result (:class:`llmtune.rl.toolbox.ToolOutput`): the turn that
made it gets it (``Outcome.turn_rewards``).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import threading
from dataclasses import dataclass, field, replace

from llmtune.rl.types import ERROR, LENGTH, STOP, TURNS, Outcome, SamplingParams, Trajectory
TRUNCATION_NOTE = "\n[tool result cut to {n} tokens]"


@dataclass
class AgentSettings:
    """``agent:`` of the recipe, resolved (see :class:`llmtune.config.schema.AgentConfig`)."""

    max_turns: int
    max_tool_result_tokens: int
    tool_timeout_s: float
    parser: str | None  # the family parser (:func:`llmtune.rl.tool_calls.resolve_tool_parser`)
    response_template: bool = False  # parse with the tokenizer's response template (agent.tool_parser: auto)
    max_tool_calls: int | None = None  # calls per rollout at most (agent.max_tool_calls); None = no cap
    infrastructure_timeouts: tuple[str, ...] = ()  # tools whose timeout abstains (agent.infrastructure_timeouts)
    tool_threads: int = 32  # plain tool calls and environment set-ups running at once (agent.tool_threads)
    lockstep: bool = False  # one engine call per turn for all rollouts, tools one after another (agent.lockstep)
    linger_s: float = 0.02  # an idle engine samples once no turn has come for this long (RequestBatcher) ...
    linger_max_s: float = 0.25  # ... or this long after the first: tools that return together go together
    engine_workers: int = 1  # engine calls in flight at once (RequestBatcher workers: an engine in another process)


@dataclass
class _Rollout:
    row: dict
    group: int
    prompt_ids: list[int]
    messages: list[dict]
    toolbox: object | None
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    turns: int = 0
    version: int | None = None
    finish: str | None = None
    tool_calls: int = 0
    tool_errors: dict = field(default_factory=dict)
    truncated_results: int = 0
    infrastructure: str | None = None
    with_logps: bool = True
    turn_rewards: list = field(default_factory=list)
    rewarded: bool = False

    def add(self, ids: list[int], sampled: bool, logps: list[float] | None = None) -> None:
        self.ids += ids
        self.mask += [int(sampled)] * len(ids)
        if logps is None:
            self.with_logps = self.with_logps and not sampled
            logps = [math.nan] * len(ids)
        self.logps += list(logps)


class AgentLoop:
    """Multi-turn rollouts through an engine (see the module docstring).

    Args:
        engine: the rollout engine (``generate(prompts, sampling, budgets)``).
        tokenizer: the policy's tokenizer (decodes a sampled turn for the tool-call parser, cuts tool results).
        turns: the template's ids between turns (:class:`llmtune.rl.chat.ToolTurns`).
        tools: the tool functions. environment: the environment class, or None.
        settings: :class:`AgentSettings`. render_prompt: ``fn(messages) -> ids`` of a prompt with the run's tools and
            the generation prompt (a rollout whose environment returns first-turn text is rendered with it).
        max_prompt_tokens: a prompt rendered at rollout time must fit (else the rollout fails: ``error``).
    """

    def __init__(self, engine, tokenizer, turns, tools: list, environment, settings: AgentSettings, render_prompt,
                 max_prompt_tokens: int):
        self.engine, self.tokenizer, self.turns = engine, tokenizer, turns
        self.tools, self.environment, self.settings = tools, environment, settings
        self.render_prompt, self.max_prompt_tokens = render_prompt, max_prompt_tokens
        self._loop: asyncio.AbstractEventLoop | None = None  # the rollouts' event loop (its own thread), made once
        self._pool = None  # the tool threads (agent.tool_threads), made once

    def run(self, rows: list[dict], sampling: SamplingParams, groups: list[int] | None = None,
            version: int | None = None) -> list[Trajectory]:
        """One trajectory per prompt row (rows of one group each get their own toolbox / environment instance).

        Args:
            rows: B prompt rows (``input_ids``, ``messages`` JSON, and the row's columns). sampling: the sampling
                settings; its ``max_new_tokens`` is the whole trajectory's budget; its ``seed`` (else a draw from
                torch's global RNG, which the trainer seeds per iteration) seeds every turn: turn t of rollout b is
                seeded by (seed, b, t) (:func:`turn_seed`; ``agent.lockstep``: turn t's engine call by seed + t).
                groups: (B,) group ids: every turn of a group's trajectories goes to one server (the engine's
                ``keys``). version: the policy version to sample with (default the current).

        Returns:
            B :class:`~llmtune.rl.types.Trajectory` with ``turns``, ``finish_reason`` and their
            :class:`~llmtune.rl.types.Outcome`: the whole conversation (prompt, assistant turns with their tool
            calls, tool results; a turn cut by the budget is its last message), the environment instance, tool calls
            and errors, truncated results, the infrastructure failure, per-turn rewards.
        """
        groups = list(range(len(rows))) if groups is None else groups
        if self.settings.lockstep:
            rollouts = self._lockstep(rows, sampling, groups, version)
        else:
            if sampling.seed is None:
                import torch

                sampling = replace(sampling, seed=int(torch.randint(0, 2**31 - 1, ()).item()))
            rollouts = self._on_loop(self._overlapped(rows, sampling, groups, version))
        return [self._trajectory(r) for r in rollouts]

    # ---- each rollout on its own ---------------------------------------------------------------------------
    async def _overlapped(self, rows: list[dict], sampling: SamplingParams, groups: list[int], version: int | None
                          ) -> list[_Rollout]:
        """Every rollout as its own task; the engine samples what they ask for as they ask (see the module
        docstring). The first turns of the rollouts without a slow set-up form one batch."""
        from llmtune.rl.batcher import RequestBatcher

        request = replace(sampling, seed=None)  # one setting for every turn (they batch); the seeds go per turn
        with RequestBatcher(self.engine, linger_s=self.settings.linger_s, linger_max_s=self.settings.linger_max_s,
                            workers=self.settings.engine_workers, session=True) as batcher:  # the policy is fixed
            tasks = []
            try:
                with batcher.held():
                    tasks = [asyncio.ensure_future(self._advance(b, row, group, batcher, request, sampling.seed,
                                                                 version))
                             for b, (row, group) in enumerate(zip(rows, groups))]
                    await asyncio.sleep(0)  # every task runs to its first wait: a turn submitted, or its set-up
                return list(await asyncio.gather(*tasks))
            except BaseException:  # an engine error, a tool's bug, the caller giving up: stop every rollout
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

    async def _advance(self, b: int, row: dict, group: int, batcher, request: SamplingParams, seed: int,
                       version: int | None) -> _Rollout:
        """Rollout ``b`` from its set-up to its end: a turn, its tool calls, the next turn."""
        from llmtune.rl.toolbox import InfrastructureError, amake_toolbox

        try:
            made = await amake_toolbox(self.tools, self.environment, _row_columns(row),
                                       self.settings.infrastructure_timeouts, pool=self._tool_pool())
        except InfrastructureError as exc:
            made = exc
        r = self._begin(row, group, made)
        budget = request.max_new_tokens
        while r.finish is None:
            future = batcher.submit(r.prompt_ids + r.ids, request, budget - len(r.ids), key=r.group, version=version,
                                    seed=turn_seed(seed, b, r.turns))
            calls = self._read_turn(r, await asyncio.wrap_future(future), budget)
            if calls:
                results = []
                for call, allowed in calls:
                    results.append(await r.toolbox.acall(call, self.settings.tool_timeout_s, self._tool_pool())
                                   if allowed else r.toolbox.refuse(call, self.settings.max_tool_calls))
                self._feed(r, results, budget)
        return r

    def _on_loop(self, coroutine):
        """Run ``coroutine`` on this loop's event loop (a daemon thread of its own, started once: an ``async def``
        tool that timed out and ignores its cancellation keeps running there, counted) and wait for its result."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="llmtune-agent", daemon=True).start()
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Stop the event loop's thread and the tool threads (a tool still running is not waited for)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None

    def _tool_pool(self):
        """The threads that run plain tool calls and environment set-ups (``agent.tool_threads``), made once."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.settings.tool_threads, thread_name_prefix="llmtune-tools")
        return self._pool

    # ---- lock-step -----------------------------------------------------------------------------------------
    def _lockstep(self, rows: list[dict], sampling: SamplingParams, groups: list[int], version: int | None
                  ) -> list[_Rollout]:
        """``agent.lockstep``: one engine call per turn for every active rollout (turn t's call seeded by seed + t),
        then each rollout's tool calls, one rollout after another."""
        from llmtune.rl.toolbox import InfrastructureError, make_toolbox

        rollouts = []
        for row, group in zip(rows, groups):
            try:
                made = make_toolbox(self.tools, self.environment, _row_columns(row),
                                    self.settings.infrastructure_timeouts)
            except InfrastructureError as exc:
                made = exc
            rollouts.append(self._begin(row, group, made))
        budget = sampling.max_new_tokens
        turn = 0
        while True:
            active = [r for r in rollouts if r.finish is None]
            if not active:
                return rollouts
            budgets = [budget - len(r.ids) for r in active]
            call = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + turn)
            completions = self.engine.generate([r.prompt_ids + r.ids for r in active], call, budgets,
                                               keys=[r.group for r in active], version=version)
            turn += 1
            for r, c in zip(active, completions):
                calls = self._read_turn(r, c, budget)
                if calls:
                    self._feed(r, [r.toolbox.call(call, self.settings.tool_timeout_s) if allowed
                                   else r.toolbox.refuse(call, self.settings.max_tool_calls)
                                   for call, allowed in calls], budget)

    # ---- one rollout's steps (both schedules) ----------------------------------------------------------------
    def _begin(self, row: dict, group: int, made) -> _Rollout:
        """A rollout before its first turn, from its toolbox as :func:`~llmtune.rl.toolbox.make_toolbox` made it
        (``made``: ``(toolbox, first_user_text)``, or the :class:`~llmtune.rl.toolbox.InfrastructureError` it
        raised), its prompt re-rendered with the environment's first-turn text; finished (``error``) when its
        set-up failed."""
        messages = json.loads(row["messages"]) if isinstance(row.get("messages"), str) else list(row["messages"])
        prompt_ids = [int(i) for i in row["input_ids"]]
        toolbox, failure = None, None
        if isinstance(made, Exception):
            failure = f"{type(made).__name__}: {made}"
        else:
            toolbox, first = made
            if first:
                messages = _with_first_turn(messages, first)
                prompt_ids = list(self.render_prompt(messages))
                if len(prompt_ids) > self.max_prompt_tokens:
                    failure = (f"the prompt with the environment's first turn has {len(prompt_ids)} tokens, more "
                               f"than data.max_prompt_length {self.max_prompt_tokens}")
        r = _Rollout(row, group, prompt_ids, messages, toolbox)
        if failure is not None:
            r.finish, r.infrastructure = ERROR, failure
        return r

    def _read_turn(self, r: _Rollout, completion, budget: int) -> list[tuple] | None:
        """Append one sampled turn to a rollout and read its tool calls: ``[(call, allowed)]`` to run (``allowed``
        False: beyond ``agent.max_tool_calls``, refused), or None when the rollout ends here (no call, a cut turn,
        the turn cap, no room for a result)."""
        from llmtune.rl.tool_calls import parse_tool_calls

        r.add(list(completion.token_ids), sampled=True, logps=completion.logprobs)
        r.turns += 1
        r.turn_rewards.append(0.0)
        r.version = completion.version if r.version is None else r.version
        if completion.finish_reason != STOP:  # cut by the budget: what the model last wrote, no call run
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)
            r.messages.append({"role": "assistant", "content": text})
            r.finish = LENGTH
            return None
        text = self.tokenizer.decode(completion.token_ids[:-1], skip_special_tokens=False)
        template = self.tokenizer if self.settings.response_template else None
        content, calls = parse_tool_calls(text, self.settings.parser, template,
                                          tools=r.toolbox.schemas if template is not None else None)
        r.messages.append(_assistant_message(content, calls))
        if not calls:
            r.finish = STOP
            return None
        if r.turns >= self.settings.max_turns:
            r.finish = TURNS
            return None
        if len(self._result_frame(calls)) >= budget - len(r.ids):  # no result could be read: no token left after it
            r.finish = LENGTH  # the calls are not run (a tool may have side effects)
            return None
        limit = self.settings.max_tool_calls
        allowed = len(calls) if limit is None else max(limit - r.tool_calls, 0)
        return [(call, i < allowed) for i, call in enumerate(calls)]

    def _feed(self, r: _Rollout, results: list, budget: int) -> None:
        """Count a turn's tool results and append their ids (or end the rollout: an infrastructure failure, or no
        budget left to sample after them)."""
        room = budget - len(r.ids)
        r.tool_calls += len(results)
        for res in results:
            if res.error is not None:
                r.tool_errors[res.error] = r.tool_errors.get(res.error, 0) + 1
            if res.reward is not None:
                r.turn_rewards[-1] += res.reward
                r.rewarded = True
        failed = next((res for res in results if res.infrastructure), None)
        if failed is not None:
            r.finish, r.infrastructure = ERROR, f"tool {failed.name}: {failed.content}"
            return
        tool_messages = [{"role": "tool", "name": res.name or "unknown", "content": self._cap(r, res.content)}
                         for res in results]
        ids = self.turns.continuation_ids(tool_messages)
        r.messages.extend(tool_messages)
        if len(ids) >= room:  # the tool results (and the next header) use up the budget: nothing left to sample
            r.add(ids[:room], sampled=False)
            r.finish = LENGTH
            return
        r.add(ids, sampled=False)

    def _result_frame(self, calls: list) -> list[int]:
        """The ids that follow a turn with these calls when every result is empty: the least the results take."""
        return self.turns.continuation_ids([{"role": "tool", "name": c.name or "unknown", "content": ""}
                                            for c in calls])

    def _cap(self, r: _Rollout, content: str) -> str:
        """A tool result cut to ``max_tool_result_tokens`` tokens (and saying so)."""
        ids = self.tokenizer(content, add_special_tokens=False)["input_ids"]
        n = self.settings.max_tool_result_tokens
        if len(ids) <= n:
            return content
        r.truncated_results += 1
        return self.tokenizer.decode(ids[:n]) + TRUNCATION_NOTE.format(n=n)

    @staticmethod
    def _trajectory(r: _Rollout) -> Trajectory:
        outcome = Outcome(r.messages, getattr(r.toolbox, "environment", None), r.tool_calls, dict(r.tool_errors),
                          r.truncated_results, r.infrastructure, list(r.turn_rewards) if r.rewarded else [])
        return Trajectory(r.row, r.prompt_ids, r.ids, r.mask, r.logps if r.with_logps and r.ids else None, r.version,
                          r.finish, r.turns, r.group, outcome)


def turn_seed(seed: int, rollout: int, turn: int) -> int:
    """The seed of turn ``turn`` of rollout ``rollout`` (its index in the batch) of a batch seeded ``seed``: a hash
    of the three (never a sum, which would repeat across rollouts, turns and iterations), in [0, 2**31 - 1)."""
    digest = hashlib.blake2b(f"{seed}/{rollout}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def _assistant_message(content: str, calls: list) -> dict:
    """The assistant turn as a message (for reward functions and samples): its text without the markup of its
    well-formed tool calls, then the text of each malformed call as the model wrote it (``ToolCall.raw``, one per
    line), and its well-formed calls as ``tool_calls``."""
    text = "\n".join(part for part in [content, *(c.raw for c in calls if c.error is not None)] if part)
    message = {"role": "assistant", "content": text}
    good = [c for c in calls if c.error is None]
    if good:
        message["tool_calls"] = [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in good]
    return message


def _with_first_turn(messages: list[dict], text: str) -> list[dict]:
    """The prompt with an environment's first-turn text: appended to the last user message (TRL's environments add
    their observation the same way), or as the user message when the prompt has none."""
    messages = [dict(m) for m in messages]
    last = next((i for i in range(len(messages) - 1, -1, -1) if messages[i]["role"] == "user"), None)
    if last is None:
        return [*messages, {"role": "user", "content": text}]
    messages[last]["content"] = f"{messages[last]['content']}\n\n{text}"
    return messages


def _row_columns(row: dict) -> dict:
    """What an environment's ``reset(**row)`` receives: the dataset row's own columns as read (``columns``, when the
    prompt data kept them: :func:`llmtune.data.prompts.raw_columns`), then the prompt row's ``prompt``, ``messages``
    (as a list), ``reference`` and ``index``, which win over a dataset column of the same name (not the token ids)."""
    from llmtune.data.prompts import raw_columns

    out = {**raw_columns(row), **{k: v for k, v in row.items() if k not in ("input_ids", "length", "columns")}}
    if isinstance(out.get("messages"), str):
        out["messages"] = json.loads(out["messages"])
    return out


def agent_metrics(trajectories: list[Trajectory]) -> dict[str, float]:
    """Per-rollout means of a batch of agent trajectories (this rank): ``agent/turns``, ``agent/tool_calls`` and
    ``agent/truncated_tool_results`` (tool results cut to ``max_tool_result_tokens``), each a mean count per rollout;
    ``agent/tool_error_rate`` (errored calls / calls); ``agent/finish_<reason>`` (share of rollouts ended by each
    reason: stop, length, turns, error) and ``agent/infrastructure_failures`` (share of rollouts)."""
    n = max(len(trajectories), 1)
    outcomes = [t.outcome for t in trajectories]
    calls = sum(o.tool_calls for o in outcomes)
    errors = sum(sum(o.tool_errors.values()) for o in outcomes)
    out = {"agent/turns": sum(t.turns for t in trajectories) / n, "agent/tool_calls": calls / n,
           "agent/tool_error_rate": errors / calls if calls else 0.0,
           "agent/truncated_tool_results": sum(o.truncated_results for o in outcomes) / n,
           "agent/infrastructure_failures": sum(o.failed for o in outcomes) / n}
    for reason in (STOP, LENGTH, TURNS, ERROR):
        out[f"agent/finish_{reason}"] = sum(t.finish_reason == reason for t in trajectories) / n
    return out
