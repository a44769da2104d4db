"""SimPO: simple preference optimization (Meng et al. 2024) on preference pairs, with no reference model.

The implicit reward of a completion is ``beta`` x its token-mean log-prob (length-normalised, so long answers are
not favoured), and the loss asks the chosen reward to beat the rejected one by a target margin ``gamma``. One
policy forward per pair batch; loss of an optimizer step = sum of per-pair losses / pairs in the whole step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmtune.stages.reference_free import ReferenceFreeStage


def simpo_loss(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
    beta: float,
    gamma: float,
    length_normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Per-pair SimPO losses (Meng et al. 2024, Eq. 6; no reduction).

    ``r = beta * logps / tokens`` (``beta * logps`` without ``length_normalize``) and
    ``loss = -log sigmoid(r_chosen - r_rejected - gamma)``. With ``gamma = 0`` and no length normalisation this is
    the DPO sigmoid loss with reference log-probs 0.

    Args:
        chosen_logps, rejected_logps: (B,) log-probs summed over completion tokens.
        chosen_tokens, rejected_tokens: (B,) completion token counts (>= 1).
        beta: reward scale (> 0). gamma: target margin in reward units (>= 0).
        length_normalize: divide by the token counts (SimPO); False = summed log-probs.

    Returns:
        ``(losses, chosen_rewards, rejected_rewards, extra)``: (B,) fp32; rewards detached; ``extra`` is empty.
    """
    chosen, rejected = chosen_logps.float(), rejected_logps.float()
    if length_normalize:
        chosen, rejected = chosen / chosen_tokens.float(), rejected / rejected_tokens.float()
    chosen_rewards, rejected_rewards = beta * chosen, beta * rejected
    losses = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma)
    return losses, chosen_rewards.detach(), rejected_rewards.detach(), {}


class SimPOStage(ReferenceFreeStage):
    """SimPO on preference pairs; batches are (2B, T): chosen rows then rejected rows; no reference forward."""

    name = "simpo"

    def pair_losses(self, chosen_logps, rejected_logps, chosen_tokens, rejected_tokens):
        cfg = self.recipe.simpo
        return simpo_loss(chosen_logps, rejected_logps, chosen_tokens, rejected_tokens, cfg.beta, cfg.gamma,
                          cfg.length_normalize)
