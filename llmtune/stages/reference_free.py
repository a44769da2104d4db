"""What the reference-free pairwise stages (ORPO, SimPO) share: one policy forward per pair batch, no reference.

They reuse DPO's pieces (:class:`~llmtune.stages.dpo.DPOStage`: its data, its (2B, T) batches, its summed
completion log-probs :meth:`~llmtune.stages.dpo.DPOStage.logps` and its metrics) and differ only in the per-pair
loss, a pure function of the summed log-probs and the completion token counts. The reference model is never run:
:meth:`ReferenceFreeStage.reference_logps` raises, and ``dpo.precompute_ref_logps`` is never applied, so
``adapter.type: none`` (full fine-tuning) works too.

Metrics are DPO's (comparable across DPO, ORPO, SimPO and KTO): ``logps/chosen``/``logps/rejected`` are summed
completion log-probs; ``rewards/*`` are each method's own implicit reward (here ``beta`` x the token-mean
log-prob), and ``rewards/accuracies`` counts pairs whose chosen reward is strictly higher.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from llmtune.config import Recipe
from llmtune.core.ops import IGNORE_INDEX
from llmtune.core.stage import PairwiseStage, StageData
from llmtune.stages.dpo import DPOStage


def completion_tokens(labels: torch.Tensor) -> torch.Tensor:
    """(N,) fp32 count of trained target tokens per sequence (after the causal shift) of (N, T) ``labels``."""
    return (labels[:, 1:] != IGNORE_INDEX).sum(-1).float()


def trained_pair_mask(chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor) -> torch.Tensor:
    """(B,) bool: pairs whose both sides have at least one trained token (the only pairs that count)."""
    return (chosen_tokens > 0) & (rejected_tokens > 0)


class ReferenceFreeStage(DPOStage):
    """Base of ORPO and SimPO: DPO's data, batches, log-probs and metrics, without a reference model.

    Subclasses set ``name`` and implement :meth:`pair_losses`.
    """

    eval_keys: ClassVar[tuple[str, ...]] = ("chosen_logps", "rejected_logps", "chosen_tokens", "rejected_tokens")

    def __init__(self, recipe: Recipe, recipe_dir=None):
        PairwiseStage.__init__(self, recipe, recipe_dir)  # DPO's check (full fine-tuning needs stored reference log-probs) is moot

    def pair_losses(
        self, chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, chosen_tokens: torch.Tensor,
        rejected_tokens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(losses, chosen_rewards, rejected_rewards, extra)``: (B,) each, ``extra`` = (B,) values whose means
        are logged as metrics. Inputs: (B,) summed completion log-probs and (B,) completion token counts."""
        raise NotImplementedError

    def reference_logps(self, model, batch):
        raise RuntimeError(f"the {self.name} stage has no reference model; nothing may ask for reference log-probs")

    def prepare_data(self, trainer, data: StageData) -> StageData:
        return data  # never precompute reference log-probs

    def _all(self, model, batch):
        chosen, rejected = self.logps(model, batch)  # (B,) each, summed over completion tokens, fp32
        chosen_tokens, rejected_tokens = self.halves(completion_tokens(batch["labels"]))
        return chosen, rejected, chosen_tokens, rejected_tokens

    def _pair_losses(self, values):
        """:meth:`pair_losses` with token counts of at least 1 (a pair without trained tokens gives finite
        values, not 0/0; it is left out by the caller), and the (B,) mask of pairs that count."""
        trained = trained_pair_mask(values[2], values[3])
        values = [*values[:2], values[2].clamp(min=1), values[3].clamp(min=1), *values[4:]]
        return self.pair_losses(*values), trained

    def _metrics_of(self, values, out, trained) -> dict[str, float]:
        losses, chosen_rewards, rejected_rewards, extra = out
        if not trained.any():
            return {}
        return {**self._metrics(values[0][trained], values[1][trained], chosen_rewards[trained],
                                rejected_rewards[trained]),
                **{k: float(v.detach().float()[trained].mean()) for k, v in extra.items()}}

    def loss(self, model, batch, num_items):
        values = self._all(model, batch)
        out, trained = self._pair_losses(values)
        return torch.where(trained, out[0], 0.0).sum() / num_items, self._metrics_of(values, out, trained)

    def eval_stats(self, model, batch):
        return dict(zip(self.eval_keys, self._all(model, batch)))

    def eval_metrics(self, stats: dict[str, np.ndarray]) -> dict[str, float]:
        """Means over the held-out pairs that have trained tokens on both sides (``pairs`` counts them)."""
        values = [torch.from_numpy(stats[k]) for k in self.eval_keys]
        out, trained = self._pair_losses(values)
        return {"loss": float(out[0][trained].mean()), **self._metrics_of(values, out, trained),
                "pairs": float(trained.sum())}
