"""Tensor operations shared by the stages' losses.

Shapes: B = sequences in the micro-batch, T = tokens per sequence (padded), V = vocabulary size.
Labels use -100 for positions that are not trained (prompt, padding, packed-row boundaries).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def shift_for_causal_lm(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Align next-token predictions with their targets.

    Args:
        logits: (B, T, V) model outputs; position t predicts token t + 1.
        labels: (B, T) target ids, -100 where not trained.

    Returns:
        ``(logits[:, :-1], labels[:, 1:])`` of shapes (B, T-1, V) and (B, T-1).
    """
    return logits[:, :-1, :], labels[:, 1:]


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probability of each target token, computed in fp32 (fp16/bf16 logits are upcast).

    Args:
        logits: (B, T, V) unshifted logits.
        labels: (B, T) unshifted labels, -100 where not trained.

    Returns:
        ``(logps, mask)``: (B, T-1) fp32 log p(label_{t+1} | tokens_{<=t}) with 0 at masked positions,
        and the (B, T-1) bool mask of trained positions.
    """
    logits, labels = shift_for_causal_lm(logits, labels)
    mask = labels != IGNORE_INDEX
    safe = labels.masked_fill(~mask, 0)
    logits = logits.float()
    picked = torch.gather(logits, -1, safe.unsqueeze(-1)).squeeze(-1)
    logps = picked - torch.logsumexp(logits, dim=-1)
    return logps.masked_fill(~mask, 0.0), mask


def count_trained_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of trained target positions after the causal shift: ``(labels[:, 1:] != -100).sum()``."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()


def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over trained tokens, in fp32.

    Args:
        logits: (B, T, V). labels: (B, T) with -100 where not trained.

    Returns:
        ``(loss_sum, n_tokens)``, both scalars; the mean loss is ``loss_sum / n_tokens``. The caller
        divides by the token count of the whole optimizer step, which keeps gradient accumulation exact
        (transformers #34191).
    """
    logits, labels = shift_for_causal_lm(logits, labels)
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (labels != IGNORE_INDEX).sum()


def per_sequence_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence summed cross-entropy and trained-token count (for token-weighted evaluation).

    Args:
        logits: (B, T, V). labels: (B, T).

    Returns:
        ``(loss_sums, n_tokens)``, each (B,) fp32.
    """
    logps, mask = token_logps(logits, labels)
    return -logps.sum(-1), mask.sum(-1).float()


LOG_HALF = -0.6931471805599453  # log(1/2) = -ln 2, the branch point of log1mexp (Maechler 2012)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, exact to the working precision over the whole range (Maechler 2012,
    "Accurately computing log(1 - exp(-|a|))"): ``log(-expm1(x))`` for ``x > -ln 2`` and ``log1p(-exp(x))`` for
    ``x <= -ln 2``; computed in fp32 at least (fp16/bf16 inputs are upcast, fp64 stays fp64).

    Each branch only ever sees inputs of its own side of ``-ln 2``, so the unused branch cannot put ``inf``/``NaN``
    into the gradient of ``torch.where`` (``d/dx = -1 / expm1(-x)``, finite for every ``x < 0``: ``-1e12`` at
    ``x = -1e-12``). ``x >= 0`` (a probability that rounded to 1) is read as the largest value below 0 that the dtype
    represents as a normal number (``-finfo.tiny``), so the result stays finite (-87.3 in fp32) instead of ``-inf``.
    No other clamp: a clamp at ``-1e-7`` gave -16.1 instead of -17.3 at ``x = -3e-8`` (llmtune issue 21).

    Args:
        x: any shape, values < 0 (a log-probability, e.g. a token-mean log-prob).

    Returns:
        ``log(1 - exp(x))``, same shape, dtype ``promote(x.dtype, float32)``.
    """
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    x = x.clamp(max=-torch.finfo(x.dtype).tiny)
    near = x > LOG_HALF
    # each branch gets inputs of its own side only (the other side's values are replaced by the branch point)
    x_near = torch.where(near, x, torch.full_like(x, LOG_HALF))
    x_far = torch.where(near, torch.full_like(x, LOG_HALF), x)
    return torch.where(near, torch.log(-torch.expm1(x_near)), torch.log1p(-torch.exp(x_far)))


def perplexity(loss: float) -> float:
    """exp(loss), ``inf`` when it overflows."""
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")
