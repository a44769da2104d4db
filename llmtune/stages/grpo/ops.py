"""GRPO arithmetic: group-relative advantages and the clipped policy loss with its three aggregations.

Shapes: B = completions, laid out group by group (rows g*G .. g*G+G-1 are the G = ``num_generations`` completions of
prompt g), N = completion tokens (right-padded); ``mask`` (B, N) is 1 on the real tokens that enter the loss.

Sources: group-relative advantages and the per-token KL term — Shao et al. 2024 (DeepSeekMath, GRPO); token-level
loss, clip-higher (``epsilon_high`` > ``epsilon_low``), dynamic sampling, overlong filtering — Yu et al. 2025 (DAPO);
no std scaling and a constant normaliser — Liu et al. 2025 (Dr. GRPO, "Understanding R1-Zero-Like Training").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmtune.rl.ops import kl_estimate, masked_sum

AGGREGATIONS = ("token_mean", "sequence_mean", "constant")
ADV_EPS = 1e-4  # added to the std before dividing (as TRL's GRPOTrainer)


def group_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group",
                     batch_std: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages ``A_i = (r_i - mean_group) / (std + eps)`` (Shao et al. 2024).

    ``scale_rewards``: ``group`` divides by the group's std (GRPO), ``batch`` by the std of all rewards of the
    rollout batch (``batch_std``, gathered over ranks by the caller; default this tensor's), ``none`` not at all
    (Dr. GRPO: the std term favours groups that are almost all right or all wrong). Std is unbiased (n - 1), eps
    = 1e-4. A group whose rewards are all equal gets exactly 0 advantage whatever the scaling.

    Args:
        rewards: (B,) total rewards, B a multiple of ``num_generations``, grouped consecutively.
        num_generations: G.
        scale_rewards: ``group`` | ``batch`` | ``none``.
        batch_std: the rollout batch's reward std for ``batch`` scaling.

    Returns:
        ``(advantages, all_equal)``: (B,) fp32 and (B / G,) bool, True for groups with all-equal rewards.

    Raises:
        ValueError: B is not a multiple of G, or an unknown ``scale_rewards``.
    """
    if rewards.shape[0] % num_generations:
        raise ValueError(f"{rewards.shape[0]} rewards are not whole groups of num_generations={num_generations}")
    grouped = rewards.float().view(-1, num_generations)  # (B/G, G)
    mean = grouped.mean(1, keepdim=True)
    all_equal = (grouped == grouped[:, :1]).all(1)
    centred = torch.where(all_equal[:, None], torch.zeros_like(grouped), grouped - mean)
    if scale_rewards == "group":
        scale = grouped.std(1, keepdim=True) + ADV_EPS
    elif scale_rewards == "batch":
        std = float(rewards.float().std()) if batch_std is None else batch_std
        scale = torch.full_like(mean, std + ADV_EPS)
    elif scale_rewards == "none":
        scale = torch.ones_like(mean)
    else:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; use group, batch or none")
    return (centred / scale).reshape(-1), all_equal


def count_items(mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """What the step loss is divided by, for a micro-batch: completion tokens (``token_mean``) or completions with
    at least one token in the loss (``sequence_mean``, ``constant``). Summed over the step's micro-batches and
    ranks by the core, so the normaliser belongs to the whole optimizer step."""
    return mask.sum() if aggregation == "token_mean" else (mask.sum(1) > 0).sum()


@dataclass
class GRPOLoss:
    """Sums over a micro-batch (the caller divides the loss by the step's item count)."""

    loss_sum: torch.Tensor  # the aggregated per-token loss (see grpo_loss)
    clipped_low: torch.Tensor  # tokens with A < 0 whose ratio fell below 1 - epsilon_low (clipped branch taken)
    clipped_high: torch.Tensor  # tokens with A > 0 whose ratio rose above 1 + epsilon_high
    kl_sum: torch.Tensor  # sum of the per-token KL estimate (0 without a reference)


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              epsilon_low: float, epsilon_high: float, aggregation: str, max_new_tokens: int,
              beta: float = 0.0, ref_logps: torch.Tensor | None = None, kl_estimator: str = "k3") -> GRPOLoss:
    """Clipped surrogate of GRPO/DAPO with an optional KL term, aggregated as the step normaliser expects.

    Per token: ``l_t = -min(r_t A, clip(r_t, 1 - epsilon_low, 1 + epsilon_high) A) + beta * KL_t`` with
    ``r_t = exp(logp_t - old_logp_t)`` (old = the sampling policy) and ``KL_t`` the ``kl_estimator`` estimate of
    KL(policy || reference) (Schulman 2020; GRPO uses k3). ``loss_sum`` by ``aggregation``, to be divided by
    :func:`count_items` of the whole step:

    * ``token_mean`` (DAPO): ``sum_{b,t} l_bt`` -> / all completion tokens of the step; long completions weigh more.
    * ``sequence_mean`` (GRPO, Shao et al. 2024): ``sum_b (sum_t l_bt / |o_b|)`` -> / completions of the step.
    * ``constant`` (Dr. GRPO): ``sum_{b,t} l_bt / max_new_tokens`` -> / completions of the step; no length bias.

    Args:
        logps: (B, N) current log-probs of the sampled tokens (with grad). old_logps: (B, N) at sampling time.
        advantages: (B,) one per completion. mask: (B, N) tokens in the loss.
        epsilon_low, epsilon_high: clip range below / above 1.
        aggregation: ``token_mean`` | ``sequence_mean`` | ``constant``. max_new_tokens: the constant's L.
        beta: KL weight; ref_logps: (B, N) reference log-probs (needed when beta > 0).
        kl_estimator: ``k1`` | ``k2`` | ``k3``.

    Raises:
        ValueError: an unknown aggregation, or beta > 0 without ``ref_logps``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss_aggregation {aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
    mask = mask.float()
    adv = advantages.float()[:, None]  # (B, 1)
    ratio = torch.exp((logps - old_logps) * mask)
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    per_token = -torch.minimum(ratio * adv, clipped_ratio * adv)
    kl = torch.zeros_like(per_token)
    if ref_logps is not None:
        kl = kl_estimate(logps, ref_logps, kl_estimator) * mask
    if beta > 0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probs")
        per_token = per_token + beta * kl
    if aggregation == "token_mean":
        loss_sum = masked_sum(per_token, mask)
    elif aggregation == "sequence_mean":
        loss_sum = (masked_sum(per_token, mask, dim=1) / mask.sum(1).clamp(min=1)).sum()
    else:
        loss_sum = masked_sum(per_token, mask) / max_new_tokens
    with torch.no_grad():
        low = ((ratio < 1.0 - epsilon_low) & (adv < 0)).float()
        high = ((ratio > 1.0 + epsilon_high) & (adv > 0)).float()
    return GRPOLoss(loss_sum, masked_sum(low, mask), masked_sum(high, mask), masked_sum(kl.detach(), mask))
