"""Reward modeling: a one-score head on the base, trained with the Bradley-Terry loss on preference pairs.

The score of a sequence is read at its last real token, found from the attention mask
(:func:`llmtune.models.sequence_scores`), never from ``pad_token_id``, which breaks when pad == EOS. A sequence is
the chat template's exact output for the conversation (what ``apply_chat_template(conversation, tokenize=True)``
gives a consumer), and the pad token is one no sequence contains, so the exported model scores the same in plain
transformers.
Loss of an optimizer step = sum over its pairs of the per-pair loss / number of pairs in the whole step.
The LoRA adapter is trained together with the full head (``adapter.modules_to_save`` gets ``score``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from llmtune.config import Recipe
from llmtune.core.stage import HIGHER, HeldOutMetric, PairwiseStage
from llmtune.models import sequence_scores
from llmtune.models.heads import use_dedicated_pad
from llmtune.utils import get_logger

log = get_logger("rm")


def bradley_terry_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: float = 0.0, center_rewards_coef: float = 0.0
) -> torch.Tensor:
    """Per-pair reward-model loss (no reduction).

    ``-log sigmoid(r_c - r_r - margin) + center_rewards_coef * (r_c + r_r)^2``: the Bradley-Terry negative
    log-likelihood that the chosen completion wins (Bradley & Terry 1952; Ouyang et al. 2022), with an optional
    constant margin, plus the reward-centering penalty of Eisenstein et al. 2023 that keeps scores near zero.

    Args:
        chosen: (B,) scores of the chosen completions. rejected: (B,) scores of the rejected ones.
        margin: constant margin in reward units. center_rewards_coef: weight of the centering term (>= 0).

    Returns:
        (B,) fp32 losses; the caller sums them and divides by the pairs of the optimizer step.
    """
    chosen, rejected = chosen.float(), rejected.float()
    loss = -F.logsigmoid(chosen - rejected - margin)
    if center_rewards_coef:
        loss = loss + center_rewards_coef * (chosen + rejected) ** 2
    return loss


def pair_metrics(chosen: torch.Tensor | np.ndarray, rejected: torch.Tensor | np.ndarray) -> dict[str, float]:
    """Accuracy (chosen strictly above rejected; ties are NOT correct, trl #1012), tie rate, mean margin and
    mean chosen/rejected scores over B pairs."""
    chosen, rejected = np.asarray(chosen, dtype=np.float64), np.asarray(rejected, dtype=np.float64)
    return {
        "accuracy": float(np.mean(chosen > rejected)),
        "ties": float(np.mean(chosen == rejected)),
        "margin": float(np.mean(chosen - rejected)),
        "chosen": float(np.mean(chosen)),
        "rejected": float(np.mean(rejected)),
    }


class RMStage(PairwiseStage):
    """Reward model (Bradley-Terry) on preference pairs; batches are (2B, T): chosen rows then rejected rows."""

    name = "rm"
    held_out_metrics = (HeldOutMetric("eval_accuracy", HIGHER, chance=0.5), HeldOutMetric("eval_margin", HIGHER))
    plot_metrics = ("loss", "accuracy", "margin")
    model_head = "score"
    eval_keys = ("chosen", "rejected")

    def __init__(self, recipe: Recipe, recipe_dir=None):
        super().__init__(recipe, recipe_dir)
        adapter = recipe.adapter
        if adapter.type == "lora" and "score" not in adapter.modules_to_save:
            adapter.modules_to_save = [*adapter.modules_to_save, "score"]  # recorded in recipe.resolved.yaml
            log.info("adapter.modules_to_save += [score]: the new reward head is trained in full")

    def prepare_model(self, model, tokenizer):
        """A pad token that never occurs in a sequence, in the tokenizer saved with the adapter and in the model
        config, so that plain transformers (pooling at the last token != ``pad_token_id``) reads the score where
        llmtune does, also for sequences ending in EOS when the base pads with EOS (:func:`use_dedicated_pad`)."""
        use_dedicated_pad(model, tokenizer)
        return model

    def scores(self, model, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(B,) chosen and (B,) rejected scores in fp32 of a (2B, T) batch."""
        return self.halves(sequence_scores(model, batch["input_ids"], batch["attention_mask"]))

    def _loss(self, chosen, rejected):
        return bradley_terry_loss(chosen, rejected, self.recipe.rm.margin, self.recipe.rm.center_rewards_coef)

    def loss(self, model, batch, num_items):
        chosen, rejected = self.scores(model, batch)
        metrics = pair_metrics(chosen.detach().cpu(), rejected.detach().cpu())
        return self._loss(chosen, rejected).sum() / num_items, metrics

    def eval_stats(self, model, batch):
        chosen, rejected = self.scores(model, batch)
        return {"chosen": chosen, "rejected": rejected}

    def eval_metrics(self, stats: dict[str, np.ndarray]) -> dict[str, float]:
        chosen, rejected = torch.from_numpy(stats["chosen"]), torch.from_numpy(stats["rejected"])
        loss = float(self._loss(chosen, rejected).mean())
        return {"loss": loss, **pair_metrics(stats["chosen"], stats["rejected"]), "pairs": float(len(chosen))}
