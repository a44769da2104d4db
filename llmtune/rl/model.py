"""The policy of online RL as one module: the peft policy's logits at the response positions, and the reference
(the same base with every adapter disabled: no second model in memory); or, without (B, N, V) logits, the
log-probs of the response tokens alone (:meth:`PolicyModel.response_logps`)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from llmtune.models.adapters import adapter_scope

POLICY = "default"


class PolicyOutput(NamedTuple):
    """What the policy models' ``forward`` and :meth:`PolicyModel.response_logps` return (one shape for all), each
    (B, N) fp32, exactly 0 where ``response_mask`` is 0.

    Attributes:
        logps: log-probs of the response tokens under ``softmax(logits / temperature)`` (differentiable).
        entropy: that distribution's entropy (detached, nats), or None when not asked for.
        sampling_logps: log-probs under the distribution a rollout engine samples from (``top_k``/``top_p``
            truncation, renormalised; :func:`llmtune.rl.ops.sampling_logps`; detached), or None when not asked for.
        values: the value model's values of the state before each response token (PPO's
            :class:`~llmtune.stages.ppo.trainer.PolicyValueModel`), or None.
    """

    logps: torch.Tensor
    entropy: torch.Tensor | None = None
    sampling_logps: torch.Tensor | None = None
    values: torch.Tensor | None = None


class PolicyModel(nn.Module):
    """The policy (peft adapter ``default``) and its reference (adapters disabled) on one base.

    Args:
        policy: a ``peft.PeftModel`` (causal LM).
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy
        self.config = policy.config

    # trl's unwrap_model_for_generation switches checkpointing off and back on with default kwargs, which would
    # drop our adapter-aware recompute context; generation runs in eval mode, where nothing is checkpointed anyway.
    is_gradient_checkpointing = False

    def policy_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      response_width: int) -> torch.Tensor:
        """(B, N, V) logits of the policy adapter; position t predicts response token t.

        Args:
            input_ids, attention_mask, position_ids: (B, P + N) prompt + response (``RolloutBatch.model_inputs``).
            response_width: N.
        """
        with adapter_scope(self.policy, POLICY):
            return self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False, logits_to_keep=response_width + 1).logits[:, :-1]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                responses: torch.Tensor, response_mask: torch.Tensor, temperature: float = 1.0,
                with_entropy: bool = False, score_mask: torch.Tensor | None = None) -> PolicyOutput:
        """:meth:`response_logps` of the policy, through ``forward`` so that DDP/DeepSpeed see the forward (the
        losses call the model; the rollout forwards and the evaluation call the methods)."""
        return self.response_logps(input_ids, attention_mask, position_ids, responses, response_mask, temperature,
                                   with_entropy=with_entropy, score_mask=score_mask)

    def response_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                       responses: torch.Tensor, response_mask: torch.Tensor, temperature: float = 1.0,
                       reference: bool = False, with_entropy: bool = False,
                       truncation: tuple[int, float] | None = None, score_mask: torch.Tensor | None = None
                       ) -> PolicyOutput:
        """Log-probs of the real response tokens under ``softmax(logits / temperature)`` of the policy (or the
        reference), with the LM head applied at the positions that predict them only and no (B, N, V) fp32 logits
        (:mod:`llmtune.core.lm_head`: the masked head and :class:`~llmtune.core.lm_head.TokenLogps`, one (M, V)
        buffer); rows that share a prompt (GRPO's groups) compute it once (:func:`shared_prompt_batch`). The same
        values and gradients as :func:`llmtune.rl.forward.response_token_logps` of
        :meth:`policy_logits` up to fp32 rounding (tests/unit/rl/test_response_logps.py), without the padding
        positions and the (B, N, V) temporaries of the upcast, the division, the log-softmax and the entropy.

        Args:
            input_ids, attention_mask, position_ids: (B, P + N) prompt + response (``RolloutBatch.model_inputs``).
            responses: (B, N) sampled ids. response_mask: (B, N), 1 on the real response tokens.
            temperature: the sampling temperature (the logits are divided by it). reference: adapters disabled.
            with_entropy: also return the (B, N) entropy of that distribution (detached, nats).
            truncation: ``(top_k, top_p)`` of the rollout engine: also return the log-probs under that truncated
                sampling distribution (``sampling_logps``, for the engine importance weights); None = not needed.
            score_mask: (B, N) the positions whose log-probs are wanted, a subset of ``response_mask`` (multi-turn
                rollouts: the tokens the policy sampled, not the tool results between them, which stay context);
                the LM head runs there only. None = every real response token.

        Returns:
            :class:`PolicyOutput` (``logps`` differentiable, exactly 0 where ``response_mask`` is 0; ``entropy`` and
            ``sampling_logps`` when asked, else None; ``values`` None).
        """
        from llmtune.core.lm_head import TokenLogps, masked_logits

        width = responses.shape[1]
        real = (response_mask if score_mask is None else score_mask * response_mask).bool()  # positions scored
        keep = torch.zeros_like(input_ids, dtype=torch.bool)
        keep[:, input_ids.shape[1] - width - 1:input_ids.shape[1] - 1] = real  # position P - 1 + t predicts token t
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        shared = shared_prompt_batch(self.policy, input_ids, attention_mask, responses, response_mask, real)
        with adapter_scope(self.policy, None if reference else POLICY):
            if shared is None:
                logits = masked_logits(self.policy, batch, keep)  # (M, V), row-major = the order of responses[real]
            else:  # each distinct prompt once, its completions after it: (M', V) -> (M, V) in the same order
                logits = masked_logits(self.policy, shared, shared["keep"])[shared["gather"]]
        if temperature != 1.0 or logits.dtype != torch.float32:
            logits = logits.float() / temperature
        entropy = sampling = None
        if with_entropy:
            entropy = torch.zeros(real.shape, dtype=torch.float32, device=real.device)
            entropy = entropy.masked_scatter(real, chunked_entropy(logits.detach()))
        if truncation is not None:  # before TokenLogps, which turns the logits into their softmax in place
            from llmtune.rl.ops import sampling_logps

            sampling = torch.zeros(real.shape, dtype=torch.float32, device=real.device).masked_scatter(
                real, sampling_logps(logits, responses[real], *truncation))
        flat = TokenLogps.apply(logits, responses[real])  # turns the logits into its softmax in place
        logps = torch.zeros(real.shape, dtype=torch.float32, device=real.device).masked_scatter(real, flat)
        return PolicyOutput(logps, entropy, sampling)

    def reference_logits(self, input_ids, attention_mask, position_ids, response_width: int) -> torch.Tensor:
        """(B, N, V) logits of the reference = the base with every adapter disabled."""
        with adapter_scope(self.policy, None):
            return self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False, logits_to_keep=response_width + 1).logits[:, :-1]


@torch.no_grad()
def chunked_entropy(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """(M, V) logits -> (M,) entropy in nats, fp32, ``chunk`` rows at a time (no (M, V) temporaries)."""
    from llmtune.rl.ops import entropy_from_logits

    if logits.shape[0] == 0:
        return logits.new_zeros(0, dtype=torch.float32)
    return torch.cat([entropy_from_logits(logits[i:i + chunk]) for i in range(0, logits.shape[0], chunk)])



def shared_prompt_batch(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        responses: torch.Tensor, response_mask: torch.Tensor, score_mask: torch.Tensor | None = None
                        ) -> dict[str, torch.Tensor] | None:
    """Rewrite (B, P + N) rollout rows as one row per DISTINCT prompt: ``prompt + completion_1 + ... + completion_k``
    (the real tokens of each) with :func:`llmtune.core.lm_head.pack_shared_prompts`: every response token sees
    exactly the keys, queries and positions of its own row, the same log-probs up to float rounding, for (G - 1) x p
    fewer tokens per group of G completions of a p-token prompt.

    Args:
        model: the causal LM (its attention implementation decides the mask's form).
        input_ids, attention_mask: (B, P + N) from ``rollout.join`` (prompts left-padded, responses right-padded).
        responses, response_mask: (B, N); a response's real tokens are its first ``response_mask.sum()`` ones (all
            of them are in the packed row: a multi-turn completion's tool results are context for what follows).
        score_mask: (B, N) bool, the positions whose logits are kept (default ``response_mask``).

    Returns:
        ``input_ids``/``position_ids`` (K, S), ``attention_mask`` (K, 1, S, S) (bool for SDPA, True = attend; else
        additive), ``keep`` (K, S) bool positions whose logits are needed, ``gather`` (M,) the row among the kept
        logits that predicts each scored response token, in the row-major order of ``responses[score_mask]``.
        None when no prompt repeats, the attention kernel takes no 4-D mask or a sliding window is shorter than the
        rows (:func:`llmtune.core.lm_head.shares_prompts`; then use the rows as they are).
    """
    from llmtune.core.lm_head import causal_lm, kept_positions, pack_shared_prompts, shares_prompts

    lm = causal_lm(model)
    attention = getattr(lm.config, "_attn_implementation", None)
    width, prompt_width = responses.shape[1], input_ids.shape[1] - responses.shape[1]
    if not shares_prompts(lm, int(attention_mask.sum(-1).max())) or input_ids.shape[0] < 2 or prompt_width < 1:
        return None
    prompts = torch.cat([input_ids[:, :prompt_width], attention_mask[:, :prompt_width].to(input_ids.dtype)], 1)
    unique, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    if unique.shape[0] == input_ids.shape[0]:
        return None
    lengths = response_mask.sum(1).tolist()
    groups, members = [], []
    for k in range(unique.shape[0]):
        rows = (inverse == k).nonzero().flatten().tolist()
        prompt = input_ids[rows[0], :prompt_width][attention_mask[rows[0], :prompt_width].bool()]
        if prompt.numel() == 0:
            return None
        groups.append((prompt, [responses[b, :int(lengths[b])] for b in rows]))
        members.append(rows)
    packed, predictors = pack_shared_prompts(groups, torch.bool if attention == "sdpa" else lm.dtype)
    predictor = torch.full((input_ids.shape[0], width), -1, dtype=torch.long, device=input_ids.device)
    for rows, group in zip(members, predictors):
        for b, before in zip(rows, group):
            predictor[b, :before.numel()] = before
    K, S = packed["input_ids"].shape
    scored = response_mask.bool() if score_mask is None else score_mask.bool()
    keep, gather = kept_positions(predictor[scored], K * S)
    return {**packed, "keep": keep.view(K, S), "gather": gather}
