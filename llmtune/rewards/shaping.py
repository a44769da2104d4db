"""The rewards of a rollout batch, in one typed result: the reward sources' scores, then named shaping steps in a
fixed order, and for every row whether it trains and why not.

A rollout batch of B trajectories is scored once (:meth:`Rewards.score`) into a :class:`RewardResult`:

1. ``weights``: every reward source scores every row (:class:`llmtune.rewards.sources.RewardSources`); the row's
   ``sources`` reward is the weighted sum over the sources that scored it (None = abstain), NaN where all abstained.
2. ``infrastructure``: a multi-turn rollout whose environment or tool infrastructure failed abstains from every source
   (NaN), whatever they returned: it is not the model's doing.
   The **task reward** is ``sources`` plus, for an environment that returns per-step rewards, the trajectory's return
   (the sum of its turns' rewards, :attr:`RewardResult.turn_return`).
3. ``missing_eos``: ``+ missing_eos_penalty`` where the trajectory did not end on a stop token (cut by the budget,
   the turn cap, or failed).
4. ``overlong``: DAPO's soft overlong penalty (Yu et al. 2025, Eq. 13; :func:`overlong_penalty`): 0 up to
   ``max_new_tokens - buffer``, then linear down to ``-factor`` at the budget; a trajectory cut by the turn cap
   counts as at the budget (it never answered). It stays in the loss (unless ``grpo.mask_truncated_completions``).
5. ``tool_cost``: ``- agent.tool_call_cost`` per tool call (:attr:`llmtune.rl.types.Outcome.tool_calls`).
6. ``well_formed_calls``: ``+ agent.well_formed_call_reward x`` the share of the trajectory's checked calls that were
   well formed (0 without calls): a share, not a count, so calling more never earns more.
7. ``outcome = nan_to_num(sources) + 3 + 4 + 5 + 6`` (the steps that are on, added in this order), ``total = outcome
   + turn_return``: GRPO's reward. PPO puts ``outcome`` (normalised, clipped) at the last sampled token and each
   turn's reward at that turn's last sampled token (:meth:`RewardResult.token_rewards`).

Which rows train (:attr:`RewardResult.skip`, the first reason that applies, :class:`Skip`): its infrastructure failed;
it is beyond ``rollout.max_staleness``; every source abstained; it was cut (did not end on a stop token) under
``grpo.mask_truncated_completions``; GRPO's dynamic sampling then adds ``no_signal`` (:meth:`RewardResult.exclude`).
Every loss path reads the one mask :meth:`RewardResult.loss_mask` (the tokens the policy sampled, of the rows that
train); a row that does not train enters no statistic an advantage is computed from.

The shaping terms are never part of the evaluation's reward (``eval_reward`` / ``eval_score`` are the task reward)
and are logged apart (``rewards/<step>_mean``), so a run shows its task reward alone.

Shapes: B = trajectories, N = completion width (:class:`llmtune.rl.types.RolloutBatch`).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from llmtune.rewards.sources import Scored
from llmtune.rl.types import TURNS, RolloutBatch, Trajectory
from llmtune.utils import get_logger

log = get_logger("rl")

# the shaping steps after the task reward, in the order they are added (the names of RewardResult.terms)
SHAPING_STEPS = ("missing_eos", "overlong", "tool_cost", "well_formed_calls")


class Skip(enum.IntEnum):
    """Why a row does not train (0 = it trains). The first reason that applies, in this order."""

    TRAINS = 0
    INFRASTRUCTURE = 1  # its environment / tool infrastructure failed (it abstains from every source)
    STALE = 2  # sampled more than rollout.max_staleness optimizer steps ago
    ABSTAINED = 3  # every reward source abstained
    TRUNCATED = 4  # cut by the budget or the turn cap, under grpo.mask_truncated_completions
    NO_SIGNAL = 5  # GRPO dynamic sampling: its group's trainable rewards are all equal


@dataclass(frozen=True)
class Shaping:
    """The shaping settings of a run (:func:`shaping_from_recipe`).

    Attributes:
        max_new_tokens: the completion budget (L_max of the overlong penalty).
        missing_eos_penalty: added where a trajectory did not end on a stop token; None = off.
        overlong_buffer_tokens: L_cache of the overlong penalty; None or 0 = off. overlong_penalty_factor: its
            value at the budget.
        mask_truncated: rows that did not end on a stop token do not train (GRPO's mask_truncated_completions).
        tool_call_cost: subtracted per tool call. well_formed_call_reward: times the share of well-formed calls.
    """

    max_new_tokens: int
    missing_eos_penalty: float | None = None
    overlong_buffer_tokens: int | None = None
    overlong_penalty_factor: float = 1.0
    mask_truncated: bool = False
    tool_call_cost: float = 0.0
    well_formed_call_reward: float = 0.0


def shaping_from_recipe(recipe) -> Shaping:
    """The :class:`Shaping` of a PPO or GRPO recipe (its stage section, ``rollout`` and ``agent``)."""
    section = getattr(recipe, recipe.stage)
    agent = recipe.agent
    return Shaping(max_new_tokens=recipe.rollout.max_new_tokens, missing_eos_penalty=section.missing_eos_penalty,
                   overlong_buffer_tokens=section.overlong_buffer_tokens,
                   overlong_penalty_factor=section.overlong_penalty_factor,
                   mask_truncated=bool(getattr(section, "mask_truncated_completions", False)),
                   tool_call_cost=agent.tool_call_cost if agent.enabled else 0.0,
                   well_formed_call_reward=agent.well_formed_call_reward if agent.enabled else 0.0)


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_tokens: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13), added to the reward:
    ``0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache * factor`` in between; ``-factor``
    from ``L_max`` on.

    ``|y|`` = the completion's real tokens including its end-of-turn token (verl ``DAPORewardManager``:
    ``valid_response_length`` = the response attention mask's sum, which counts the EOS), ``L_max`` =
    ``max_new_tokens``, ``L_cache`` = ``buffer_tokens``.

    Args:
        lengths: (B,) completion tokens. max_new_tokens: L_max. buffer_tokens: L_cache in 1..L_max.
        factor: the penalty at L_max (>= 0; DAPO: 1).

    Returns:
        (B,) fp32 penalties in [-factor, 0].
    """
    expected = max_new_tokens - buffer_tokens
    over = (lengths.float() - expected) / buffer_tokens
    return (-over * factor).clamp(min=-factor, max=0.0)


@dataclass
class RewardResult:
    """The rewards of one rollout batch (see the module docstring for the order of the steps).

    Attributes:
        per_source: ``{name: (B,) raw scores}`` of each reward source, NaN where it abstained (and on a failed
            rollout).
        sources: (B,) fp32 weighted sum over the sources that scored each row; NaN = abstained.
        terms: ``{step: (B,) fp32}`` what each shaping step that is on added, in :data:`SHAPING_STEPS` order.
        outcome: (B,) fp32 ``nan_to_num(sources) + sum(terms)``: the reward without the per-turn rewards (PPO's score
            at the last sampled token).
        turn_rewards: per row, one reward per assistant turn (``Outcome.turn_rewards``; empty = none).
        turn_return: (B,) fp32 the sum of each row's turn rewards (0 without). total: (B,) fp32 ``outcome +
            turn_return``: GRPO's reward.
        skip: (B,) long, :class:`Skip` (0 = the row trains).
        failures: per row, what failed when its infrastructure failed, else None.
        completions: the B completion texts the sources scored (a multi-turn rollout's final answer).
        ended: (B,) bool, the rows that ended on a stop token (not cut by the budget, the turn cap, or a failure);
            None when unknown.
    """

    per_source: dict[str, torch.Tensor]
    sources: torch.Tensor
    terms: dict[str, torch.Tensor]
    outcome: torch.Tensor
    turn_rewards: list[list[float]]
    turn_return: torch.Tensor
    total: torch.Tensor
    skip: torch.Tensor
    failures: list[str | None] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    ended: torch.Tensor | None = None

    @property
    def abstained(self) -> torch.Tensor:
        """(B,) bool: every source abstained, or the rollout's infrastructure failed (no task reward)."""
        return torch.isnan(self.sources)

    @property
    def task(self) -> torch.Tensor:
        """(B,) fp32 the task reward: ``sources`` + the per-turn return (where the row has turn rewards); NaN =
        abstained. What the evaluation reports, without any shaping term."""
        has = torch.tensor([bool(t) for t in self.turn_rewards], device=self.sources.device)
        return torch.where(has, self.sources + self.turn_return.to(self.sources.device), self.sources)

    @property
    def trains(self) -> torch.Tensor:
        """(B,) bool: the rows that train."""
        return self.skip == Skip.TRAINS

    @property
    def failed(self) -> torch.Tensor:
        """(B,) bool: rows whose environment / tool infrastructure failed."""
        return self.skip == Skip.INFRASTRUCTURE

    def exclude(self, rows: torch.Tensor, reason: Skip) -> None:
        """Mark ``rows`` ((B,) bool) as not training for ``reason``, where no earlier reason applies."""
        self.skip = torch.where(self.trains & rows.to(self.skip.device), torch.full_like(self.skip, int(reason)),
                                self.skip)

    def loss_mask(self, batch: RolloutBatch, rollout: torch.Tensor | None = None) -> torch.Tensor:
        """THE mask every loss path reads: (B, N) long, 1 on the tokens the policy sampled of the rows that train.

        Args:
            batch: the scored rollout batch, or its training rows (:meth:`~llmtune.rl.types.RolloutBatch.training_rows`:
                one per segment of a rollout whose agent rewrote its history). rollout: with training rows, (S,)
                the rollout of each row; the mask is then (S, N), a row trains when its rollout does.
        """
        trains = self.trains if rollout is None else self.trains[rollout.to(self.trains.device)]
        return batch.loss_mask * trains.to(batch.loss_mask.device)[:, None].long()

    def token_rewards(self, batch: RolloutBatch, rollout: torch.Tensor | None = None) -> torch.Tensor | None:
        """(B, N) fp32: each turn's reward at that turn's last sampled token (its end-of-turn token), 0 elsewhere;
        None when no row has turn rewards. PPO adds it to its per-token rewards.

        Args:
            batch, rollout: as :meth:`loss_mask` (with training rows, a rollout's turns are read across its rows in
                order).
        """
        if not any(self.turn_rewards):
            return None
        rollout = list(range(len(batch.trajectories))) if rollout is None else rollout.tolist()
        out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
        done = [0] * len(self.turn_rewards)  # turns of each rollout already placed (in its earlier rows)
        for s, (t, b) in enumerate(zip(batch.trajectories, rollout)):
            for end, reward in zip(t.turn_ends, self.turn_rewards[b][done[b]:]):
                out[s, end] += reward
            done[b] += len(t.turn_ends)
        return out.to(batch.loss_mask.device)

    def merge(self, other: RewardResult, pick: torch.Tensor) -> RewardResult:
        """Row ``b`` of the result is row ``pick[b]`` of ``self`` rows then ``other`` rows (GRPO's resampling)."""
        def take(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.cat([a, b.to(a.device)])[pick.to(a.device)]

        index = pick.tolist()
        return RewardResult({n: take(v, other.per_source[n]) for n, v in self.per_source.items()},
                            take(self.sources, other.sources),
                            {n: take(v, other.terms[n]) for n, v in self.terms.items()},
                            take(self.outcome, other.outcome),
                            [(self.turn_rewards + other.turn_rewards)[i] for i in index],
                            take(self.turn_return, other.turn_return), take(self.total, other.total),
                            take(self.skip, other.skip), [(self.failures + other.failures)[i] for i in index],
                            [(self.completions + other.completions)[i] for i in index],
                            None if self.ended is None or other.ended is None else take(self.ended, other.ended))


def shape(batch: RolloutBatch, sources: torch.Tensor, per_source: dict[str, torch.Tensor], shaping: Shaping,
          stale: torch.Tensor | None = None, completions: list[str] | None = None) -> RewardResult:
    """Steps 2-7 of the module docstring on a batch the sources scored, and which rows train.

    Args:
        batch: the rollout batch (its trajectories' finish reasons and outcomes, its completion mask).
        sources: (B,) the sources' weighted total (:func:`llmtune.rewards.sources.combine`), NaN = abstained.
        per_source: ``{name: (B,)}`` raw scores. shaping: the run's settings.
        stale: (B,) bool, rows beyond ``rollout.max_staleness`` (None: none).
        completions: the texts the sources scored (kept for the sample logs).

    Returns:
        The :class:`RewardResult`, on ``sources``' device.
    """
    device = sources.device
    trajectories = batch.trajectories
    failed = torch.tensor([t.outcome.failed for t in trajectories], dtype=torch.bool, device=device)
    if failed.any():  # step 2: the infrastructure's failure is not the model's: abstain, whatever the sources said
        sources = sources.masked_fill(failed, math.nan)
        per_source = {n: v.masked_fill(failed.to(v.device), math.nan) for n, v in per_source.items()}
    ended = batch.ended.to(device)
    terms = _terms(trajectories, batch.completion_mask.sum(1).to(device), ended, shaping, device)
    outcome = torch.nan_to_num(sources, nan=0.0)
    for term in terms.values():
        outcome = outcome + term
    turn_rewards = [list(t.outcome.turn_rewards) for t in trajectories]
    turn_return = torch.tensor([float(sum(r)) for r in turn_rewards], dtype=torch.float32, device=device)
    total = outcome + turn_return if any(turn_rewards) else outcome
    skip = torch.zeros(len(trajectories), dtype=torch.long, device=device)
    result = RewardResult(per_source, sources, terms, outcome, turn_rewards, turn_return, total, skip,
                          [t.outcome.infrastructure_error for t in trajectories], list(completions or []), ended)
    result.exclude(failed, Skip.INFRASTRUCTURE)
    if stale is not None:
        result.exclude(stale, Skip.STALE)
    result.exclude(torch.isnan(sources), Skip.ABSTAINED)
    if shaping.mask_truncated:
        result.exclude(~ended, Skip.TRUNCATED)
    return result


def _terms(trajectories: list[Trajectory], lengths: torch.Tensor, ended: torch.Tensor, shaping: Shaping,
           device) -> dict[str, torch.Tensor]:
    """Steps 3-6: ``{step: (B,) fp32}`` for the steps that are on, in :data:`SHAPING_STEPS` order."""
    terms: dict[str, torch.Tensor] = {}
    if shaping.missing_eos_penalty is not None:
        terms["missing_eos"] = shaping.missing_eos_penalty * (~ended).float()
    if shaping.overlong_buffer_tokens:
        at_cap = torch.tensor([t.finish_reason == TURNS for t in trajectories], dtype=torch.bool, device=device)
        lengths = torch.where(at_cap, torch.full_like(lengths, shaping.max_new_tokens), lengths)
        terms["overlong"] = overlong_penalty(lengths, shaping.max_new_tokens, shaping.overlong_buffer_tokens,
                                             shaping.overlong_penalty_factor).to(device)
    if shaping.tool_call_cost:
        calls = torch.tensor([float(t.outcome.tool_calls) for t in trajectories], device=device)
        terms["tool_cost"] = -shaping.tool_call_cost * calls
    if shaping.well_formed_call_reward:
        share = [t.outcome.well_formed_calls / t.outcome.checked_calls if t.outcome.checked_calls else 0.0
                 for t in trajectories]
        terms["well_formed_calls"] = shaping.well_formed_call_reward * torch.tensor(share, device=device)
    return terms


def require_rewards(result: RewardResult) -> None:
    """PPO needs a reward for every rollout that trains.

    Raises:
        RewardFunctionError: every source abstained on a row (:attr:`Skip.ABSTAINED`; the first index is named).
    """
    from llmtune.rewards.functions import RewardFunctionError

    missing = (result.skip == Skip.ABSTAINED).nonzero().flatten().tolist()
    if missing:
        raise RewardFunctionError(f"every reward source abstained (returned None) on completion {missing[0]} "
                                  f"({len(missing)} of {len(result.skip)}); PPO needs a reward for every rollout: "
                                  "return a number there (GRPO leaves such completions out)")


class Rewards:
    """A run's rewards: its reward sources (:class:`llmtune.rewards.sources.RewardSources`) and shaping settings,
    scoring rollout batches into :class:`RewardResult` s.

    Args:
        sources: the weighted sources. shaping: the run's :class:`Shaping`. tokenizer: decodes completions for the
            reward functions (:meth:`llmtune.rewards.sources.Scored.from_batch`).
    """

    def __init__(self, sources, shaping: Shaping, tokenizer):
        self.sources, self.shaping, self.tokenizer = sources, shaping, tokenizer
        self._warned_overlong = False

    @property
    def names(self) -> list[str]:
        return self.sources.names

    def score(self, batch: RolloutBatch, device: torch.device | str = "cpu", stale: torch.Tensor | None = None
              ) -> RewardResult:
        """Score a rollout batch: every source on every row (a failed rollout's values are discarded), then
        :func:`shape`.

        Raises:
            RewardFunctionError: a reward function raised or returned bad values (the index is named).
        """
        scored = Scored.from_batch(batch, self.tokenizer)
        total, per_source = self.sources.score(scored, device)
        return shape(batch, total, per_source, self.shaping, stale, scored.completions)

    def metrics(self, result: RewardResult, gather=lambda x: x, step: int = 0) -> dict[str, float]:
        """:func:`reward_metrics` of a scored batch; warns once per run when the soft overlong penalty hits more than
        :data:`OVERLONG_ON_FINISHED_WARN` of the rollouts that finished on their own: the budget is then too tight
        for this task's normal answers (a multi-turn completion counts its tool results too), and the penalty
        teaches the policy to answer sooner (fewer tool calls) rather than to stop rambling.

        Args:
            result: the batch's :class:`RewardResult` (B rows on this rank). gather: concatenates a (B, C) tensor
                over ranks (every rank calls it once). step: optimizer steps so far (named in the warning).

        Returns:
            ``{metric name: float}``, the same on every rank (see :func:`reward_metrics`).
        """
        metrics = reward_metrics(result, gather)
        share = metrics.get("rewards/overlong_on_finished", 0.0)
        if share > OVERLONG_ON_FINISHED_WARN and not self._warned_overlong:
            self._warned_overlong = True
            start = self.shaping.max_new_tokens - (self.shaping.overlong_buffer_tokens or 0)
            log.warning("the soft overlong penalty hit %.0f%% of the rollouts that finished on their own (step %d): "
                        "they are longer than rollout.max_new_tokens - overlong_buffer_tokens = %d tokens (a "
                        "multi-turn completion counts its tool results). The penalty then rewards shorter answers "
                        "(fewer tool calls) whatever their task reward; raise rollout.max_new_tokens above this task's "
                        "normal length plus the buffer, or lower overlong_buffer_tokens "
                        "(rewards/overlong_on_finished in metrics.jsonl)", 100 * share, step, start)
        return metrics


# metric names of the shaping terms (rewards/<name>_mean; llmtune.rewards.sources.RESERVED_NAMES: no source takes them)
TERM_METRICS = {"missing_eos": "missing_eos_penalty", "overlong": "overlong_penalty", "tool_cost": "tool_cost",
                "well_formed_calls": "well_formed_calls"}


# rewards/overlong_on_finished above this share (of the rollouts that finished on their own) warns once per run
OVERLONG_ON_FINISHED_WARN = 0.25


def reward_metrics(result: RewardResult, gather=lambda x: x) -> dict[str, float]:
    """The rewards of a rollout batch apart, over all ranks' rows (``gather`` concatenates over ranks; every rank
    calls it once): ``rewards/task_mean`` (the task reward alone, over the rows that have one: what the evaluation
    reports), ``rewards/<step>_mean`` of each shaping term that is on (over every row; ``missing_eos_penalty``,
    ``overlong_penalty``, ``tool_cost``, ``well_formed_calls``), ``rewards/turns_mean`` (the per-turn rewards'
    return per rollout) when a rollout has turn rewards, and, with the overlong penalty on,
    ``rewards/overlong_on_finished``: the share of the rollouts that finished on their own (a stop token) that the
    penalty still hit (longer than ``max_new_tokens - overlong_buffer_tokens``)."""
    has = torch.tensor([float(bool(t)) for t in result.turn_rewards], device=result.sources.device)
    ended = result.ended if result.ended is not None else torch.zeros_like(has, dtype=torch.bool)
    columns = [result.task, result.turn_return.to(result.sources.device), has, ended.to(has.device),
               *(term.to(result.sources.device) for term in result.terms.values())]
    per_row = gather(torch.stack([c.float() for c in columns], 1))  # (B, 4 + terms)
    task = per_row[:, 0][~torch.isnan(per_row[:, 0])]
    metrics = {"rewards/task_mean": float(task.mean())} if len(task) else {}
    for i, name in enumerate(result.terms):
        metrics[f"rewards/{TERM_METRICS[name]}_mean"] = float(per_row[:, 4 + i].mean())
        if name == "overlong" and result.ended is not None and bool((per_row[:, 3] > 0).any()):
            finished = per_row[:, 3] > 0
            metrics["rewards/overlong_on_finished"] = float((per_row[finished, 4 + i] < 0).float().mean())
    if bool((per_row[:, 2] > 0).any()):
        metrics["rewards/turns_mean"] = float(per_row[:, 1].mean())
    return metrics
