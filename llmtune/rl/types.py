"""The typed data of online RL, in the order it flows (nothing is a dict whose meaning is guessed from shapes):

``SamplingParams`` -> an engine's :class:`Completion` per prompt (token ids in, token ids + log-probs + a finish
reason out) -> a :class:`Trajectory` per rollout (the prompt ids, everything after them, the loss mask saying which of
those tokens the policy sampled, the engine's log-probs, the policy version, turns, finish reason) -> a
:class:`RolloutBatch` (the trajectories padded into tensors) -> :class:`Experience` (what the learner trains on:
every tensor registered with its layout, so that selecting, trimming and joining rows follow from the type).

Shapes: B = trajectories, P = prompt width (left-padded to the longest prompt of the batch), N = completion width
(right-padded to the longest completion). A completion is everything after the prompt: in a single-turn rollout the
sampled tokens up to and including the stop token; in a multi-turn one also the tool / environment messages between
the assistant turns (``loss_mask`` 0 there).

A rollout of an agent program that talks to the OpenAI-compatible endpoint (:mod:`llmtune.rl.recorder`) and rewrote
its history (dropped reasoning, summarised its memory, changed its system prompt) is several **segments**, each
trained with its own context (:class:`Segment`, :attr:`Trajectory.segments`): the learner trains on
:meth:`RolloutBatch.training_rows` (S >= B rows, one per segment), everything per rollout (rewards, advantages,
statistics) is computed on the B rollouts.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from llmtune.models.heads import positions_from_mask

STOP, LENGTH = "stop", "length"  # a completion ended on a stop token / at its token budget
TURNS, ERROR = "turns", "error"  # multi-turn: it called a tool at the turn cap / its infrastructure failed
CUT = (LENGTH, TURNS)  # the finish reasons of a trajectory cut by the budget or the turn cap (it never answered)


@dataclass(frozen=True)
class SamplingParams:
    """How an engine samples one completion per prompt.

    Attributes:
        max_new_tokens: completion tokens at most.
        stop_token_ids: a completion ends right after the first of these (included); nothing else stops it
            (:func:`llmtune.data.templates.stop_token_ids`).
        temperature: divides the logits (ignored when ``greedy``). top_p: nucleus threshold (1 = off).
        top_k: top-k (0 = off). greedy: argmax decoding (evaluation).
        seed: seeds this call's per-prompt seeds (engines that take them: vLLM); None = drawn from torch's global
            RNG, which the trainer seeds per (seed, iteration, rank). Rollouts sampled in a background thread
            (``rollout.max_staleness`` > 0) carry their own: the global RNG belongs to the training thread.
    """

    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    greedy: bool = False
    seed: int | None = None

    @property
    def truncation(self) -> tuple[int, float] | None:
        """``(top_k, top_p)`` when the sampling distribution is truncated (its log-probs are renormalised over the
        kept tokens: :func:`llmtune.rl.ops.sampling_logps`), else None."""
        if self.greedy or (self.top_k <= 0 and self.top_p >= 1.0):
            return None
        return self.top_k, self.top_p


@dataclass(frozen=True)
class AdapterSnapshot:
    """The policy adapter as it was at one version: what an engine in another process is sent, and what a
    checkpoint of an asynchronous run keeps for the rollouts still to be trained on.

    Attributes:
        version: optimizer steps applied. config: peft's ``adapter_config.json`` content.
        weights: ``adapter_model.safetensors`` bytes. sha256: their hex digest.
    """

    version: int
    config: dict
    weights: bytes
    sha256: str


@dataclass
class Completion:
    """One engine answer.

    Attributes:
        token_ids: the sampled ids, the stop token last when it stopped on one.
        logprobs: one per token under the engine's sampling distribution (temperature, then top-k/top-p
            truncation, renormalised), NaN where the engine's value was not finite; None when the engine reports none
            (``hf``) or for greedy decoding.
        finish_reason: ``stop`` (ended on a stop token) or ``length`` (reached ``max_new_tokens``).
        version: the policy version (optimizer steps applied) the engine sampled with.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    version: int | None


@dataclass
class Outcome:
    """What a rollout recorded besides its token ids, typed (what the rewards, the metrics and ``samples.jsonl``
    read). A single-turn rollout has the defaults; the multi-turn loop (:mod:`llmtune.rl.agent`) fills the rest.

    Attributes:
        messages: the whole conversation (the prompt messages, each assistant turn with its tool calls, each tool
            result as the model read it); None for a single-turn rollout.
        environment: the rollout's environment instance, or None (none configured, or it failed to start).
        tool_calls: calls that got a tool result (run, or answered with an error without running).
        tool_errors: ``{kind: count}`` of those that came back as an error (:data:`llmtune.rl.toolbox.ERROR_KINDS`).
        truncated_results: tool results cut to ``agent.max_tool_result_tokens``.
        infrastructure_error: what failed when the environment or tool infrastructure failed (the rollout then
            abstains from every reward source and trains nothing), else None.
        turn_rewards: one value per assistant turn: the sum of the rewards its tool calls returned
            (:class:`llmtune.rl.toolbox.ToolOutput` ``reward``; 0 for a turn without one); empty when no call of the
            rollout returned a reward.
        requests, joins, splits: an agent program's rollout (:mod:`llmtune.rl.recorder`): requests to the endpoint
            answered, those joined by ids onto an earlier exchange, those that started a new segment (history
            rewritten, or an exchange continued twice). sampling_overridden: requests whose sampling settings the
            run replaced by its own. agent_reward: the reward the agent program returned (None: none; its
            ``reward`` source abstains).
    """

    messages: list[dict] | None = None
    environment: Any = None
    tool_calls: int = 0
    tool_errors: dict[str, int] = field(default_factory=dict)
    truncated_results: int = 0
    infrastructure_error: str | None = None
    turn_rewards: list[float] = field(default_factory=list)
    requests: int = 0
    joins: int = 0
    splits: int = 0
    sampling_overridden: int = 0
    agent_reward: float | None = None

    @property
    def failed(self) -> bool:
        """Its environment or tool infrastructure failed."""
        return self.infrastructure_error is not None

    @property
    def checked_calls(self) -> int:
        """Calls whose format was checked (every call with a result except those refused by ``agent.max_tool_calls``
        unchecked)."""
        return self.tool_calls - self.tool_errors.get("over_limit", 0)

    @property
    def well_formed_calls(self) -> int:
        """Checked calls that were well formed: parsed, a known tool, arguments that fit its schema (whatever the
        tool then did)."""
        bad = sum(self.tool_errors.get(k, 0) for k in ("malformed", "unknown_tool", "bad_arguments"))
        return self.checked_calls - bad


@dataclass
class Segment:
    """One training row of a rollout that is several (an agent program that rewrote its history): a context and
    everything after it, trained with that context. Fields as :class:`Trajectory`'s (``loss_mask`` 1 on the tokens
    the policy sampled in it; ``engine_logps`` NaN on the others, or None)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    engine_logps: list[float] | None

    def __post_init__(self):
        n = len(self.completion_ids)
        if len(self.loss_mask) != n or (self.engine_logps is not None and len(self.engine_logps) != n):
            raise ValueError(f"segment of {n} completion ids with {len(self.loss_mask)} loss-mask values and "
                             f"{None if self.engine_logps is None else len(self.engine_logps)} engine log-probs")


@dataclass
class Trajectory:
    """One rollout of one prompt row: what the policy and its environment produced after the prompt.

    Attributes:
        row: the prompt row (``prompt``, ``messages``, ``reference``, ``index`` ... of :mod:`llmtune.data.prompts`).
        prompt_ids: the prompt's token ids (no padding).
        completion_ids: every id after the prompt (sampled tokens and, multi-turn, tool / environment messages).
        loss_mask: one per completion id: 1 = sampled by the policy (its log-prob enters the loss), 0 = context
            (tool / environment / template tokens: never trained).
        engine_logps: one per completion id: the engine's log-prob of a sampled token (NaN on context tokens, or
            where the engine's value was not finite), or None when the engine reports none.
        version: the policy version the first turn was sampled with (every turn of one trajectory is sampled with
            the same version).
        finish_reason: ``stop``, ``length`` (the completion budget), or a multi-turn reason (``turns``: the turn
            cap; ``error``: its infrastructure failed).
        turns: assistant turns sampled. group: the trajectory's group (its prompt) in its rollout batch.
        outcome: what else the rollout recorded (:class:`Outcome`: the conversation, tool calls, errors, per-turn
            rewards, an infrastructure failure).
        segments: the rollout's training rows when it is several (:class:`Segment`, in the order they started; an
            agent program that rewrote its history), the last one being the trajectory's own ids (the final context
            and what followed it: what a reward model scores); empty = the trajectory is its one row.
    """

    row: dict
    prompt_ids: list[int]
    completion_ids: list[int]
    loss_mask: list[int]
    engine_logps: list[float] | None
    version: int | None
    finish_reason: str
    turns: int = 1
    group: int = 0
    outcome: Outcome = field(default_factory=Outcome)
    segments: list[Segment] = field(default_factory=list)

    def __post_init__(self):
        n = len(self.completion_ids)
        if len(self.loss_mask) != n or (self.engine_logps is not None and len(self.engine_logps) != n):
            raise ValueError(f"trajectory of {n} completion ids with {len(self.loss_mask)} loss-mask values and "
                             f"{None if self.engine_logps is None else len(self.engine_logps)} engine log-probs")

    @property
    def ended(self) -> bool:
        """It ended on its own (a stop token), not cut by a budget or a cap."""
        return self.finish_reason == STOP

    @property
    def training_rows(self) -> list[Segment]:
        """What the learner trains on for this rollout: its segments, or the trajectory itself as one."""
        if self.segments:
            return list(self.segments)
        return [Segment(self.prompt_ids, self.completion_ids, self.loss_mask, self.engine_logps)]

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy sampled in the whole rollout (every segment)."""
        return sum(sum(s.loss_mask) for s in self.training_rows)

    @property
    def turn_ends(self) -> list[int]:
        """The index (among ``completion_ids``) of each assistant turn's last sampled token, in order: the ends of the
        runs of 1 in ``loss_mask`` (the policy's turns are separated by context tokens: tool messages, the template's
        text)."""
        m = self.loss_mask
        return [i for i in range(len(m)) if m[i] and (i + 1 == len(m) or not m[i + 1])]

    @classmethod
    def single_turn(cls, row: dict, prompt_ids: list[int], completion: Completion, group: int = 0) -> Trajectory:
        """A one-turn rollout: every completion token was sampled by the policy."""
        return cls(row, list(prompt_ids), list(completion.token_ids), [1] * len(completion.token_ids),
                   None if completion.logprobs is None else list(completion.logprobs), completion.version,
                   completion.finish_reason, 1, group)


@dataclass
class RolloutBatch:
    """Trajectories padded into tensors (one row each, in order), on one device.

    Attributes:
        prompt_ids, prompt_mask: (B, P) left-padded with ``pad_id`` / 0.
        completion_ids: (B, N) right-padded with ``pad_id``. completion_mask: (B, N) 1 on every real completion id.
        loss_mask: (B, N) 1 on the ids the policy sampled (a subset of ``completion_mask``).
        engine_logps: (B, N) fp32 (0 on padding, NaN on context tokens or non-finite values), or None.
        ended: (B,) bool, stopped on a stop token. group_ids: (B,) long. versions: (B,) long (-1 = unknown).
        trajectories: the B trajectories. pad_id: the id the padding is made of.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    loss_mask: torch.Tensor
    engine_logps: torch.Tensor | None
    ended: torch.Tensor
    group_ids: torch.Tensor
    versions: torch.Tensor
    trajectories: list[Trajectory]
    pad_id: int = 0

    @classmethod
    def from_trajectories(cls, trajectories: list[Trajectory], pad_id: int, device: torch.device | str = "cpu"
                          ) -> RolloutBatch:
        """Left-pad the prompts, right-pad the completions (N >= 1, so that an all-empty batch keeps a column)."""
        B = len(trajectories)
        P = max([len(t.prompt_ids) for t in trajectories] + [1])
        N = max([len(t.completion_ids) for t in trajectories] + [1])
        prompt_ids = torch.full((B, P), pad_id, dtype=torch.long)
        prompt_mask = torch.zeros(B, P, dtype=torch.long)
        completion_ids = torch.full((B, N), pad_id, dtype=torch.long)
        completion_mask = torch.zeros(B, N, dtype=torch.long)
        loss_mask = torch.zeros(B, N, dtype=torch.long)
        with_logps = all(t.engine_logps is not None for t in trajectories) and B > 0
        engine_logps = torch.zeros(B, N, dtype=torch.float32) if with_logps else None
        for b, t in enumerate(trajectories):
            p, n = len(t.prompt_ids), len(t.completion_ids)
            if p:
                prompt_ids[b, P - p:] = torch.tensor(t.prompt_ids, dtype=torch.long)
                prompt_mask[b, P - p:] = 1
            if n:
                completion_ids[b, :n] = torch.tensor(t.completion_ids, dtype=torch.long)
                completion_mask[b, :n] = 1
                loss_mask[b, :n] = torch.tensor(t.loss_mask, dtype=torch.long)
                if engine_logps is not None:
                    engine_logps[b, :n] = torch.tensor([math.nan if v is None else v for v in t.engine_logps],
                                                       dtype=torch.float32)
        ended = torch.tensor([t.ended for t in trajectories], dtype=torch.bool)
        group_ids = torch.tensor([t.group for t in trajectories], dtype=torch.long)
        versions = torch.tensor([-1 if t.version is None else t.version for t in trajectories], dtype=torch.long)
        to = lambda x: None if x is None else x.to(device)  # noqa: E731
        return cls(to(prompt_ids), to(prompt_mask), to(completion_ids), to(completion_mask), to(loss_mask),
                   to(engine_logps), to(ended), to(group_ids), to(versions), trajectories, pad_id)

    @property
    def rows(self) -> list[dict]:
        """The dataset row of each trajectory, in batch order (one per rollout, not per training row)."""
        return [t.row for t in self.trajectories]

    @property
    def segmented(self) -> bool:
        """Some rollout is several training rows (:attr:`Trajectory.segments`)."""
        return any(t.segments for t in self.trajectories)

    def sampled_tokens(self) -> torch.Tensor:
        """(B,) long: the tokens the policy sampled in each whole rollout (every segment; ``loss_mask.sum(1)``
        when no rollout is several rows)."""
        if not self.segmented:
            return self.loss_mask.sum(1)
        return torch.tensor([t.sampled_tokens for t in self.trajectories], dtype=torch.long,
                            device=self.loss_mask.device)

    def training_rows(self) -> tuple[RolloutBatch, torch.Tensor]:
        """The rows the learner trains on, and the rollout each comes from.

        A rollout is one row, or one per segment when its agent rewrote its history (:attr:`Trajectory.segments`:
        each segment with its own context; every token the policy sampled is in exactly one of them).

        Returns:
            ``(rows, rollout)``: a batch of S >= B rows (each a :class:`Trajectory` with the rollout's row, finish
            reason, version, group and outcome, and the segment's ids), and (S,) long, the index of each row's
            rollout in this batch; ``(self, arange(B))`` when no rollout has segments.
        """
        from dataclasses import replace

        B = len(self.trajectories)
        if not self.segmented:
            return self, torch.arange(B, device=self.loss_mask.device)
        rows, rollout = [], []
        for b, t in enumerate(self.trajectories):
            for s in t.training_rows:
                rows.append(replace(t, prompt_ids=s.prompt_ids, completion_ids=s.completion_ids,
                                    loss_mask=s.loss_mask, engine_logps=s.engine_logps, segments=[]))
                rollout.append(b)
        device = self.loss_mask.device
        return (RolloutBatch.from_trajectories(rows, self.pad_id, device),
                torch.tensor(rollout, dtype=torch.long, device=device))

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """Prompt + completion as one model input: ``input_ids``/``attention_mask``/``position_ids``, each
        (B, P + N); position ids count real tokens only, so left padding does not shift positions (as ``generate``
        does)."""
        return join(self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask)


def join(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
         completion_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """(B, P) left-padded prompts + (B, N) right-padded completions -> ``input_ids``/``attention_mask``/
    ``position_ids`` (B, P + N), position ids counting real tokens only."""
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    return {"input_ids": torch.cat([prompt_ids, completion_ids], dim=1), "attention_mask": attention_mask,
            "position_ids": positions_from_mask(attention_mask)}


class Layout(enum.Enum):
    """How a tensor of an :class:`Experience` is laid out, which decides how a micro-batch selects and trims it."""

    INPUT = "input"  # (B, P + N) model inputs: prompt columns then completion columns
    TOKEN = "token"  # (B, N) one value per completion position
    SEQUENCE = "sequence"  # (B,) one value per trajectory


INPUT_KEYS = ("input_ids", "attention_mask", "position_ids")


class Experience:
    """What the learner trains on for one rollout batch: named tensors, each registered with its :class:`Layout`.

    Made by a stage's ``make_experience`` from a :class:`RolloutBatch` (model inputs, ``responses`` = the
    completion ids, ``response_mask`` = the real completion ids, ``loss_mask``) plus what the stage computes
    (advantages, old / reference log-probs, values, the engine's importance weights). :meth:`micro_batch` gives the
    loss its rows as a plain dict.

    Args:
        prompt_width: P (the completion columns of the INPUT tensors start there).
    """

    def __init__(self, prompt_width: int):
        self.prompt_width = prompt_width
        self.tensors: dict[str, torch.Tensor] = {}
        self.layouts: dict[str, Layout] = {}

    @classmethod
    def from_batch(cls, batch: RolloutBatch, loss_mask: torch.Tensor) -> Experience:
        """The INPUT tensors of ``batch``, its ``responses`` / ``response_mask`` and the ``loss_mask`` (TOKEN) every
        loss path reads: the tokens the policy sampled, of the rows that train
        (:meth:`llmtune.rewards.shaping.RewardResult.loss_mask`)."""
        exp = cls(batch.prompt_ids.shape[1])
        for key, value in batch.model_inputs().items():
            exp.add(key, value, Layout.INPUT)
        exp.add("responses", batch.completion_ids, Layout.TOKEN)
        exp.add("response_mask", batch.completion_mask, Layout.TOKEN)
        exp.add("loss_mask", loss_mask, Layout.TOKEN)
        return exp

    def add(self, name: str, value: torch.Tensor, layout: Layout) -> None:
        """Register ``value`` under ``name``.

        Raises:
            ValueError: its shape does not fit ``layout`` (rows, or the width of the other tensors of that layout).
        """
        rows = next(iter(self.tensors.values())).shape[0] if self.tensors else value.shape[0]
        expected_dims = 1 if layout is Layout.SEQUENCE else 2
        same = [self.tensors[k].shape[1] for k, lay in self.layouts.items() if lay is layout and layout is not
                Layout.SEQUENCE]
        if value.dim() != expected_dims or value.shape[0] != rows or (same and value.shape[1] != same[0]):
            raise ValueError(f"experience tensor {name!r} of shape {tuple(value.shape)} does not fit layout "
                             f"{layout.value} ({rows} rows{f', width {same[0]}' if same else ''})")
        self.tensors[name] = value
        self.layouts[name] = layout

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def micro_batch(self, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        """Rows ``idx`` as the loss's dict, with the completion columns cut to the longest real completion among
        them and the prompt columns to the longest real prompt among them (the leading columns that are left padding
        in every row go: no token attends to them, and the position ids count real tokens only, so nothing else
        changes).

        Args:
            idx: (b,) row indices.

        Returns:
            Every tensor with b rows: INPUT (b, p + n), TOKEN (b, n), SEQUENCE (b,); n = the longest real
            completion (``response_mask``), p = the longest real prompt.
        """
        rows = {k: v[idx] for k, v in self.tensors.items()}
        n = max(int(rows["response_mask"].sum(1).max()), 1) if len(idx) else 1
        P = self.prompt_width
        used = rows["attention_mask"][:, :P].bool().any(0)  # (P,) columns some row's prompt uses
        lead = int(used.int().argmax()) if bool(used.any()) else 0
        for key, value in rows.items():
            layout = self.layouts[key]
            if layout is Layout.INPUT:
                rows[key] = value[:, lead:P + n]
            elif layout is Layout.TOKEN:
                rows[key] = value[:, :n]
        return rows

    def minibatches(self, passes: int, minibatch: int, micro: int, generator: torch.Generator,
                    order_key: torch.Tensor | None = None) -> list[list[dict[str, torch.Tensor]]]:
        """The optimizer steps of a rollout batch (PPO and GRPO alike): ``passes`` shuffled passes over its B rows,
        each cut into steps of ``minibatch`` rows (this rank's share of ``train.global_batch_size``), each step into
        micro-batches of ``micro`` rows (:meth:`micro_batch`). The split into micro-batches changes nothing (the loss
        is a sum divided by the whole step's item count), so within a step rows may be ordered to share padding:
        ``order_key`` (B,), sorted stably.

        Args:
            generator: the permutations' (seeded by (seed, iteration, rank): a resumed run draws the same).

        Returns:
            ``passes x ceil(B / minibatch)`` steps, each a list of micro-batch dicts.
        """
        rows = next(iter(self.tensors.values())).shape[0]
        device = self.tensors["loss_mask"].device
        steps = []
        for _ in range(passes):
            order = torch.randperm(rows, generator=generator)
            for start in range(0, rows, minibatch):
                idx = order[start:start + minibatch]
                if order_key is not None:
                    idx = idx[torch.argsort(order_key[idx], stable=True)]
                steps.append([self.micro_batch(idx[m:m + micro].to(device)) for m in range(0, len(idx), micro)])
        return steps
