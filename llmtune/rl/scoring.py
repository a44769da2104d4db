"""Reward sources of online RL (PPO, GRPO): reward functions on decoded texts and reward-model runs, each weighted.

A source scores B (prompt, completion) pairs: ``source(query_ids, query_mask, responses, mask, rows) -> (B,)``
fp32, with (B, P) left-padded prompts, (B, N) right-padded responses and their masks, and the B prompt rows
(``prompt``, ``messages``, ``reference``). :class:`RewardSources` adds them up with their weights and keeps each
one's raw scores, so every source is logged on its own.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from llmtune.rl.rollout import decode_responses
from llmtune.utils import get_logger

log = get_logger("rl")


class FunctionScorer:
    """Scores decoded responses with a reward function ``fn(prompts, completions[, references])``
    (see :mod:`llmtune.rewards`)."""

    def __init__(self, spec: str, tokenizer, recipe_dir: str | Path | None = None):
        from llmtune.rewards import load_reward_function

        self.fn, self.tokenizer = load_reward_function(spec, recipe_dir=recipe_dir), tokenizer

    def __call__(self, query_ids, query_mask, responses, mask, rows) -> torch.Tensor:
        """(B, P) left-padded prompts + mask, (B, N) responses + mask, B prompt rows -> (B,) fp32 scores, NaN where
        the function abstained (returned None).

        Raises:
            RewardFunctionError: the function raised, or did not return B finite numbers or None (the index is
                named).
        """
        from llmtune.rewards import call_reward_function

        completions = decode_responses(self.tokenizer, responses, mask)
        return call_reward_function(self.fn, [r["prompt"] for r in rows], completions,
                                    [r.get("reference") for r in rows], allow_abstain=True).to(responses.device)


class RewardModelScorer:
    """Scores (prompt, response) with the reward model of an ``llmtune rm`` run
    (:class:`llmtune.models.reward.RewardModel`, loaded once, frozen, chain merged, in the recipe's precision).

    When the RM's tokenizer and chat template equal the policy's, the policy's token ids are scored (prompt
    left-padded + response right-padded, plus the template's text after the end-of-turn token the RM was trained
    with: :meth:`~llmtune.models.reward.RewardModel.score_rollouts`; read at the last real token); otherwise the
    response is decoded and the conversation re-tokenized as the RM's training pairs were.
    """

    def __init__(self, run_dir: str | Path, recipe, tokenizer):
        from llmtune.models.reward import RewardModel

        self.rm = RewardModel(run_dir, recipe.precision, recipe.reward.batch_size)
        self.run_dir, self.tokenizer = self.rm.run_dir, tokenizer
        self.same_tokens = (self.rm.tokenizer.get_vocab() == tokenizer.get_vocab()
                            and self.rm.tokenizer.chat_template == tokenizer.chat_template)
        log.info("reward model %s loaded (%s)", self.run_dir,
                 "same tokenizer: scoring the policy's tokens" if self.same_tokens else "re-tokenizing its texts")

    def to(self, device):
        self.rm.to(device)
        return self

    def __call__(self, query_ids, query_mask, responses, mask, rows) -> torch.Tensor:
        """(B, P) left-padded prompts + mask, (B, N) right-padded responses + mask, B prompt rows -> (B,) fp32
        scores read at each row's last real token."""
        if self.same_tokens:
            return self.rm.score_rollouts(torch.cat([query_ids, responses], 1), torch.cat([query_mask, mask], 1))
        texts = decode_responses(self.tokenizer, responses, mask)
        return self.rm.score_texts([json.loads(r["messages"]) for r in rows], texts).to(responses.device)


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
    and counts it (``rewards/abstained``); it is never a silent 0.
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

    def score(self, query_ids, query_mask, responses, mask, rows) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score B completions with every source.

        Returns:
            ``(total, per_source)``: (B,) fp32 weighted sum over the sources that scored each row (NaN where every
            source abstained), and ``{name: (B,) raw scores}`` (NaN where that source abstained).
        """
        per_source = {s.name: s.scorer(query_ids, query_mask, responses, mask, rows).float().to(responses.device)
                      for s in self.sources}
        return combine(per_source, {s.name: s.weight for s in self.sources}), per_source

    def __call__(self, query_ids, query_mask, responses, mask, rows) -> torch.Tensor:
        """(B,) weighted total (see :meth:`score`) for a stage that scores every row (PPO).

        Raises:
            RewardFunctionError: every source abstained on a row (the index is named).
        """
        from llmtune.rewards import RewardFunctionError

        total = self.score(query_ids, query_mask, responses, mask, rows)[0]
        missing = torch.isnan(total).nonzero().flatten().tolist()
        if missing:
            raise RewardFunctionError(f"every reward source abstained (returned None) on completion {missing[0]} "
                                      f"({len(missing)} of {len(total)}); PPO needs a reward for every rollout: "
                                      "return a number there (GRPO leaves such completions out)")
        return total


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


def build_reward_sources(recipe, tokenizer, recipe_dir: str | Path | None = None) -> RewardSources:
    """The :class:`RewardSources` of ``recipe.reward`` (functions imported, the reward model loaded); reward modules
    are found in the working directory, then in ``recipe_dir`` (:func:`llmtune.rewards.reward_search_dirs`)."""
    reward = recipe.reward
    sources: list[RewardSource] = []
    if reward.from_run:
        sources.append(RewardSource("reward_model", reward.from_run_weight,
                                    RewardModelScorer(reward.from_run, recipe, tokenizer)))
    specs = ([(reward.function, 1.0, None)] if reward.function else []) + [
        (f.function, f.weight, f.name) for f in reward.functions]
    taken = {s.name for s in sources}
    for spec, weight, name in specs:
        base = name or spec.rpartition(":")[2].rpartition(".")[2] or "reward"
        unique, i = base, 2
        while unique in taken:
            unique, i = f"{base}_{i}", i + 1
        taken.add(unique)
        sources.append(RewardSource(unique, weight, FunctionScorer(spec, tokenizer, recipe_dir=recipe_dir)))
    return RewardSources(sources)
