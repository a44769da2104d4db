"""GRPO (and its DAPO / Dr. GRPO variants) of a policy adapter against reward functions and/or a reward model.

Group-relative policy optimization (Shao et al. 2024): sample ``num_generations`` completions per prompt, score
them, advantage = (reward - group mean) / group std (``scale_rewards``: Dr. GRPO, Liu et al. 2025, drops the std),
clipped importance-ratio loss against the sampling policy with ``epsilon_low``/``epsilon_high`` (DAPO clip-higher,
Yu et al. 2025), or at the sequence level (GSPO, Zheng et al. 2025: ``importance_sampling_level: sequence`` with
``sequence_epsilon_low``/``sequence_epsilon_high``), an optional k3 KL term to the reference (``beta``; the
reference is the policy with its adapter disabled), aggregated as ``loss_aggregation`` says. Baselines:
``advantage_estimator`` grpo (group mean/std), rloo (leave-one-out, Ahmadian et al. 2024), reinforce_plus_plus
(global batch normalisation, Hu 2025). No value model. The rollout loop is :class:`GRPOTrainer`.

Units: ``count_items`` = completion tokens in the loss (``token_mean``) or completions in the loss (otherwise); the
loss of an optimizer step is the sum over its micro-batches divided by that count of the whole step on all ranks.
"""

from __future__ import annotations

import torch

from llmtune.core.stage import HIGHER, HeldOutMetric
from llmtune.rl.ops import masked_mean
from llmtune.rl.stage import OnlineRLStage
from llmtune.stages.grpo import ops
from llmtune.stages.grpo.trainer import GRPOTrainer


class GRPOStage(OnlineRLStage):
    """``llmtune grpo``: the stage hooks; the rollout loop is :class:`GRPOTrainer`."""

    name = "grpo"
    item_unit = "items"
    trainer_class = GRPOTrainer
    held_out_metrics = (HeldOutMetric("eval_reward", HIGHER), HeldOutMetric("eval_kl", None),
                        HeldOutMetric("eval_truncated_fraction", None))
    plot_metrics = ("reward_mean", "kl", "completion_length", ("clip_fraction_low", "clip_fraction_high"),
                    "truncated_fraction")

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return ops.count_items(batch["loss_mask"], self.recipe.grpo.loss_aggregation)

    def loss(self, model, batch, num_items):
        """GRPO's clipped loss (:func:`ops.grpo_loss`) of a micro-batch / the step's ``num_items``.

        Args:
            batch: a micro-batch of ``GRPO.experience`` (:mod:`llmtune.stages.grpo.trainer`):
                ``input_ids``/``attention_mask``/``position_ids`` (b, P + n), ``responses``/``response_mask``/
                ``loss_mask`` (b, n; the one mask of the rewards: sampled tokens of the rows that train),
                ``advantages`` (b,), optional ``old_logps``/``ref_logps`` (b, n), optional ``is_weights`` (b, n) (truncated
                importance weights of the sampling engine, put there by the trainer).
            num_items: completion tokens or completions of the whole optimizer step (all micro-batches, ranks).
        """
        cfg = self.recipe.grpo
        mask = batch["loss_mask"].float()
        # LM head at the trained tokens only (the policy's sampled tokens of kept rows; no tool results), no
        # (b, n, V) fp32 logits (PolicyModel.response_logps)
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], responses=batch["responses"],
                    response_mask=batch["response_mask"], temperature=self.recipe.rollout.temperature,
                    with_entropy=True, score_mask=batch["loss_mask"])
        logps, entropy = out.logps, out.entropy
        sequence = cfg.importance_sampling_level == "sequence"
        low, high = ((cfg.sequence_epsilon_low, cfg.sequence_epsilon_high) if sequence
                     else (cfg.epsilon_low, cfg.epsilon_high))
        out = ops.grpo_loss(logps, batch.get("old_logps"), batch["advantages"], mask, low, high,
                            cfg.loss_aggregation, self.recipe.rollout.max_new_tokens, cfg.beta, batch.get("ref_logps"),
                            cfg.kl_estimator, cfg.importance_sampling_level, batch.get("is_weights"))
        tokens = mask.sum().clamp(min=1)
        entropy = masked_mean(entropy, mask)  # over the trained tokens (multi-turn: never a tool result's)
        local = ops.count_items(mask, cfg.loss_aggregation).clamp(min=1)  # this micro-batch's share of num_items
        metrics = {"policy_loss": float(out.loss_sum.detach() / local), "entropy": float(entropy),
                   "clip_fraction_low": float(out.clipped_low / tokens),
                   "clip_fraction_high": float(out.clipped_high / tokens)}
        if "ref_logps" in batch:
            metrics["kl"] = float(out.kl_sum / tokens)
        return out.loss_sum / num_items, metrics


__all__ = ["GRPOStage", "GRPOTrainer", "ops"]
