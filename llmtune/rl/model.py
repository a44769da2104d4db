"""The policy of online RL as one module: the peft policy's logits at the response positions, and the reference
(the same base with every adapter disabled: no second model in memory); or, without (B, N, V) logits, the
log-probs of the response tokens alone (:meth:`PolicyModel.response_logps`)."""

from __future__ import annotations

import torch
from torch import nn

from llmtune.models.adapters import adapter_scope

POLICY = "default"


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
            input_ids, attention_mask, position_ids: (B, P + N) prompt + response (see ``rollout.join``).
            response_width: N.
        """
        with adapter_scope(self.policy, POLICY):
            return self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False, logits_to_keep=response_width + 1).logits[:, :-1]

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                response_width: int, with_values: bool = False, responses: torch.Tensor | None = None,
                response_mask: torch.Tensor | None = None, temperature: float = 1.0, with_entropy: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits, None)``: (B, N, V) policy logits (see :meth:`policy_logits`); no value model here. With
        ``responses`` and ``response_mask``: ``(logps, entropy)`` of :meth:`response_logps` instead (through
        ``forward``, so that DDP/DeepSpeed see the forward)."""
        if responses is not None:
            return self.response_logps(input_ids, attention_mask, position_ids, responses, response_mask,
                                       temperature, with_entropy=with_entropy)
        return self.policy_logits(input_ids, attention_mask, position_ids, response_width), None

    def response_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                       responses: torch.Tensor, response_mask: torch.Tensor, temperature: float = 1.0,
                       reference: bool = False, with_entropy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of the real response tokens under ``softmax(logits / temperature)`` of the policy (or the
        reference), with the LM head applied at the positions that predict them only and no (B, N, V) fp32 logits
        (:mod:`llmtune.core.lm_head`: the masked head and :class:`~llmtune.core.lm_head.TokenLogps`, one (M, V)
        buffer). The same values and gradients as :func:`llmtune.rl.rollout.response_token_logps` of
        :meth:`policy_logits` up to fp32 rounding (tests/unit/rl/test_response_logps.py), without the padding
        positions and the (B, N, V) temporaries of the upcast, the division, the log-softmax and the entropy.

        Args:
            input_ids, attention_mask, position_ids: (B, P + N) prompt + response (``rollout.join``).
            responses: (B, N) sampled ids. response_mask: (B, N), 1 on the real response tokens.
            temperature: the sampling temperature (the logits are divided by it). reference: adapters disabled.
            with_entropy: also return the (B, N) entropy of that distribution (detached, nats).

        Returns:
            ``(logps, entropy)``: (B, N) fp32 (differentiable; exactly 0 where ``response_mask`` is 0) and (B, N)
            fp32 entropy (0 there too) or None.
        """
        from llmtune.core.lm_head import TokenLogps, masked_logits

        width = responses.shape[1]
        real = response_mask.bool()
        keep = torch.zeros_like(input_ids, dtype=torch.bool)
        keep[:, input_ids.shape[1] - width - 1:input_ids.shape[1] - 1] = real  # position P - 1 + t predicts token t
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        with adapter_scope(self.policy, None if reference else POLICY):
            logits = masked_logits(self.policy, batch, keep)  # (M, V), row-major = the order of responses[real]
        if temperature != 1.0 or logits.dtype != torch.float32:
            logits = logits.float() / temperature
        entropy = None
        if with_entropy:
            entropy = torch.zeros(real.shape, dtype=torch.float32, device=real.device)
            entropy = entropy.masked_scatter(real, chunked_entropy(logits.detach()))
        flat = TokenLogps.apply(logits, responses[real])  # turns the logits into its softmax in place
        logps = torch.zeros(real.shape, dtype=torch.float32, device=real.device).masked_scatter(real, flat)
        return logps, entropy

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
