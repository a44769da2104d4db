"""The policy of online RL as one module: the peft policy's logits at the response positions, and the reference
(the same base with every adapter disabled: no second model in memory)."""

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
                response_width: int, with_values: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logits, None)``: (B, N, V) policy logits (see :meth:`policy_logits`); no value model here."""
        return self.policy_logits(input_ids, attention_mask, position_ids, response_width), None

    def reference_logits(self, input_ids, attention_mask, position_ids, response_width: int) -> torch.Tensor:
        """(B, N, V) logits of the reference = the base with every adapter disabled."""
        with adapter_scope(self.policy, None):
            return self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False, logits_to_keep=response_width + 1).logits[:, :-1]
