"""Arithmetic every online-RL stage needs: masked reductions, entropy, KL estimators, the clipped surrogate of PPO and
GRPO, the rollout engine's importance weights.

Shapes: B = completions, N = response tokens (right-padded); ``mask`` (B, N) is 1 on real response tokens (up to and
including the first EOS) and 0 on the padding after it. Reductions count real tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is 1 (over ``dim``, or everything)."""
    return (values * mask).sum() if dim is None else (values * mask).sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over the real tokens (0 when there are none)."""
    return masked_sum(values, mask, dim) / mask.sum(dim if dim is not None else None).clamp(min=1)


def pack_left(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the masked positions of each row go when packed to the left, in order: ``(index, packed_mask)``, both
    (B, M) with M = the most masked positions of a row; ``index[b, j]`` = the column of row b's j-th masked position
    (0 past its count), ``packed_mask`` 1 on the first ``mask[b].sum()`` columns.

    Multi-turn rollouts interleave the policy's tokens with tool results (``loss_mask`` has holes); sequence
    arithmetic that walks the policy's actions in order (PPO's per-token rewards and GAE) runs on the packed layout
    and is scattered back (:func:`unpack_left`). For a mask that is already left-aligned this is the identity.
    """
    counts = mask.long().sum(1)
    M = max(int(counts.max()) if counts.numel() else 0, 1)
    order = torch.argsort((~mask.bool()).long(), dim=1, stable=True)  # masked columns first, in order
    index = order[:, :M] if order.shape[1] >= M else torch.cat(
        [order, order.new_zeros(order.shape[0], M - order.shape[1])], 1)
    packed_mask = (torch.arange(M, device=mask.device)[None] < counts[:, None]).to(mask.dtype)
    return index * packed_mask.long(), packed_mask


def unpack_left(packed: torch.Tensor, index: torch.Tensor, packed_mask: torch.Tensor, width: int) -> torch.Tensor:
    """The inverse of :func:`pack_left`: (B, M) values back to their (B, width) columns, 0 elsewhere."""
    out = packed.new_zeros(packed.shape[0], width)
    return out.scatter_add_(1, index, packed * packed_mask.to(packed.dtype))


@dataclass
class Surrogate:
    """The clipped surrogate per token (:func:`clipped_surrogate`), before masking and aggregation.

    Attributes:
        per_token: (B, N) ``-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` (times the importance weight).
        clipped_low: (B, N) fp32 1 where the clipped branch was taken below (A < 0 and r < 1 - eps_low).
        clipped_high: (B, N) fp32 1 where it was taken above (A > 0 and r > 1 + eps_high).
    """

    per_token: torch.Tensor
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, epsilon_low: float, epsilon_high: float,
                      is_weights: torch.Tensor | None = None) -> Surrogate:
    """The clipped surrogate objective of PPO (Schulman et al. 2017), as a loss per token: ``-min(r A, clip(r,
    1 - epsilon_low, 1 + epsilon_high) A)``, times ``is_weights`` (the rollout engine's truncated importance weights,
    detached; Yao et al. 2025) when given. PPO (``epsilon_low = epsilon_high = cliprange``, per-token advantages) and
    GRPO (DAPO's clip-higher, one advantage per completion) both call it.

    Args:
        ratio: (B, N) importance ratio against the sampling policy (with grad). advantages: (B, N), or (B, 1) one
            per completion. epsilon_low, epsilon_high: the clip range below / above 1.
        is_weights: (B, N) or None (= 1).

    Returns:
        :class:`Surrogate` (the clip indicators detached).
    """
    clipped_ratio = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    per_token = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    if is_weights is not None:
        per_token = per_token * is_weights.detach().to(per_token.dtype)
    with torch.no_grad():
        low = ((ratio < 1.0 - epsilon_low) & (advantages < 0)).float()
        high = ((ratio > 1.0 + epsilon_high) & (advantages > 0)).float()
    return Surrogate(per_token, low, high)


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


def sampling_logps(logits: torch.Tensor, tokens: torch.Tensor, top_k: int = 0, top_p: float = 1.0,
                   chunk: int = 256) -> torch.Tensor:
    """Log-probs of sampled tokens under the distribution a rollout engine samples from: ``softmax(logits)``
    truncated to the top-k tokens, then to the top-p nucleus, and renormalised over what is kept.

    The truncation is vLLM's (``vllm.v1.sample.ops.topk_topp_sampler.apply_top_k_top_p``, the same as transformers'
    ``TopKLogitsWarper`` then ``TopPLogitsWarper``): top-k keeps every token whose logit is >= the k-th largest (ties
    kept); top-p sorts the survivors ascending and drops those whose cumulative probability is <= 1 - p, always
    keeping the most likely one. vLLM's ``processed_logprobs`` are log-probs under exactly this distribution, so
    the engine importance weight ``exp(this - engine logp)`` is 1 on policy whatever ``top_k``/``top_p`` are (with
    the full-vocabulary log-prob on the trainer side it would be the kept probability mass instead: issue 30; TRL
    #6789). The sampled token is always in the support: where the trainer's rounding puts it just outside the
    engine's truncation boundary, the kept set is the trainer's plus that token, so the weight stays finite and
    close to 1 instead of 0.

    Args:
        logits: (M, V) logits already divided by the temperature (fp32 or not; not modified). tokens: (M,) the
            sampled ids. top_k: 0 = off. top_p: 1 = off. chunk: rows per (chunk, V) temporary.

    Returns:
        (M,) fp32 log-probs, detached; equal to ``log_softmax(logits)[tokens]`` when neither truncation is on.
    """
    logits = logits.detach()
    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    vocab = logits.shape[-1] if logits.dim() == 2 else 0
    for start in range(0, logits.shape[0], chunk):
        x = logits[start:start + chunk].float()
        t = tokens[start:start + chunk].unsqueeze(1)
        keep = torch.ones_like(x, dtype=torch.bool)
        if 0 < top_k < vocab:
            keep &= x >= x.topk(top_k, dim=-1).values[:, -1:]
        if top_p < 1.0:
            masked = x.masked_fill(~keep, -torch.inf)
            ordered, idx = masked.sort(dim=-1, descending=False)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            drop = cumulative <= 1.0 - top_p
            drop[:, -1] = False
            keep &= ~torch.zeros_like(drop).scatter(1, idx, drop)
        keep.scatter_(1, t, True)
        support = x.masked_fill(~keep, -torch.inf)
        out[start:start + chunk] = x.gather(1, t).squeeze(1) - torch.logsumexp(support, dim=-1)
    return out


def truncated_is_weights(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> torch.Tensor:
    """Truncated importance-sampling weights of tokens sampled by a rollout engine (Yao et al. 2025, "Your efficient
    RL framework secretly brings you off-policy RL training"; TRL's ``vllm_importance_sampling_correction`` with
    token-level truncation): ``w_t = min(pi_trainer(y_t) / pi_engine(y_t), cap)``, which corrects the policy
    gradient for the numerical mismatch between the engine that sampled and the trainer that computes the loss.

    Both log-probs must be under the same distribution: the engine's sampling distribution (temperature, top-k,
    top-p), i.e. the trainer's side from :func:`sampling_logps` when sampling is truncated.

    Args:
        trainer_logps: (B, N) log-probs of the sampled tokens under the trainer's policy at sampling time.
        engine_logps: (B, N) the engine's log-probs of the same tokens (its sampling distribution); NaN where the
            engine's value was not finite (:func:`llmtune.rl.engines.vllm_engine.check_completions`).
        mask: (B, N) 1 on real response tokens. cap: C >= 1.

    Returns:
        (B, N) fp32 weights, detached, 0 on padding and where ``engine_logps`` is not finite (the ratio is unknown:
        the token leaves the policy-gradient term; it is counted by :func:`engine_mismatch_stats`).
    """
    finite = torch.isfinite(engine_logps)
    delta = torch.where(finite, trainer_logps.detach().float() - engine_logps.float(), torch.zeros_like(mask.float()))
    ratio = torch.exp(delta * mask)
    return ratio.clamp(max=cap) * mask * finite


def engine_mismatch_stats(trainer_logps: torch.Tensor, engine_logps: torch.Tensor, mask: torch.Tensor,
                          cap: float) -> torch.Tensor:
    """Sums of the engine/trainer log-prob mismatch over the real tokens of one rank, to be summed (max for
    element 1) over ranks and turned into metrics by :func:`engine_mismatch_metrics`.

    Args:
        trainer_logps, engine_logps, mask: (B, N) as in :func:`truncated_is_weights`. cap: C.

    Returns:
        (6,) fp32: ``[sum |delta|, max |delta|, tokens, sum of min(ratio, C), tokens with ratio > C, tokens whose
        engine log-prob is not finite]`` with ``delta = trainer_logp - engine_logp`` (nats) and ``ratio =
        exp(delta)``; the first five over the tokens with a finite engine log-prob.
    """
    real = mask.bool()
    finite = torch.isfinite(engine_logps)
    nonfinite = float((real & ~finite).sum())
    m = real & finite
    delta = (trainer_logps.detach().float() - engine_logps.float())[m]
    ratio = torch.exp(delta)
    if delta.numel() == 0:
        return torch.tensor([0.0] * 5 + [nonfinite], device=mask.device)
    return torch.stack([delta.abs().sum(), delta.abs().max(), torch.tensor(float(delta.numel()), device=delta.device),
                        ratio.clamp(max=cap).sum(), (ratio > cap).float().sum(),
                        torch.tensor(nonfinite, device=delta.device)])


def engine_mismatch_metrics(stats: torch.Tensor) -> dict[str, float]:
    """Metrics of :func:`engine_mismatch_stats` rows of all ranks, (R, 6).

    Returns:
        ``rollout/logprob_diff_mean`` and ``rollout/logprob_diff_max`` (|trainer - engine| log-prob of the sampled
        tokens under the engine's sampling distribution, nats, mean and max over the real tokens), ``rollout/
        is_weight_mean`` (mean truncated weight), ``rollout/is_clipped_fraction`` (share of tokens whose ratio exceeded
        the cap) and, when any, ``rollout/engine_logp_nonfinite_fraction`` (share of real tokens whose engine
        log-prob was not finite: weight 0).
    """
    stats = stats.reshape(-1, 6).float()
    tokens = float(stats[:, 2].sum())
    nonfinite = float(stats[:, 5].sum())
    per = max(tokens, 1.0)
    metrics = {"rollout/logprob_diff_mean": float(stats[:, 0].sum()) / per,
               "rollout/logprob_diff_max": float(stats[:, 1].max()) if tokens else 0.0,
               "rollout/is_weight_mean": float(stats[:, 3].sum()) / per if tokens else 1.0,
               "rollout/is_clipped_fraction": float(stats[:, 4].sum()) / per}
    if nonfinite:
        metrics["rollout/engine_logp_nonfinite_fraction"] = nonfinite / (tokens + nonfinite)
    return metrics
