"""Arithmetic every online-RL stage needs: masked reductions, entropy, KL estimators.

Shapes: B = completions, N = response tokens (right-padded); ``mask`` (B, N) is 1 on real response tokens (up to and
including the first EOS) and 0 on the padding after it. Reductions count real tokens only.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (over ``dim``, or everything)."""
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the real tokens (0 when there are none)."""
    return masked_sum(values, mask, dim) / mask.sum(dim if dim is not None else None).clamp(min=1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """(B, N, V) logits -> (B, N) entropy in nats, computed in fp32."""
    logits = logits.float()
    log_z = torch.logsumexp(logits, dim=-1)
    return log_z - (torch.softmax(logits, dim=-1) * logits).sum(-1)


def kl_estimate(logps: torch.Tensor, ref_logps: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the log-probs of tokens sampled from the policy
    (Schulman 2020, "Approximating KL Divergence"). With ``log_r = ref_logp - logp``:

    * ``k1 = -log_r`` (unbiased, can be negative per token);
    * ``k2 = 0.5 * log_r**2`` (biased, low variance);
    * ``k3 = exp(log_r) - log_r - 1`` (unbiased, always >= 0; GRPO's KL term, Shao et al. 2024).

    All three are exactly 0 where the policy equals the reference.

    Args:
        logps, ref_logps: (B, N) log-probs of the sampled tokens under the policy and the reference.
        estimator: ``k1`` | ``k2`` | ``k3``.

    Returns:
        (B, N) per-token estimates (multiply by the mask).

    Raises:
        ValueError: an unknown estimator.
    """
    log_r = ref_logps - logps
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    if estimator == "k3":
        return torch.exp(log_r) - log_r - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; use one of {', '.join(KL_ESTIMATORS)}")
