"""PPO arithmetic: per-token rewards, GAE, whitening, clipped losses, KL controllers, running score statistics.

Shapes: B = rollouts (prompt + sampled response), N = response tokens (right-padded to the longest response of the
batch); ``mask`` (B, N) is 1 on real response tokens (up to and including the first EOS) and 0 on the padding after
it. Every reduction is over real tokens only: padding never enters a KL, an advantage, a loss or a statistic
(trl #256 scored pads as response tokens and reported negative KL).

Sources: clipped surrogate objective and clipped value loss — Schulman et al. 2017 (PPO) as implemented in OpenAI's
``lm-human-preferences`` and TRL's PPOv2 trainer; GAE — Schulman et al. 2016; per-token KL penalty with the score
at the last token and the adaptive KL controller — Ziegler et al. 2019 / Ouyang et al. 2022.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from llmtune.rl.ops import clipped_surrogate, masked_mean, masked_sum


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  stats: tuple[float, float, float] | None = None) -> torch.Tensor:
    """(values - mean) / sqrt(var + 1e-8) over the real tokens (unbiased variance, as TRL's ``masked_whiten``);
    padding positions come out as 0.

    Args:
        values, mask: (B, N).
        shift_mean: subtract the mean (False keeps the mean, for rewards).
        stats: ``(sum, sum of squares, count)`` over all ranks, when the batch is spread over processes; default:
            this tensor's own.
    """
    if stats is None:
        total, squares, count = float(masked_sum(values, mask)), float(masked_sum(values**2, mask)), float(mask.sum())
    else:
        total, squares, count = stats
    mean = total / max(count, 1.0)
    var = max(squares / max(count, 1.0) - mean**2, 0.0) * (count / (count - 1) if count > 1 else 1.0)
    whitened = (values - mean) / math.sqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


def per_token_rewards(scores: torch.Tensor, logps: torch.Tensor, ref_logps: torch.Tensor, mask: torch.Tensor,
                      kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The RLHF reward: ``-kl_coef * KL_t`` at every real response token plus the scalar score at the last one.

    ``KL_t = logp_t - ref_logp_t`` (the sampled token's log-ratio: an unbiased per-token estimate of
    KL(policy || reference), exactly 0 when the policy is the reference).

    Args:
        scores: (B,) one score per rollout. logps, ref_logps: (B, N) log-probs of the sampled tokens under the
            policy (at rollout time) and the reference. mask: (B, N).

    Returns:
        ``(rewards, kl)``, both (B, N), 0 on padding.
    """
    kl = (logps - ref_logps) * mask
    rewards = -kl_coef * kl
    last = (mask.sum(1).long() - 1).clamp(min=0)  # responses are right-padded: last real token = length - 1
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += scores.to(rewards.dtype)
    return rewards * mask, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over right-padded responses.

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V_{t+1} = 0`` after the last real token (the episode ends
    there: the terminal step bootstraps from nothing); ``A_t = delta_t + gamma * lam * A_{t+1}``; returns
    ``R_t = A_t + V_t``. Padding positions get 0 advantage and 0 return and do not leak into real ones.

    Args:
        rewards, values, mask: (B, N).

    Returns:
        ``(advantages, returns)``, both (B, N).
    """
    rewards, values = rewards * mask, values * mask
    n = rewards.shape[1]
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(n)):
        next_value = values[:, t + 1] * mask[:, t + 1] if t + 1 < n else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


@dataclass
class PolicyLoss:
    """Sums over the real tokens of a micro-batch (divide by the step's token count for the mean)."""

    loss_sum: torch.Tensor  # sum of max(-A r, -A clip(r)) (x the importance weight, when given) over tokens
    clipped: torch.Tensor  # number of tokens where the clipped branch was taken
    approx_kl_sum: torch.Tensor  # sum of 0.5 (logp - old_logp)^2


def policy_loss(logps: torch.Tensor, old_logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cliprange: float, is_weights: torch.Tensor | None = None) -> PolicyLoss:
    """Clipped surrogate loss ``max(-A r, -A clip(r, 1-eps, 1+eps))`` with ``r = exp(logp - old_logp)``
    (:func:`llmtune.rl.ops.clipped_surrogate`, GRPO's too), times the rollout engine's truncated importance weight
    ``w_t`` of each token when given (Yao et al. 2025: the tokens were sampled by another engine than the one computing
    ``old_logp``; :func:`llmtune.rl.ops.truncated_is_weights`). PPO's KL penalty is in the reward, so the weight
    multiplies the whole per-token policy loss.

    Args:
        logps: (B, N) current log-probs of the rollout tokens (with grad). old_logps: (B, N) at rollout time.
        advantages: (B, N). mask: (B, N). cliprange: eps. is_weights: (B, N) detached weights, or None (= 1).
    """
    log_ratio = (logps - old_logps) * mask
    surrogate = clipped_surrogate(torch.exp(log_ratio), advantages, cliprange, cliprange, is_weights)
    return PolicyLoss(
        loss_sum=masked_sum(surrogate.per_token, mask),
        clipped=masked_sum(surrogate.clipped_low + surrogate.clipped_high, mask),
        approx_kl_sum=masked_sum(0.5 * log_ratio.detach() ** 2, mask),
    )


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped value loss ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``, summed over tokens.

    Args:
        values: (B, N) current predictions (with grad). old_values: (B, N) at rollout time. returns: (B, N).

    Returns:
        ``(loss_sum, clipped_count)``.
    """
    clipped_values = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped_values - returns) ** 2
    loss = 0.5 * masked_sum(torch.maximum(unclipped_loss, clipped_loss), mask)
    return loss, masked_sum((clipped_loss > unclipped_loss).float(), mask).detach()


def explained_variance(predictions: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(targets - predictions) / Var(targets) over the real tokens (nan when the targets are constant)."""
    residual = targets - predictions
    var_t = masked_mean((targets - masked_mean(targets, mask)) ** 2, mask)
    var_r = masked_mean((residual - masked_mean(residual, mask)) ** 2, mask)
    return float("nan") if float(var_t) == 0 else float(1 - var_r / var_t)


class KLController:
    """The KL coefficient: fixed, or adaptive (Ziegler et al. 2019): after each rollout batch,
    ``kl_coef *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon`` with KL the mean per-response KL (nats) and
    n the rollouts in the batch."""

    def __init__(self, kl_coef: float, target: float | None = None, horizon: int = 10000):
        self.value, self.target, self.horizon = kl_coef, target, horizon

    def update(self, kl: float, n_rollouts: int) -> None:
        if self.target is None or not math.isfinite(kl):
            return
        error = max(-0.2, min(0.2, kl / self.target - 1.0))
        self.value *= 1.0 + error * n_rollouts / self.horizon


class RunningMoments:
    """Running mean/std of scores over every rollout so far (Chan et al. parallel update). ``normalize`` updates
    with the batch FIRST and then uses the running statistics: on the first batch those are the batch's own, never
    an identity transform (OpenRLHF #693 applied mean 0 / std 1 when no statistics existed)."""

    def __init__(self):
        self.mean, self.var, self.count = 0.0, 1.0, 0

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().double().flatten()
        n = x.numel()
        if n == 0:
            return
        batch_mean, batch_var = float(x.mean()), float(x.var(unbiased=False))
        total = self.count + n
        delta = batch_mean - self.mean
        m2 = self.var * self.count + batch_var * n + delta**2 * self.count * n / total
        self.mean, self.var, self.count = self.mean + delta * n / total, m2 / total, total

    @property
    def std(self) -> float:
        return math.sqrt(self.var * self.count / (self.count - 1)) if self.count > 1 else 1.0

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """Update with ``x`` (B,), then return ``(x - mean) / std`` with the running statistics."""
        self.update(x)
        return (x - self.mean) / max(self.std, 1e-8)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), int(state["count"])
