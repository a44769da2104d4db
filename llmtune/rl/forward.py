"""The rollout forwards of online RL: the policy's, the reference's and the value model's numbers at the completion
tokens of a rollout batch, computed once at sampling time in eval mode (old log-probs, reference log-probs, values,
entropy, the trainer's side of the engine importance ratio, the exact KL of an evaluation).

Memory: the forwards run in chunks of at most ``chunk_rows`` rows. Without ``exact_kl`` the LM head runs at the real
completion tokens only (:meth:`~llmtune.rl.model.PolicyModel.response_logps`: no (rows, N, V) logits at all); the
exact KL needs the full distributions, so that path computes (rows, N, V) logits in chunks of at most
``LOGITS_CHUNK_BYTES`` of fp32 logits per model and takes its per-token statistics one row at a time (:func:`_per_row`).

Shapes: B = trajectories, P + N = prompt + completion columns (:meth:`llmtune.rl.types.RolloutBatch.model_inputs`),
N = completion columns, V = vocabulary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from llmtune.rl import ops

LOGITS_CHUNK_BYTES = 256 * 2**20  # fp32 logits per forward of the exact-KL path (rows cut to fit; at least one row)


@dataclass
class RolloutForward:
    """What :func:`rollout_forward` computed, each (B, N) fp32 (exactly 0 on padding unless said), None when not asked.

    Attributes:
        logps: the policy's log-probs of the completion tokens under ``softmax(logits / temperature)``.
        entropy: that distribution's entropy (nats).
        sampling_logps: the policy's log-probs under the engine's truncated sampling distribution
            (:func:`llmtune.rl.ops.sampling_logps`), for the engine importance weights.
        ref_logps: the reference's (adapters disabled) log-probs.
        values: the value model's values of the state before each completion token (PPO).
        kl_exact: KL(policy || reference) summed over the vocabulary at each position (evaluation; padding holds
            garbage: multiply by the mask).
    """

    logps: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    sampling_logps: torch.Tensor | None = None
    ref_logps: torch.Tensor | None = None
    values: torch.Tensor | None = None
    kl_exact: torch.Tensor | None = None


def _per_row(fn, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` applied to each row (a (1, ...) slice) of the tensors, concatenated: (B, N) statistics of (B, N, V)
    logits with (1, N, V) temporaries instead of (B, N, V) ones."""
    return torch.cat([fn(*(t[i:i + 1] for t in tensors)) for i in range(tensors[0].shape[0])])


def _exact_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """(b, N, V) policy and reference logits -> (b, N) KL(policy || reference) per position, fp32."""
    logp = torch.log_softmax(logits.float(), -1)
    return (logp.exp() * (logp - torch.log_softmax(ref_logits.float(), -1))).sum(-1)


def response_token_logps(logits: torch.Tensor, responses: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs (fp32) of the completion tokens under ``logits / temperature`` (the distribution they were sampled
    from; TRL's PPO trainer does the same).

    Args:
        logits: (B, N, V), row t = the prediction of completion token t. responses: (B, N).

    Returns:
        (B, N) fp32 (padding positions hold garbage: multiply by the mask).
    """
    logits = logits.float() / temperature
    picked = torch.gather(logits, -1, responses.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


@torch.no_grad()
def rollout_forward(model: torch.nn.Module, inputs: dict[str, torch.Tensor], responses: torch.Tensor, *,
                    temperature: float, chunk_rows: int, policy: bool = True, reference: bool = False,
                    values: bool = False, exact_kl: bool = False, truncation: tuple[int, float] | None = None,
                    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
                    score_mask: torch.Tensor | None = None) -> RolloutForward:
    """The policy's (and the reference's, the value model's) numbers at the completion tokens, in eval mode.

    Args:
        model: a :class:`~llmtune.rl.model.PolicyModel` (or :class:`~llmtune.stages.ppo.trainer.PolicyValueModel`).
        inputs: (B, P + N) model inputs (``input_ids``/``attention_mask``/``position_ids``; the last N attention
            columns are the completion mask). responses: (B, N) completion ids.
        temperature: the sampling temperature (the logits are divided by it).
        chunk_rows: rows per forward (the eval batch size).
        policy / reference / values: which numbers to compute. exact_kl: also ``kl_exact`` (the policy's and the
            reference's full distributions; the evaluation). truncation: ``(top_k, top_p)`` of the engine: also
            ``sampling_logps`` (masked LM head path only).
        autocast: the trainer's mixed-precision context (``compute_loss_context_manager``).
        score_mask: (B, N) the completion positions whose log-probs are wanted (the tokens the policy sampled; a
            multi-turn rollout's tool results are context only); default every real completion token.

    Raises:
        ValueError: ``truncation`` with ``exact_kl`` (the truncated log-probs come from the masked LM head).
    """
    was_training = model.training
    model.eval()
    try:
        if exact_kl:
            if truncation is not None:
                raise ValueError("rollout_forward: the engine's truncated sampling log-probs come from the masked LM "
                                 "head only (not with exact_kl)")
            return _full_logits(model, inputs, responses, temperature, chunk_rows, reference, values, autocast)
        return _masked_head(model, inputs, responses, temperature, chunk_rows, policy, reference, values, truncation,
                            autocast, score_mask)
    finally:
        model.train(was_training)


def _masked_head(model, inputs, responses, temperature, chunk_rows, policy, reference, with_values, truncation,
                 autocast, score_mask=None) -> RolloutForward:
    width = responses.shape[1]
    size = max(1, chunk_rows)
    out: dict[str, list[torch.Tensor]] = {}
    for start in range(0, responses.shape[0], size):
        part = {k: v[start:start + size] for k, v in inputs.items()}
        resp = responses[start:start + size]
        resp_mask = part["attention_mask"][:, -width:]
        scored = None if score_mask is None else score_mask[start:start + size]
        for name, ref in ((("logps", False),) if policy else ()) + ((("ref_logps", True),) if reference else ()):
            with autocast():
                got = model.response_logps(**part, responses=resp, response_mask=resp_mask, temperature=temperature,
                                           reference=ref, with_entropy=not ref,
                                           truncation=None if ref else truncation, score_mask=scored)
            out.setdefault(name, []).append(got.logps)
            if got.entropy is not None:
                out.setdefault("entropy", []).append(got.entropy)
            if got.sampling_logps is not None:
                out.setdefault("sampling_logps", []).append(got.sampling_logps)
        if with_values:
            with autocast():
                out.setdefault("values", []).append(model.values(**part, response_width=width))
    return RolloutForward(**{k: torch.cat(v) for k, v in out.items()})


def _full_logits(model, inputs, responses, temperature, chunk_rows, reference, with_values, autocast
                 ) -> RolloutForward:
    """The exact-KL path: (rows, N, V) logits of the policy and the reference per chunk (Same values as whole-chunk
    arithmetic: the reductions are row-wise)."""
    width = responses.shape[1]
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    size = max(1, min(chunk_rows, LOGITS_CHUNK_BYTES // max(1, (width + 1) * vocab * 4) if vocab
                      else responses.shape[0]))
    out: dict[str, list[torch.Tensor]] = {}
    for start in range(0, responses.shape[0], size):
        part = {k: v[start:start + size] for k, v in inputs.items()}
        resp = responses[start:start + size]
        with autocast():
            logits = model.policy_logits(**part, response_width=width)
            if with_values:
                out.setdefault("values", []).append(model.values(**part, response_width=width))
        out.setdefault("logps", []).append(_per_row(
            lambda lg, r: response_token_logps(lg, r, temperature), logits, resp))
        out.setdefault("entropy", []).append(_per_row(
            lambda lg: ops.entropy_from_logits(lg.float() / temperature), logits))
        if reference:
            with autocast():
                ref_logits = model.reference_logits(**part, response_width=width)
            out.setdefault("ref_logps", []).append(_per_row(
                lambda lg, r: response_token_logps(lg, r, temperature), ref_logits, resp))
            out.setdefault("kl_exact", []).append(_per_row(_exact_kl, logits, ref_logits))
            del ref_logits
        del logits
    return RolloutForward(**{k: torch.cat(v) for k, v in out.items()})
