"""Tensor operations shared by the stages' losses.

Shapes: B = sequences in the micro-batch, T = tokens per sequence (padded), V = vocabulary size.
Labels use -100 for positions that are not trained (prompt, padding, packed-row boundaries).
"""

from __future__ import annotations

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
