"""ORPO: odds-ratio preference optimization (Hong et al. 2024) on preference pairs, with no reference model.

Loss of a pair = NLL of the chosen completion (its token-mean negative log-prob: the SFT loss) plus ``beta`` x the
odds-ratio term ``-log sigmoid(log odds(chosen) - log odds(rejected))``, ``odds(y) = p / (1 - p)`` with ``p`` the
token-mean probability ``exp(mean log p)``; ``log(1 - p)`` is the exact, stable :func:`~llmtune.core.ops.log1mexp`
(no clamp: finite loss and gradient for every ``p < 1``). With ``orpo.nll_on_prompt`` the NLL term is the token-mean
over the whole chosen sequence (prompt, completion and the template's text after it), as TRL's ORPOTrainer always
does and the paper's code without ``--disable_prompt_loss``; the odds-ratio term always uses completion tokens only.
It can start from a base model (no SFT stage first) or from an SFT run. One policy forward per pair batch; loss of
an optimizer step = sum of per-pair losses / pairs in the whole step.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from llmtune.core.lm_head import per_token_logps
from llmtune.core.ops import IGNORE_INDEX, log1mexp
from llmtune.stages.reference_free import ReferenceFreeStage, completion_tokens

__all__ = ["ORPOStage", "log1mexp", "orpo_loss"]


def orpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    beta: float,
    prompt_logps: torch.Tensor | None = None,
    prompt_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair ORPO losses (Hong et al. 2024, Eq. 6-7; no reduction).

    With ``a = chosen_logps / chosen_tokens`` and ``b = rejected_logps / rejected_tokens`` (token-mean log-probs)
    and ``log odds(m) = m - log(1 - exp(m))`` (:func:`~llmtune.core.ops.log1mexp`, exact in fp32 for every
    ``m < 0``): ``loss = nll - beta * log sigmoid(log odds(a) - log odds(b))`` with ``nll = -a``, or with
    ``prompt_logps`` (``orpo.nll_on_prompt``) ``nll = -(chosen_logps + prompt_logps) / (chosen_tokens +
    prompt_tokens)``, the token-mean NLL of the whole chosen sequence. ``beta = 0`` is SFT on the chosen sequences
    (per-sequence token-mean NLL).

    Args:
        chosen_logps, rejected_logps: (B,) log-probs summed over completion tokens.
        chosen_tokens, rejected_tokens: (B,) completion token counts (>= 1).
        beta: weight lambda of the odds-ratio term (>= 0).
        prompt_logps, prompt_tokens: (B,) summed log-probs and count of the chosen sequence's other (untrained,
            non-padding) target tokens, for the NLL term only; None = completion-only NLL.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards, extra)``: (B,) fp32 each; rewards = ``beta`` x token-mean
        log-prob (detached, as TRL's ORPOTrainer); ``extra`` = ``nll_loss`` (-a), ``log_odds_ratio`` (the log
        sigmoid term) and ``log_odds_chosen`` (the log-odds difference), detached.
    """
    a = chosen_logps.float() / chosen_tokens.float()
    b = rejected_logps.float() / rejected_tokens.float()
    log_odds = (a - log1mexp(a)) - (b - log1mexp(b))
    ratio = F.logsigmoid(log_odds)
    if prompt_logps is None:
        nll = -a
    else:
        nll = -(chosen_logps.float() + prompt_logps.float()) / (chosen_tokens.float() + prompt_tokens.float())
    losses = nll - beta * ratio
    extra = {"nll_loss": nll.detach(), "log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}
    return losses, beta * a.detach(), beta * b.detach(), extra


class ORPOStage(ReferenceFreeStage):
    """ORPO on preference pairs; batches are (2B, T): chosen rows then rejected rows; no reference forward."""

    name = "orpo"
    eval_keys: ClassVar[tuple[str, ...]] = (*ReferenceFreeStage.eval_keys, "prompt_logps", "prompt_tokens")

    def _all(self, model, batch):
        """Summed completion log-probs and token counts of both sides, plus (``orpo.nll_on_prompt``) the summed
        log-probs and count of the chosen rows' other non-padding target tokens (zeros when off), one forward."""
        if not self.recipe.orpo.nll_on_prompt:
            values = super()._all(model, batch)
            zeros = values[0].detach().new_zeros(values[0].shape)
            return (*values, zeros, zeros)
        labels, n = batch["labels"], batch["input_ids"].shape[0] // 2
        every = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, IGNORE_INDEX)  # (2B, T) all real tokens
        scored = torch.cat([every[:n], labels[n:]])  # chosen: whole sequence; rejected: completion only
        logps = per_token_logps(model, batch, scored)  # (2B, T-1), 0 where not scored
        completion = labels[:, 1:] != IGNORE_INDEX
        sums = (logps * completion).sum(-1)
        other = (logps[:n] * ~completion[:n]).sum(-1)
        tokens = completion_tokens(labels)
        other_tokens = (every[:n, 1:] != IGNORE_INDEX).sum(-1).float() - tokens[:n]
        return sums[:n], sums[n:], tokens[:n], tokens[n:], other, other_tokens

    def pair_losses(self, chosen_logps, rejected_logps, chosen_tokens, rejected_tokens, prompt_logps=None,
                    prompt_tokens=None):
        on_prompt = self.recipe.orpo.nll_on_prompt
        return orpo_loss(chosen_logps, rejected_logps, chosen_tokens, rejected_tokens, self.recipe.orpo.beta,
                         prompt_logps if on_prompt else None, prompt_tokens if on_prompt else None)
