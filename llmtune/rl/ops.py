"""Arithmetic every online-RL stage needs: masked reductions, entropy, KL estimators, the rollout engine's
importance weights.

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


def truncated_is_weights(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights of tokens sampled by a rollout engine (Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training"; TRL's ``vllm_importance_sampling_correction`` with
    token-level truncation): ``w_t = min(pi_trainer(y_t) / pi_engine(y_t), cap)``, which corrects the policy
    gradient for the numerical mismatch between the engine that sampled and the trainer that computes the loss.

    Args:
        trainer_logps: (B, N) log-probs of the sampled tokens under the trainer's policy at sampling time.
        engine_logps: (B, N) the engine's log-probs of the same tokens (its sampling distribution).
        mask: (B, N) 1 on real response tokens. cap: C >= 1.

    Returns:
        (B, N) fp32 weights, detached, 0 on padding.
    """
    ratio = torch.exp((trainer_logps.detach().float() - engine_logps.float()) * mask)
    return ratio.clamp(max=cap) * mask


def engine_mismatch_stats(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor,
                          cap: float) -> torch.Tensor:
    """Sums of the engine/trainer log-prob mismatch over the real tokens of one rank, to be summed (max for
    element 1) over ranks and turned into metrics by :func:`engine_mismatch_metrics`.

    Args:
        trainer_logps, engine_logps, mask: (B, N) as in :func:`truncated_is_weights`. cap: C.

    Returns:
        (5,) fp32: ``[sum |delta|, max |delta|, tokens, sum of min(ratio, C), tokens with ratio > C]`` with
        ``delta = trainer_logp - engine_logp`` (nats) and ``ratio = exp(delta)``.
    """
    m = mask.bool()
    delta = (trainer_logps.detach().float() - engine_logps.float())[m]
    ratio = torch.exp(delta)
    if delta.numel() == 0:
        return torch.zeros(5, device=mask.device)
    return torch.stack([delta.abs().sum(), delta.abs().max(), torch.tensor(float(delta.numel()), device=delta.device),
                        ratio.clamp(max=cap).sum(), (ratio > cap).float().sum()])


def engine_mismatch_metrics(stats: torch.Tensor) -> dict[str, float]:
    """Metrics of :func:`engine_mismatch_stats` rows of all ranks, (R, 5).

    Returns:
        ``rollout/logprob_diff_mean`` and ``rollout/logprob_diff_max`` (|trainer - engine| log-prob of the sampled
        tokens, nats, mean and max over all real tokens), ``rollout/is_weight_mean`` (mean truncated weight) and
        ``rollout/is_clipped_fraction`` (share of tokens whose ratio exceeded the cap).
    """
    stats = stats.reshape(-1, 5).float()
    tokens = float(stats[:, 2].sum())
    per = max(tokens, 1.0)
    return {"rollout/logprob_diff_mean": float(stats[:, 0].sum()) / per,
            "rollout/logprob_diff_max": float(stats[:, 1].max()) if tokens else 0.0,
            "rollout/is_weight_mean": float(stats[:, 3].sum()) / per if tokens else 1.0,
            "rollout/is_clipped_fraction": float(stats[:, 4].sum()) / per}
