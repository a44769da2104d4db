"""GRPO arithmetic: advantages (group-relative, leave-one-out, global batch normalisation) over the rows that
train, and the clipped policy loss (token or sequence importance ratios) with its three aggregations (DAPO's
overlong reward shaping is a shaping step of the rewards: :mod:`llmtune.rewards.shaping`).

Shapes: B = completions of a rollout batch (this rank), in any order; ``group_ids`` (B,) names each row's prompt (the
G = ``num_generations`` completions of one prompt share an id: nothing here assumes they are consecutive); N =
completion tokens (right-padded); ``mask`` (B, N) is 1 on the real tokens that enter the loss; ``trainable`` (B,)
bool is True for the rows whose loss mask is not empty. A row that does not train (a truncated completion under
``mask_truncated_completions``, a group dropped by dynamic sampling, a row on which every reward function abstained)
never enters a statistic an advantage is computed from: its group's mean/std, the batch std, the global moments.

Sources: group-relative advantages and the per-token KL term — Shao et al. 2024 (DeepSeekMath, GRPO); token-level
loss, clip-higher (``epsilon_high`` > ``epsilon_low``), dynamic sampling, overlong filtering and overlong reward
shaping — Yu et al. 2025 (DAPO); no std scaling and a constant normaliser — Liu et al. 2025 (Dr. GRPO,
"Understanding R1-Zero-Like Training"); leave-one-out baseline — Ahmadian et al. 2024 (RLOO, "Back to Basics");
global batch normalisation — Hu 2025 (REINFORCE++); sequence-level importance ratios — Zheng et al. 2025 (GSPO); the
importance weight on the KL estimate — DeepSeek-AI 2025 (DeepSeek-V3.2, "unbiased KL estimate"; TRL's
``use_bias_correction_kl``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmtune.rl.ops import clipped_surrogate, kl_estimate, masked_sum

AGGREGATIONS = ("token_mean", "sequence_mean", "constant")
# names as verl's ``AdvantageEstimator`` (OpenRLHF: group_norm, rloo, reinforce)
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
ADV_EPS = 1e-4  # added to the std before dividing (as TRL's GRPOTrainer)
RPP_VAR_MIN = 1e-8  # REINFORCE++: rsqrt(max(var, 1e-8)) as OpenRLHF's global normalisation


def _groups(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(B,) group ids -> (B,) index of each row's group in 0..n-1, and n."""
    if group_ids.dim() != 1:
        raise ValueError(f"group_ids must be (B,), got shape {tuple(group_ids.shape)}")
    unique, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, unique.numel()


def _group_sum(values: torch.Tensor, inverse: torch.Tensor, n: int) -> torch.Tensor:
    """(B,) values -> (B,) the sum over each row's group."""
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)[inverse]


def _trainable(rewards: torch.Tensor, trainable: torch.Tensor | None) -> torch.Tensor:
    if trainable is None:
        return torch.ones_like(rewards, dtype=torch.bool)
    if trainable.shape != rewards.shape:
        raise ValueError(f"trainable {tuple(trainable.shape)} does not match rewards {tuple(rewards.shape)}")
    return trainable.bool()


def group_all_equal(rewards: torch.Tensor, group_ids: torch.Tensor, trainable: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Rows whose group carries no signal: the rewards of its trainable rows are all exactly equal (a group with
    fewer than two trainable rows included).

    Args:
        rewards: (B,). group_ids: (B,) any integer labels, one per prompt. trainable: (B,) bool (default all).

    Returns:
        (B,) bool, the same value for every row of a group.
    """
    keep = _trainable(rewards, trainable)
    inverse, n = _groups(group_ids)
    r = rewards.float()
    high = torch.full((n,), -math.inf, device=r.device).scatter_reduce(
        0, inverse, torch.where(keep, r, -math.inf), "amax")
    low = torch.full((n,), math.inf, device=r.device).scatter_reduce(
        0, inverse, torch.where(keep, r, math.inf), "amin")
    return (high <= low)[inverse]


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, trainable: torch.Tensor | None = None,
                     scale_rewards: str = "group", batch_std: float | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-relative advantages ``A_i = (r_i - mean_group) / (std + eps)`` (Shao et al. 2024), the group's
    statistics taken over its trainable rows only.

    ``scale_rewards``: ``group`` divides by the group's std (GRPO), ``batch`` by the std of the trainable rewards
    of the rollout batch (``batch_std``, gathered over ranks by the caller; default this tensor's), ``none`` not at
    all (Dr. GRPO: the std term favours groups that are almost all right or all wrong). Std is unbiased (n - 1), eps
    = 1e-4. A group whose trainable rewards are all equal (or that has fewer than two trainable rows) gets exactly 0
    advantage whatever the scaling; a row that does not train gets 0.

    Args:
        rewards: (B,) total rewards. group_ids: (B,) the prompt of each row (rows of a group need not be adjacent).
        trainable: (B,) bool, rows whose loss mask is not empty (default all).
        scale_rewards: ``group`` | ``batch`` | ``none``.
        batch_std: the rollout batch's std of trainable rewards for ``batch`` scaling.

    Returns:
        ``(advantages, all_equal)``: (B,) fp32 and (B,) bool (:func:`group_all_equal`).

    Raises:
        ValueError: an unknown ``scale_rewards``, or shapes that do not match.
    """
    keep = _trainable(rewards, trainable)
    inverse, n = _groups(group_ids)
    r, w = rewards.float(), keep.float()
    count = _group_sum(w, inverse, n)
    mean = _group_sum(r * w, inverse, n) / count.clamp(min=1)
    all_equal = group_all_equal(rewards, group_ids, keep)
    centred = torch.where(all_equal | ~keep, torch.zeros_like(r), r - mean)
    if scale_rewards == "group":
        var = _group_sum(w * (r - mean) ** 2, inverse, n) / (count - 1).clamp(min=1)
        scale = var.sqrt() + ADV_EPS
    elif scale_rewards == "batch":
        std = moments_std(moments(r, w), unbiased=True) if batch_std is None else batch_std
        scale = torch.full_like(r, std + ADV_EPS)
    elif scale_rewards == "none":
        scale = torch.ones_like(r)
    else:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; use group, batch or none")
    return centred / scale, all_equal


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, trainable: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """Leave-one-out advantages (Ahmadian et al. 2024, RLOO): ``A_i = r_i - mean_{j != i} r_j`` over the trainable
    rows j of i's group, no std scaling (OpenRLHF ``advantage_estimator: rloo``: ``baseline = (sum - r) / (n - 1)``).

    A row that does not train, or whose group has fewer than two trainable rows or all-equal trainable rewards, gets
    exactly 0.

    Args:
        rewards: (B,). group_ids: (B,). trainable: (B,) bool (default all).

    Returns:
        (B,) fp32.
    """
    keep = _trainable(rewards, trainable)
    inverse, n = _groups(group_ids)
    r, w = rewards.float(), keep.float()
    count = _group_sum(w, inverse, n)
    baseline = (_group_sum(r * w, inverse, n) - r) / (count - 1).clamp(min=1)
    silent = group_all_equal(rewards, group_ids, keep) | ~keep
    return torch.where(silent, torch.zeros_like(r), r - baseline)


def moments(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``[sum w, sum w v, sum w v^2]`` (fp64, (3,)) of (B,) values with (B,) weights: what ranks all-reduce (sum) to
    get the statistics of a whole rollout batch."""
    v, w = values.double(), weights.double()
    return torch.stack([w.sum(), (w * v).sum(), (w * v * v).sum()])


def moments_std(stats: torch.Tensor, unbiased: bool) -> float:
    """The std of :func:`moments` (``unbiased``: / (n - 1), for unit weights); 0 with fewer than 2 (or no) items."""
    n, total, squares = (float(x) for x in stats)
    if n <= (1 if unbiased else 0):
        return 0.0
    var = max(squares - total * total / n, 0.0) / (n - 1 if unbiased else n)
    return math.sqrt(var)


def reinforce_pp_advantages(rewards: torch.Tensor, trainable: torch.Tensor | None, stats: torch.Tensor
                            ) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): global batch normalisation of the outcome reward, no per-prompt baseline,
    ``A_i = (r_i - mean) * rsqrt(max(var, 1e-8))``.

    With an outcome reward, gamma = 1 and the KL in the loss (not in the reward), every token of completion i has
    return r_i; OpenRLHF's ``advantage_estimator: reinforce`` (``experience_maker.py``, "Normalize advantages across
    all experiences") then whitens over all action tokens of the rollout batch: ``mean = sum_tokens A / n_tokens``,
    ``var = sum_tokens (A - mean)^2 / n_tokens`` (biased). So ``stats`` are :func:`moments` of the rewards weighted
    by each row's trainable token count, summed over ranks (verl's ``reinforce_plus_plus`` whitens over the same
    tokens). A row that does not train gets 0.

    Args:
        rewards: (B,). trainable: (B,) bool (default all). stats: (3,) the whole rollout batch's moments.

    Returns:
        (B,) fp32.
    """
    keep = _trainable(rewards, trainable)
    n, total, squares = (float(x) for x in stats)
    if n <= 0:
        return torch.zeros_like(rewards, dtype=torch.float32)
    mean = total / n
    var = max(squares / n - mean * mean, 0.0)
    adv = (rewards.float() - mean) / math.sqrt(max(var, RPP_VAR_MIN))
    return torch.where(keep, adv, torch.zeros_like(adv))


def advantage_moments(estimator: str, scale_rewards: str, rewards: torch.Tensor, trainable: torch.Tensor,
                      token_counts: torch.Tensor) -> torch.Tensor | None:
    """The local :func:`moments` an estimator needs from the whole rollout batch (the caller sums them over ranks):
    unit weights on trainable rows for ``grpo`` with ``scale_rewards: batch``, trainable token counts for
    ``reinforce_plus_plus``; None when only the rank's own groups matter."""
    if estimator == "reinforce_plus_plus":
        return moments(rewards, token_counts.float() * trainable.float())
    if estimator == "grpo" and scale_rewards == "batch":
        return moments(rewards, trainable.float())
    return None


def compute_advantages(estimator: str, rewards: torch.Tensor, group_ids: torch.Tensor, trainable: torch.Tensor,
                       scale_rewards: str = "group", stats: torch.Tensor | None = None,
                       token_counts: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) advantages of ``estimator`` (``grpo`` :func:`group_advantages`, ``rloo`` :func:`rloo_advantages`,
    ``reinforce_plus_plus`` :func:`reinforce_pp_advantages`) over the trainable rows.

    Args:
        stats: the rollout batch's :func:`advantage_moments` summed over ranks (default this rank's).
        token_counts: (B,) trainable tokens per row (``reinforce_plus_plus`` without ``stats``).

    Raises:
        ValueError: an unknown estimator or ``scale_rewards``.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage_estimator {estimator!r}; use one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    if stats is None:
        counts = token_counts if token_counts is not None else torch.ones_like(rewards)
        stats = advantage_moments(estimator, scale_rewards, rewards, trainable, counts)
    if estimator == "rloo":
        return rloo_advantages(rewards, group_ids, trainable)
    if estimator == "reinforce_plus_plus":
        return reinforce_pp_advantages(rewards, trainable, stats)
    batch_std = moments_std(stats, unbiased=True) if stats is not None else None
    return group_advantages(rewards, group_ids, trainable, scale_rewards, batch_std)[0]


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


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor, mask: torch.Tensor,
              epsilon_low: float, epsilon_high: float, aggregation: str, max_new_tokens: int,
              beta: float = 0.0, ref_logps: torch.Tensor | None = None, kl_estimator: str = "k3",
              importance_sampling_level: str = "token", is_weights: torch.Tensor | None = None) -> GRPOLoss:
    """Clipped surrogate of GRPO/DAPO/GSPO with an optional KL term, aggregated as the step normaliser expects.

    Per token: ``l_t = -w_t * min(r A, clip(r, 1 - epsilon_low, 1 + epsilon_high) A) + beta * c * KL_t`` (the
    surrogate is :func:`llmtune.rl.ops.clipped_surrogate`, PPO's too) with

    * ``r`` the importance ratio against the sampling policy (``old_logps``): ``token`` level (PPO/GRPO)
      ``r_t = exp(logp_t - old_logp_t)``; ``sequence`` level (GSPO, Zheng et al. 2025, Eq. 7) the length-normalised
      sequence ratio ``s = exp(mean_t (logp_t - old_logp_t))`` over the completion's loss tokens, the same for all
      its tokens. Its gradient is ``s * (1/|y|) sum_t grad logp_t`` (GSPO Eq. 10), as TRL's
      ``importance_sampling_level="sequence"``; with ``aggregation: sequence_mean`` the loss is GSPO's objective
      ``-(1/G) sum_i min(s_i A_i, clip(s_i) A_i)`` exactly (other aggregations weight a completion's term by its
      length, as TRL's loss types do);
    * ``KL_t`` the ``kl_estimator`` estimate of KL(policy || reference) (Schulman 2020; GRPO uses k3) and ``c_t`` its
      importance weight: the samples come from the old policy, so when ``old_logps`` are given (the policy moved
      since sampling) ``c_t = exp(logp_t - old_logp_t)``, the PER-TOKEN ratio with its gradient, unclipped, at
      both importance-sampling levels (DeepSeek-V3.2's unbiased KL estimate; TRL's ``use_bias_correction_kl``).
      ``KL_t`` is a statement about token t's conditional distribution given its prefix:
      ``E_{y_t ~ pi_old}[pi(y_t) / pi_old(y_t) * k(y_t)] = E_{y_t ~ pi}[k(y_t)]``, whose weight is token t's own
      ratio; the length-normalised sequence ratio ``s`` of GSPO is a geometric mean over the whole completion and
      belongs to the clipped surrogate only (weighting ``KL_t`` by ``s`` would let every other token's drift
      rescale it; TRL main does that). ``c_t = 1`` on policy (``old_logps`` None);
    * ``w_t`` = ``is_weights`` (detached truncated importance weights of the sampling engine vs the trainer), 1 when
      None; they multiply the surrogate, never the KL term.

    ``loss_sum`` by ``aggregation``, to be divided by :func:`count_items` of the whole step:

    * ``token_mean`` (DAPO): ``sum_{b,t} l_bt`` -> / all completion tokens of the step; long completions weigh more.
    * ``sequence_mean`` (GRPO, Shao et al. 2024): ``sum_b (sum_t l_bt / |o_b|)`` -> / completions of the step.
    * ``constant`` (Dr. GRPO): ``sum_{b,t} l_bt / max_new_tokens`` -> / completions of the step; no length bias.

    Args:
        logps: (B, N) current log-probs of the sampled tokens (with grad). old_logps: (B, N) at sampling time, or
            None when the policy has not moved since sampling (the ratio is 1 in value: ``logps`` detached).
        advantages: (B,) one per completion. mask: (B, N) tokens in the loss.
        epsilon_low, epsilon_high: clip range below / above 1 (of the sequence ratio at ``sequence`` level).
        aggregation: ``token_mean`` | ``sequence_mean`` | ``constant``. max_new_tokens: the constant's L.
        beta: KL weight; ref_logps: (B, N) reference log-probs (needed when beta > 0).
        kl_estimator: ``k1`` | ``k2`` | ``k3``. importance_sampling_level: ``token`` | ``sequence``.
        is_weights: (B, N) per-token weights of the surrogate (detached here), or None.

    Raises:
        ValueError: an unknown aggregation or importance_sampling_level, or beta > 0 without ``ref_logps``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown loss_aggregation {aggregation!r}; use one of {', '.join(AGGREGATIONS)}")
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"unknown importance_sampling_level {importance_sampling_level!r}; use token or sequence")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs the reference log-probs")
    mask = mask.float()
    adv = advantages.float()[:, None]  # (B, 1)
    on_policy = old_logps is None
    token_log_ratio = (logps - (logps.detach() if on_policy else old_logps)) * mask  # (B, N)
    log_ratio = token_log_ratio
    if importance_sampling_level == "sequence":
        log_ratio = (log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(mask)
    surrogate = clipped_surrogate(torch.exp(log_ratio), adv, epsilon_low, epsilon_high, is_weights)
    per_token = surrogate.per_token
    kl = torch.zeros_like(per_token)
    if ref_logps is not None:
        kl = kl_estimate(logps, ref_logps, kl_estimator) * mask
        if not on_policy:  # the per-token ratio at both levels (see the docstring)
            kl = kl * torch.exp(token_log_ratio)
    if beta > 0:
        per_token = per_token + beta * kl
    if aggregation == "token_mean":
        loss_sum = masked_sum(per_token, mask)
    elif aggregation == "sequence_mean":
        loss_sum = (masked_sum(per_token, mask, dim=1) / mask.sum(1).clamp(min=1)).sum()
    else:
        loss_sum = masked_sum(per_token, mask) / max_new_tokens
    return GRPOLoss(loss_sum, masked_sum(surrogate.clipped_low, mask), masked_sum(surrogate.clipped_high, mask),
                    masked_sum(kl.detach(), mask))
