"""PPO (RLHF) of a policy adapter against a reward model or a reward function, on the shared core.

Actor-critic PPO for language models (Schulman et al. 2017; the RLHF recipe of Ouyang et al. 2022; GAE of Schulman
et al. 2016): sample responses to prompts, score them, reward = score at the last token - kl_coef * KL(policy ||
reference) at every token, GAE advantages, clipped policy and value losses over several epochs per rollout batch.
The policy, the reference (adapters disabled) and the value model (its own adapter + head) share one base.

Units: ``count_items`` = real response tokens; the loss of an optimizer step is the token sum over its micro-batches
divided by the response tokens of the whole step on all ranks.
"""

from __future__ import annotations

import torch

from llmtune.core.stage import HIGHER, HeldOutMetric
from llmtune.rl.ops import masked_mean
from llmtune.rl.stage import OnlineRLStage
from llmtune.stages.ppo import ops
from llmtune.stages.ppo.trainer import PPOTrainer


class PPOStage(OnlineRLStage):
    """``llmtune ppo``: the stage hooks; the rollout loop is :class:`PPOTrainer`."""

    name = "ppo"
    item_unit = "tokens"
    trainer_class = PPOTrainer
    held_out_metrics = (HeldOutMetric("eval_score", HIGHER), HeldOutMetric("eval_kl", None),
                        HeldOutMetric("eval_truncated_fraction", None))
    plot_metrics = ("score_mean", "kl", "response_length", "clipfrac", "value_loss")

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return batch["loss_mask"].sum()  # the tokens the policy sampled (multi-turn: not the tool results)

    def loss(self, model, batch, num_items):
        """Clipped policy loss + ``vf_coef`` x clipped value loss, token sums / ``num_items``.

        Args:
            batch: a micro-batch of ``PPO.experience`` (:mod:`llmtune.stages.ppo.trainer`):
                ``input_ids``/``attention_mask``/``position_ids`` (b, P + n), ``responses``/``response_mask``/
                ``loss_mask`` (the one mask of the rewards)/``old_logps``/``old_values``/``advantages``/``returns``
                (b, n), optional ``is_weights`` (b, n) (the rollout engine's truncated importance weights).
            num_items: response tokens of the whole optimizer step (all micro-batches, all ranks).
        """
        cfg = self.recipe.ppo
        mask = batch["loss_mask"].float()
        # the LM head at the real response tokens only (no (b, n, V) fp32 logits): the values and gradients of
        # response_token_logps over the full logits up to fp32 rounding (tests/unit/stages/test_ppo_rollout.py)
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], responses=batch["responses"],
                    response_mask=batch["response_mask"], temperature=self.recipe.rollout.temperature,
                    with_entropy=True, score_mask=batch["loss_mask"])
        logps, values, entropy = out.logps, out.values, out.entropy
        pg = ops.policy_loss(logps, batch["old_logps"], batch["advantages"], mask, cfg.cliprange,
                             batch.get("is_weights"))
        vf_sum, vf_clipped = ops.value_loss(values, batch["old_values"], batch["returns"], mask, cfg.cliprange_value)
        loss = (pg.loss_sum + cfg.vf_coef * vf_sum) / num_items
        tokens = mask.sum().clamp(min=1)
        entropy = masked_mean(entropy, mask)
        metrics = {
            "policy_loss": float(pg.loss_sum.detach() / tokens), "value_loss": float(vf_sum.detach() / tokens),
            "clipfrac": float(pg.clipped / tokens), "vf_clipfrac": float(vf_clipped / tokens),
            "approx_kl": float(pg.approx_kl_sum / tokens), "policy_entropy": float(entropy),
        }
        return loss, metrics


__all__ = ["PPOStage", "PPOTrainer", "ops"]
