"""Direct preference optimization on preference pairs, with the reference = the policy with its adapter disabled.

Sequence log-probs are summed over the completion tokens only (labels != -100) and computed in fp32 even when the
model runs in fp16/bf16 (:func:`llmtune.core.ops.token_logps`; trl #878 had NaN rewards in fp16). The reference
needs no second model: it is the same model with its trained adapter off
(:func:`llmtune.models.adapters.reference_scope`), so after ``model.from_run`` it is the SFT model: the SFT adapter
merged into the base, or on a 4-bit base the SFT adapter stacked frozen under the trained one (never the bare
base). With ``dpo.precompute_ref_logps`` the reference log-probs are computed once before training and
stored with the rows. Loss of an optimizer step = sum of the per-pair losses / pairs in the whole step.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from llmtune.config import Recipe, RecipeError
from llmtune.core.fused import fuse_swiglu, recompute_norm_outputs
from llmtune.core.lm_head import pair_logps
from llmtune.core.ops import IGNORE_INDEX
from llmtune.models.adapters import reference_scope
from llmtune.core.stage import HIGHER, LOWER, HeldOutMetric, PairwiseStage, StageData
from llmtune.utils import get_logger

log = get_logger("dpo")

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


def dpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair preference losses and implicit rewards (no reduction).

    With ``h = (chosen_logps - rejected_logps) - (ref_chosen_logps - ref_rejected_logps)`` and ``eps =
    label_smoothing``:

    * ``sigmoid``: ``-(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)`` — DPO (Rafailov et al. 2023);
      with ``eps > 0`` conservative DPO (cDPO, Mitchell 2023), the expected loss when a label is flipped with
      probability ``eps``.
    * ``robust``: ``(-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)) / (1 - 2 eps)`` — rDPO
      (Chowdhury et al. 2024), an unbiased estimate of the clean-label loss; needs ``0 < eps < 0.5``.
    * ``ipo``: ``(h - 1 / (2 beta))^2`` (Azar et al. 2023), on summed (not per-token averaged) log-probs.
    * ``hinge``: ``max(0, 1 - beta h)`` (SLiC, Zhao et al. 2023).

    Args:
        chosen_logps, rejected_logps: (B,) policy log-probs of the completions, summed over completion tokens.
        ref_chosen_logps, ref_rejected_logps: (B,) the same under the reference model.
        beta: > 0. loss_type: one of :data:`LOSS_TYPES`. label_smoothing: eps in [0, 0.5).

    Returns:
        ``(losses, chosen_rewards, rejected_rewards)``, each (B,) fp32; rewards are ``beta * (logps - ref_logps)``
        and detached.

    Raises:
        ValueError: unknown ``loss_type``.
    """
    chosen_ratio = chosen_logps.float() - ref_chosen_logps.float()
    rejected_ratio = rejected_logps.float() - ref_rejected_logps.float()
    h = chosen_ratio - rejected_ratio
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


class DPOStage(PairwiseStage):
    """DPO (sigmoid / IPO / hinge / robust) on preference pairs; batches are (2B, T): chosen rows then rejected."""

    name = "dpo"
    held_out_metrics = (HeldOutMetric("eval_rewards/accuracies", HIGHER, chance=0.5),
                        HeldOutMetric("eval_rewards/margins", HIGHER), HeldOutMetric("eval_loss", LOWER))
    plot_metrics = ("loss", "rewards/accuracies", "rewards/margins", ("rewards/chosen", "rewards/rejected"))
    eval_keys = ("chosen_logps", "rejected_logps", "ref_chosen_logps", "ref_rejected_logps")

    def __init__(self, recipe: Recipe, recipe_dir=None):
        super().__init__(recipe, recipe_dir)
        if recipe.adapter.type == "none" and not recipe.dpo.precompute_ref_logps:
            raise RecipeError([("dpo.precompute_ref_logps", "full fine-tuning (adapter.type: none) has no adapter to "
                                "disable for the reference model; set dpo.precompute_ref_logps: true (reference "
                                "log-probs computed once before training) or use adapter.type: lora")])

    def prepare_model(self, model, tokenizer):
        fuse_swiglu(model)  # same gradients, one activation fewer per MLP (llmtune.core.fused)
        recompute_norm_outputs(model)  # same gradients, the norm outputs recomputed in the backward
        return model

    @property
    def reference_forward(self) -> bool:
        """Whether each training step runs a reference forward (for the FLOPs of the MFU)."""
        return not self.recipe.dpo.precompute_ref_logps

    def logps(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) chosen and (B,) rejected fp32 log-probs, summed over completion tokens, of a (2B, T) batch."""
        # Each prompt computed once for both sides, the LM head only where a completion token is predicted
        # (llmtune.core.lm_head.pair_logps): the same sums as the full-logits path of the 2B rows
        return pair_logps(model, batch, share_prompt=self.recipe.data.padding_free)

    def reference_logps(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Precomputed reference log-probs of the batch, else the model's with its adapter disabled (no grad)."""
        if "ref_chosen_logps" in batch:
            return batch["ref_chosen_logps"], batch["ref_rejected_logps"]
        inner = getattr(model, "module", model)  # DDP keeps the peft model in .module
        with torch.no_grad(), reference_scope(inner):  # trained adapter off; a frozen from_run chain stays on
            return self.logps(inner, batch)

    def _losses(self, chosen, rejected, ref_chosen, ref_rejected):
        cfg = self.recipe.dpo
        return dpo_loss(chosen, rejected, ref_chosen, ref_rejected, cfg.beta, cfg.loss_type, cfg.label_smoothing)

    @staticmethod
    def _metrics(chosen, rejected, chosen_rewards, rejected_rewards) -> dict[str, float]:
        """Means over pairs; ``rewards/accuracies`` counts a pair only when chosen's reward is strictly higher."""
        return {
            "rewards/chosen": float(chosen_rewards.mean()),
            "rewards/rejected": float(rejected_rewards.mean()),
            "rewards/accuracies": float((chosen_rewards > rejected_rewards).float().mean()),
            "rewards/margins": float((chosen_rewards - rejected_rewards).mean()),
            "logps/chosen": float(chosen.detach().float().mean()),
            "logps/rejected": float(rejected.detach().float().mean()),
        }

    @staticmethod
    def trained_pairs(batch) -> torch.Tensor:
        """(B,) bool: pairs of a (2B, T) batch whose chosen AND rejected rows have a trained target token (after
        the causal shift). Only they count as items and enter the loss (a pair without one has no log-prob)."""
        trained = (batch["labels"][:, 1:] != IGNORE_INDEX).any(-1)
        n = trained.shape[0] // 2
        return trained[:n] & trained[n:]

    def count_items(self, batch):
        return self.trained_pairs(batch).sum()

    def loss(self, model, batch, num_items):
        ref_chosen, ref_rejected = self.reference_logps(model, batch)  # first: its activations are freed before
        chosen, rejected = self.logps(model, batch)
        losses, chosen_rewards, rejected_rewards = self._losses(chosen, rejected, ref_chosen, ref_rejected)
        keep = self.trained_pairs(batch)
        metrics = self._metrics(chosen[keep], rejected[keep], chosen_rewards[keep], rejected_rewards[keep]) \
            if keep.any() else {}
        return torch.where(keep, losses, 0.0).sum() / num_items, metrics

    def eval_stats(self, model, batch):
        ref_chosen, ref_rejected = self.reference_logps(model, batch)
        chosen, rejected = self.logps(model, batch)
        return {"chosen_logps": chosen, "rejected_logps": rejected,
                "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected}

    def eval_metrics(self, stats: dict[str, np.ndarray]) -> dict[str, float]:
        values = [torch.from_numpy(stats[k]) for k in self.eval_keys]
        losses, chosen_rewards, rejected_rewards = self._losses(*values)
        return {"loss": float(losses.mean()), **self._metrics(values[0], values[1], chosen_rewards, rejected_rewards),
                "pairs": float(len(losses))}

    # ---- dpo.precompute_ref_logps ---------------------------------------------------------------------------
    def prepare_data(self, trainer, data: StageData) -> StageData:
        if not self.recipe.dpo.precompute_ref_logps:
            return data
        log.info("precomputing reference log-probs of %d train + %d eval pairs", len(data.train),
                 len(data.eval) if data.eval is not None else 0)
        train = self._with_reference(trainer, data.train, data.collator)
        evals = self._with_reference(trainer, data.eval, data.collator) if data.eval is not None else None
        return dataclasses.replace(data, train=train, eval=evals)

    def _with_reference(self, trainer, rows, collator):
        """``rows`` plus ``ref_chosen_logps``/``ref_rejected_logps`` columns, from the model before training."""
        from torch.utils.data import DataLoader

        model = trainer.model
        was_training = model.training
        model.eval()
        chosen, rejected = [], []
        loader = DataLoader(rows, batch_size=trainer.args.per_device_eval_batch_size, collate_fn=collator)
        with torch.no_grad(), trainer.accelerator.autocast():
            for batch in loader:
                c, r = self.reference_logps(model, trainer._prepare_inputs(batch))
                chosen += c.float().cpu().tolist()
                rejected += r.float().cpu().tolist()
        model.train(was_training)
        if hasattr(rows, "add_column"):
            return rows.add_column("ref_chosen_logps", chosen).add_column("ref_rejected_logps", rejected)
        return [{**row, "ref_chosen_logps": c, "ref_rejected_logps": r} for row, c, r in zip(rows, chosen, rejected)]
