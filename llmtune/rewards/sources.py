"""Reward sources of online RL (PPO, GRPO) and of the pipeline's pairs step: reward functions on decoded texts and
reward-model runs, each weighted.

A source scores B completions: ``source(scored) -> (B,)`` fp32, where :class:`Scored` holds the B prompt rows
(``prompt``, ``messages``, ``reference``), the B completion texts and, from online RL, the token view of the rollout
batch (the reward model then scores the policy's own token ids when its tokenizer and template are the same).
:class:`RewardSources` adds the sources up with their weights and keeps each one's raw scores, so every source is
logged on its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmtune.rl.types import RolloutBatch
from llmtune.utils import awaited, get_logger

log = get_logger("rl")

# metric names of the rewards that are not sources (rewards/<name>_mean: the task reward, the per-turn rewards, the
# shaping terms of llmtune.rewards.shaping): a reward function of such a name is logged as <name>_2
RESERVED_NAMES = frozenset({"task", "turns", "missing_eos_penalty", "overlong_penalty", "tool_cost",
                            "well_formed_calls"})


@dataclass
class Scored:
    """What a reward source sees of B completions.

    Attributes:
        rows: the B prompt rows. completions: the B completion texts (decoded without special tokens; a multi-turn
            rollout's: the final assistant turn's text).
        batch: the rollout batch they come from (token ids; None for texts alone, as the pairs step scores).
        messages: multi-turn rollouts: each whole conversation (prompt, assistant turns with their tool calls, tool
            results), else None. environments: each rollout's environment instance (or None), else None.
    """

    rows: list[dict]
    completions: list[str]
    batch: RolloutBatch | None = None
    messages: list[list[dict]] | None = None
    environments: list | None = None

    @classmethod
    def from_batch(cls, batch: RolloutBatch, tokenizer) -> Scored:
        """What the sources see of a rollout batch: single-turn, each completion decoded without special tokens; a
        multi-turn rollout (its :class:`~llmtune.rl.types.Outcome` has the conversation), its final answer (the
        content of its last assistant message, ``""`` without one), its whole conversation and its environment
        instance."""
        outcomes = [t.outcome for t in batch.trajectories]
        if not outcomes or any(o.messages is None for o in outcomes):
            return cls(batch.rows, decode_completions(tokenizer, batch), batch)
        conversations = [o.messages for o in outcomes]
        finals = [next((m.get("content") or "" for m in reversed(c) if m["role"] == "assistant"), "")
                  for c in conversations]
        return cls(batch.rows, finals, batch, conversations, [o.environment for o in outcomes])

    def extra(self) -> dict[str, list]:
        """The per-completion keyword arguments a reward function may take: ``rows`` always (a row's ``columns``, the
        dataset row's own columns where the prompt data kept them, as a dict); ``messages`` and ``environments`` for
        multi-turn rollouts."""
        from llmtune.data.prompts import RAW_COLUMNS, raw_columns

        rows = [{**r, RAW_COLUMNS: raw_columns(r)} if RAW_COLUMNS in r else r for r in self.rows]
        out: dict[str, list] = {"rows": rows}
        if self.messages is not None:
            out["messages"] = self.messages
        if self.environments is not None:
            out["environments"] = self.environments
        return out


def decode_completions(tokenizer, batch: RolloutBatch) -> list[str]:
    """The completion texts of a rollout batch: each row's real completion ids decoded without special tokens (what
    a reward function sees)."""
    return [tokenizer.decode(row[m.bool()].tolist(), skip_special_tokens=True)
            for row, m in zip(batch.completion_ids, batch.completion_mask)]


class FunctionScorer:
    """Scores completion texts with a reward function ``fn(prompts, completions[, references])``
    (:mod:`llmtune.rewards`; found as :func:`llmtune.rewards.functions.load_reward_function` says)."""

    def __init__(self, spec: str, recipe_dir: str | Path | None = None, multi_turn: bool = False):
        from llmtune.rewards.functions import KEYWORDS, MULTI_TURN_KEYWORDS, load_reward_function

        self.fn = load_reward_function(spec, recipe_dir=recipe_dir,
                                       keywords=MULTI_TURN_KEYWORDS if multi_turn else KEYWORDS)

    def __call__(self, scored: Scored) -> torch.Tensor:
        """(B,) fp32 scores, NaN where the function abstained (returned None).

        Raises:
            RewardFunctionError: the function raised, or did not return B finite numbers or None (the index is
                named).
        """
        from llmtune.rewards.functions import call_reward_function

        return call_reward_function(self.fn, [r["prompt"] for r in scored.rows], scored.completions,
                                    [r.get("reference") for r in scored.rows], allow_abstain=True, **scored.extra())


class RewardModelScorer:
    """Scores (prompt, completion) with the reward model of an ``llmtune rm`` run
    (:class:`llmtune.models.reward.RewardModel`, loaded once, frozen, chain merged, in ``precision``).

    When the RM's tokenizer and chat template equal the policy's and the token view is given, the policy's token ids
    are scored (prompt left-padded + completion right-padded, plus the template's text after the end-of-turn token
    the RM was trained with: :meth:`~llmtune.models.reward.RewardModel.score_rollouts`; read at the last real token);
    otherwise the conversation is re-tokenized from its texts as the RM's training pairs were.

    Args:
        run_dir: the RM run. precision: the recipe's precision section (None: fp32). batch_size: sequences per
            forward. tokenizer: the policy's tokenizer (None: texts only).

    Raises:
        ModelLoadError: the run is not a reward model (``model_head`` is not ``score``) or cannot be loaded.
    """

    def __init__(self, run_dir: str | Path, precision=None, batch_size: int = 8, tokenizer=None):
        from llmtune.models.reward import RewardModel

        self.rm = RewardModel(run_dir, precision, batch_size)
        self.run_dir = self.rm.run_dir
        self.same_tokens = tokenizer is not None and (self.rm.tokenizer.get_vocab() == tokenizer.get_vocab()
                                                      and self.rm.tokenizer.chat_template == tokenizer.chat_template)
        log.info("reward model %s loaded (%s)", self.run_dir,
                 "same tokenizer: scoring the policy's tokens" if self.same_tokens else "re-tokenizing its texts")

    def to(self, device):
        self.rm.to(device)
        return self

    def __call__(self, scored: Scored) -> torch.Tensor:
        """(B,) fp32 scores read at each row's last real token."""
        batch = scored.batch
        if self.same_tokens and batch is not None:
            return self.rm.score_rollouts(torch.cat([batch.prompt_ids, batch.completion_ids], 1),
                                          torch.cat([batch.prompt_mask, batch.completion_mask], 1))
        return self.rm.score_texts([json.loads(r["messages"]) for r in scored.rows], scored.completions)

class EnvironmentScorer:
    """The reward of a multi-turn rollout's environment: ``environment.reward(messages)`` of each rollout's own
    instance (None abstains; a rollout without an environment instance, whose environment failed, abstains; an
    ``async def reward`` is run to completion).

    Raises (when called):
        RewardFunctionError: ``reward`` raised, or returned something other than a finite number or None.
    """

    def __call__(self, scored: Scored) -> torch.Tensor:
        from llmtune.rewards.functions import RewardFunctionError

        values = []
        for b, (env, messages) in enumerate(zip(scored.environments or [None] * len(scored.rows),
                                                scored.messages or [None] * len(scored.rows))):
            if env is None:
                values.append(math.nan)
                continue
            try:
                value = awaited(env.reward(messages))  # an async def reward is run to completion
            except Exception as exc:
                raise RewardFunctionError(f"the environment's reward(messages) raised {type(exc).__name__}: {exc} "
                                          f"(rollout {b})") from exc
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not math.isfinite(value)):
                raise RewardFunctionError(f"the environment's reward(messages) returned {value!r} for rollout {b}; "
                                          "expected a finite number or None (abstain)")
            values.append(math.nan if value is None else float(value))
        return torch.tensor(values, dtype=torch.float32)


@dataclass
class RewardSource:
    """One weighted reward source; ``name`` is its metric name (``rewards/<name>_mean``)."""

    name: str
    weight: float
    scorer: Any


class RewardSources:
    """The recipe's reward sources; ``total = sum_i weight_i * score_i`` over the sources that did not abstain.

    Built from ``reward.from_run`` (weight ``reward.from_run_weight``, name ``reward_model``), ``reward.function``
    (weight 1) and every ``reward.functions`` entry (its weight; name = its ``name`` or the function's name,
    made unique).

    Abstaining: a reward function may return None for a completion (NaN in its scores). The total of a row is then
    the weighted sum over the sources that scored it (TRL's ``nansum`` over reward functions); a row on which every
    source abstained has no reward (NaN total): GRPO leaves it out of training and of the advantage statistics
    and counts it (``rewards/abstained``), PPO stops (:func:`llmtune.rewards.shaping.require_rewards`); it is never
    a silent 0. What follows the sources (shaping, which rows train) is :mod:`llmtune.rewards.shaping`.
    """

    def __init__(self, sources: list[RewardSource]):
        self.sources = sources

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    @property
    def run_dir(self) -> Path | None:
        """The reward run's directory (PPO initialises its value model from it), or None."""
        return next((getattr(s.scorer, "run_dir") for s in self.sources if hasattr(s.scorer, "run_dir")), None)

    def to(self, device):
        for source in self.sources:
            if hasattr(source.scorer, "to"):
                source.scorer.to(device)
        return self

    def score(self, scored: Scored, device: torch.device | str = "cpu"
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score B completions with every source.

        Returns:
            ``(total, per_source)`` on ``device``: (B,) fp32 weighted sum over the sources that scored each row (NaN
            where every source abstained), and ``{name: (B,) raw scores}`` (NaN where that source abstained).
        """
        per_source = {s.name: s.scorer(scored).float().to(device) for s in self.sources}
        return combine(per_source, {s.name: s.weight for s in self.sources}), per_source


def combine(per_source: dict[str, torch.Tensor], weights: dict[str, float]) -> torch.Tensor:
    """``sum_s weight_s * score_s`` over the sources that did not abstain (NaN) on each row; NaN where all did.

    Args:
        per_source: {name: (B,) scores, NaN = abstained}. weights: {name: weight}.

    Returns:
        (B,) fp32.
    """
    scores = torch.stack([per_source[n].float() for n in per_source])  # (S, B)
    w = torch.tensor([weights[n] for n in per_source], dtype=scores.dtype, device=scores.device)[:, None]
    scored = ~torch.isnan(scores)
    total = torch.where(scored, w * scores, torch.zeros_like(scores)).sum(0)
    return torch.where(scored.any(0), total, torch.full_like(total, math.nan))


def build_reward_sources(reward, tokenizer=None, recipe_dir: str | Path | None = None, precision=None,
                         base_dir: str | Path = ".", environment_weight: float | None = None,
                         multi_turn: bool = False) -> RewardSources:
    """The :class:`RewardSources` of a ``reward:`` section (functions imported, the reward model loaded); reward
    modules are found in the working directory, then in ``recipe_dir``
    (:func:`llmtune.rewards.functions.reward_search_dirs`).

    Args:
        reward: the recipe's ``reward`` section (:class:`llmtune.config.schema.RewardConfig`).
        tokenizer: the policy's tokenizer (the reward model scores its token ids when it is the RM's).
        recipe_dir: the recipe's directory. precision: the recipe's precision (the reward model's dtype).
        base_dir: a relative ``reward.from_run`` is resolved against it.
        environment_weight: a multi-turn run's environment has a ``reward(messages)`` method: add it as the source
            ``environment`` with this weight (``agent.environment_reward_weight``); None = no such source.
        multi_turn: the run has ``agent:`` (reward functions may take ``messages`` and ``environments``).
    """
    sources: list[RewardSource] = []
    if reward.from_run:
        sources.append(RewardSource("reward_model", reward.from_run_weight, RewardModelScorer(
            Path(base_dir) / reward.from_run, precision, reward.batch_size, tokenizer)))
    specs = ([(reward.function, 1.0, None)] if reward.function else []) + [
        (f.function, f.weight, f.name) for f in reward.functions]
    taken = {s.name for s in sources} | RESERVED_NAMES
    for spec, weight, name in specs:
        base = name or spec.rpartition(":")[2].rpartition(".")[2] or "reward"
        unique, i = base, 2
        while unique in taken:
            unique, i = f"{base}_{i}", i + 1
        taken.add(unique)
        sources.append(RewardSource(unique, weight, FunctionScorer(spec, recipe_dir=recipe_dir, multi_turn=multi_turn)))
    if environment_weight is not None:
        sources.append(RewardSource("environment", environment_weight, EnvironmentScorer()))
    return RewardSources(sources)
