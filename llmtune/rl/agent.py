"""The multi-turn agent loop: rollouts in which the policy calls tools or acts in an environment over several turns,
token-in/token-out.

One turn for every active rollout is one engine call: each rollout's ids so far (prompt + completion so far) in, the
sampled ids out. A turn that ends on its stop token is read for tool calls (:func:`llmtune.rl.tool_calls.parse_tool_calls`,
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

import json
import math
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

    def run(self, rows: list[dict], sampling: SamplingParams, groups: list[int] | None = None,
            version: int | None = None) -> list[Trajectory]:
        """One trajectory per prompt row (rows of one group each get their own toolbox / environment instance).

        Args:
            rows: B prompt rows (``input_ids``, ``messages`` JSON, and the row's columns). sampling: the sampling
                settings; its ``max_new_tokens`` is the whole trajectory's budget (with ``seed``, turn t's call is
                seeded ``seed + t``). groups: (B,) group ids: every turn of a group's trajectories goes to one
                server (the engine's ``keys``). version: the policy version to sample with (default the current).

        Returns:
            B :class:`~llmtune.rl.types.Trajectory` with ``turns``, ``finish_reason`` and their
            :class:`~llmtune.rl.types.Outcome`: the whole conversation (prompt, assistant turns with their tool
            calls, tool results; a turn cut by the budget is its last message), the environment instance, tool calls
            and errors, truncated results, the infrastructure failure, per-turn rewards.
        """
        from llmtune.rl.toolbox import InfrastructureError, make_toolbox

        groups = list(range(len(rows))) if groups is None else groups
        rollouts = []
        for row, group in zip(rows, groups):
            messages = json.loads(row["messages"]) if isinstance(row.get("messages"), str) else list(row["messages"])
            prompt_ids = [int(i) for i in row["input_ids"]]
            toolbox, failure = None, None
            try:
                toolbox, first = make_toolbox(self.tools, self.environment, _row_columns(row),
                                              self.settings.infrastructure_timeouts)
                if first:
                    messages = _with_first_turn(messages, first)
                    prompt_ids = list(self.render_prompt(messages))
                    if len(prompt_ids) > self.max_prompt_tokens:
                        failure = (f"the prompt with the environment's first turn has {len(prompt_ids)} tokens, more "
                                   f"than data.max_prompt_length {self.max_prompt_tokens}")
            except InfrastructureError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            r = _Rollout(row, group, prompt_ids, messages, toolbox)
            if failure is not None:
                r.finish, r.infrastructure = ERROR, failure
            rollouts.append(r)
        budget = sampling.max_new_tokens
        turn = 0
        while True:
            active = [r for r in rollouts if r.finish is None]
            if not active:
                break
            budgets = [budget - len(r.ids) for r in active]
            call = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + turn)
            completions = self.engine.generate([r.prompt_ids + r.ids for r in active], call, budgets,
                                               keys=[r.group for r in active], version=version)
            turn += 1
            for r, c in zip(active, completions):
                self._step(r, c, budget)
        return [self._trajectory(r) for r in rollouts]

    def _step(self, r: _Rollout, completion, budget: int) -> None:
        """Append one sampled turn to a rollout, run its tool calls and append their results (or end it)."""
        from llmtune.rl.tool_calls import parse_tool_calls

        r.add(list(completion.token_ids), sampled=True, logps=completion.logprobs)
        r.turns += 1
        r.turn_rewards.append(0.0)
        r.version = completion.version if r.version is None else r.version
        if completion.finish_reason != STOP:  # cut by the budget: what the model last wrote, no call run
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=False)
            r.messages.append({"role": "assistant", "content": text})
            r.finish = LENGTH
            return
        text = self.tokenizer.decode(completion.token_ids[:-1], skip_special_tokens=False)
        template = self.tokenizer if self.settings.response_template else None
        content, calls = parse_tool_calls(text, self.settings.parser, template,
                                          tools=r.toolbox.schemas if template is not None else None)
        r.messages.append(_assistant_message(content, calls))
        if not calls:
            r.finish = STOP
            return
        if r.turns >= self.settings.max_turns:
            r.finish = TURNS
            return
        room = budget - len(r.ids)
        if len(self._result_frame(calls)) >= room:  # no result could be read: no token left to sample after it
            r.finish = LENGTH  # the calls are not run (a tool may have side effects)
            return
        limit = self.settings.max_tool_calls
        allowed = len(calls) if limit is None else max(limit - r.tool_calls, 0)
        results = [r.toolbox.call(call, self.settings.tool_timeout_s) if i < allowed else r.toolbox.refuse(call, limit)
                   for i, call in enumerate(calls)]
        r.tool_calls += len(calls)
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
