"""ORPO: odds-ratio preference optimization (Hong et al. 2024) on preference pairs, with no reference model.

Loss of a pair = NLL of the chosen completion (its token-mean negative log-prob: the SFT loss) plus ``beta`` x the
odds-ratio term ``-log sigmoid(log odds(chosen) - log odds(rejected))``, ``odds(y) = p / (1 - p)`` with ``p`` the
token-mean probability ``exp(mean log p)``. It can start from a base model (no SFT stage first) or from an SFT run.
One policy forward per pair batch; loss of an optimizer step = sum of per-pair losses / pairs in the whole step.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmtune.stages.reference_free import ReferenceFreeStage

LOG_HALF = -math.log(2)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate over the whole range (Maechler 2012); ``x`` is clamped to
    ``<= -1e-7`` so that a completion of probability ~1 gives a large finite log-odds, not inf/NaN."""
    x = x.clamp(max=-1e-7)
    return torch.where(x > LOG_HALF, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair ORPO losses (Hong et al. 2024, Eq. 6-7; no reduction).

    With ``a = chosen_logps / chosen_tokens`` and ``b = rejected_logps / rejected_tokens`` (token-mean log-probs)
    and ``log odds(m) = m - log(1 - exp(m))``: ``loss = -a - beta * log sigmoid(log odds(a) - log odds(b))``.
    ``beta = 0`` is SFT on the chosen completions (per-sequence token-mean NLL).

    Args:
        chosen_logps, rejected_logps: (B,) log-probs summed over completion tokens.
        chosen_tokens, rejected_tokens: (B,) completion token counts (>= 1).
        beta: weight lambda of the odds-ratio term (>= 0).

    Returns:
        ``(losses, chosen_rewards, rejected_rewards, extra)``: (B,) fp32 each; rewards = ``beta`` x token-mean
        log-prob (detached, as TRL's ORPOTrainer); ``extra`` = ``nll_loss`` (-a), ``log_odds_ratio`` (the log
        sigmoid term) and ``log_odds_chosen`` (the log-odds difference), detached.
    """
    a = chosen_logps.float() / chosen_tokens.float()
    b = rejected_logps.float() / rejected_tokens.float()
    log_odds = (a - log1mexp(a)) - (b - log1mexp(b))
    ratio = F.logsigmoid(log_odds)
    nll = -a
    losses = nll - beta * ratio
    extra = {"nll_loss": nll.detach(), "log_odds_ratio": ratio.detach(), "log_odds_chosen": log_odds.detach()}
    return losses, beta * a.detach(), beta * b.detach(), extra


class ORPOStage(ReferenceFreeStage):
    """ORPO on preference pairs; batches are (2B, T): chosen rows then rejected rows; no reference forward."""

    name = "orpo"

    def pair_losses(self, chosen_logps, rejected_logps, chosen_tokens, rejected_tokens):
        return orpo_loss(chosen_logps, rejected_logps, chosen_tokens, rejected_tokens, self.recipe.orpo.beta)
