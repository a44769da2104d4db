"""One iteration of online RL, top to bottom: sync -> sample -> score -> experience -> train.

:func:`run_iteration` is the whole loop body (nanochat's ``scripts/chat_rl.py`` in one screen); the pieces it calls
each have one home:

- **sync + sample**: :class:`llmtune.rl.rollouts.Rollouts` (the engine, the agent loop, the background sampler, the
  staleness bound) gives a :class:`~llmtune.rl.types.RolloutBatch`;
- **score**: :class:`llmtune.rewards.shaping.Rewards` gives one :class:`~llmtune.rewards.shaping.RewardResult` (the
  task reward, each source, the shaping terms in their fixed order, and for every row whether it trains and why
  not; its :meth:`~llmtune.rewards.shaping.RewardResult.loss_mask` is the one mask every loss path reads);
- **experience**: the stage's algorithm (:class:`Algorithm`: GRPO's group-relative advantages, PPO's GAE over
  per-token rewards) turns batch + rewards into an :class:`~llmtune.rl.types.Experience`, with the rollout forwards
  (:meth:`Loop.forward`) and the engine's importance weights (:meth:`Loop.engine_correction`);
- **train**: the experience cut into ``passes`` shuffled passes of optimizer steps of micro-batches
  (:meth:`~llmtune.rl.types.Experience.minibatches`), handed to transformers' loop
  (:class:`llmtune.rl.trainer.OnlineRLTrainer`), whose loss is the stage's ``loss``;
- the weights reach the engine at the next iteration's sync (the only way they do).

Nothing here is a callback into the trainer class: a :class:`Loop` holds what an iteration uses (the rollouts, the
rewards, the model's rollout forwards, the ranks, the metric and sample logs, the step counter).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager, Protocol

import torch

from llmtune.rewards.shaping import RewardResult, Rewards
from llmtune.rl import ops
from llmtune.rl.forward import RolloutForward, rollout_forward
from llmtune.rl.rollouts import Ranks, Rollouts, iteration_seed
from llmtune.rl.types import Experience, Layout, RolloutBatch
from llmtune.utils import get_logger

log = get_logger("rl")


class Algorithm(Protocol):
    """What a stage's algorithm supplies to an iteration (GRPO, PPO)."""

    passes: int  # shuffled passes of optimizer steps over each rollout batch (num_iterations, ppo_epochs)

    def rollout_rows(self, iteration: int) -> tuple[list[dict], list[int]]:
        """This rank's prompt rows of iteration ``iteration`` (one per trajectory) and their group ids."""
        ...

    def experience(self, loop: Loop, iteration: int, batch: RolloutBatch, rewards: RewardResult
                   ) -> tuple[Experience, torch.Tensor | None]:
        """The experience of a scored rollout batch (whose ``loss_mask`` is ``rewards.loss_mask``), and an optional
        (B,) key that orders the rows of an optimizer step (rows sharing padding share a micro-batch)."""
        ...


@dataclass
class Loop:
    """What an iteration uses (see the module docstring).

    Attributes:
        rollouts: the rollout side. rewards: the reward sources and shaping. model: the trained module (a
            :class:`~llmtune.rl.model.PolicyModel`). ranks: this process among the ranks.
        step: the optimizer steps applied so far. log_metrics: adds metrics to the next training log.
        write_samples: ``fn(iteration, records)``, a few rollouts to ``samples.jsonl``.
        temperature: the sampling temperature (the loss's log-probs are taken at it). chunk_rows: rows per rollout
            forward. autocast: the trainer's mixed-precision context. minibatch, micro: rows per optimizer step and
            per micro-batch (this rank). rollout_seed: ``rollout.seed`` else ``train.seed``.
        correction: ``rollout.vllm.importance_sampling_correction``; correction_cap: its cap.
    """

    rollouts: Rollouts
    rewards: Rewards
    model: torch.nn.Module
    ranks: Ranks
    step: Callable[[], int]
    log_metrics: Callable[[dict], None]
    write_samples: Callable[[int, list[dict]], None]
    temperature: float
    chunk_rows: int
    minibatch: int
    micro: int
    rollout_seed: int
    autocast: Callable[[], ContextManager] = contextlib.nullcontext
    correction: bool = False
    correction_cap: float = 2.0

    def seed(self, iteration: int) -> None:
        """Seed sampling and dropout from (seed, iteration, rank) (not from a checkpoint's RNG state)."""
        from transformers import set_seed

        set_seed(iteration_seed(self.rollout_seed, iteration, self.ranks.rank))

    def generator(self, iteration: int) -> torch.Generator:
        """The minibatch permutations' generator of ``iteration`` on this rank."""
        return torch.Generator().manual_seed(self.ranks.seed + 1_000_003 * iteration + self.ranks.rank)

    def score(self, batch: RolloutBatch) -> RewardResult:
        """:meth:`llmtune.rewards.shaping.Rewards.score` of a batch sampled now or ahead (the stale rows marked)."""
        return self.rewards.score(batch, self.ranks.device, stale=self.rollouts.too_stale(batch, self.step()))

    def forward(self, batch: RolloutBatch, mask: torch.Tensor | None = None, *, policy: bool = True,
                reference: bool = False, values: bool = False, exact_kl: bool = False,
                temperature: float | None = None) -> RolloutForward:
        """The rollout forwards of a batch (:func:`llmtune.rl.forward.rollout_forward`) in chunks, at the sampling
        temperature (evaluation: 1), with the engine's truncated log-probs when the engine reported log-probs under a
        truncated distribution (:meth:`correction_truncation`).

        Args:
            mask: (B, N) the positions whose log-probs are computed (default the tokens the policy sampled:
                ``batch.loss_mask``).
        """
        truncation = self.correction_truncation(batch) if policy and not exact_kl else None
        return rollout_forward(self.model, batch.model_inputs(), batch.completion_ids,
                               temperature=self.temperature if temperature is None else temperature,
                               chunk_rows=self.chunk_rows, policy=policy, reference=reference, values=values,
                               exact_kl=exact_kl, truncation=truncation, autocast=self.autocast,
                               score_mask=None if exact_kl else (batch.loss_mask if mask is None else mask))

    def correction_truncation(self, batch: RolloutBatch) -> tuple[int, float] | None:
        """``(top_k, top_p)`` when the batch's engine log-probs are under a truncated distribution (vLLM's
        ``processed_logprobs`` with ``rollout.top_k`` > 0 or ``rollout.top_p`` < 1): the trainer's side of the
        importance ratio must be taken under the same truncation (:func:`llmtune.rl.ops.sampling_logps`). None when
        the engine reported no log-probs (``hf``: nothing to compare) or sampling is not truncated."""
        return self.rollouts.sampling.truncation if batch.engine_logps is not None else None

    def engine_correction(self, experience: Experience, batch: RolloutBatch, fwd: RolloutForward | None = None,
                          mask: torch.Tensor | None = None) -> None:
        """Measure the engine/trainer mismatch of a rollout batch and, with
        ``rollout.vllm.importance_sampling_correction``, put the truncated importance weights into the experience
        (``is_weights`` (B, N), TOKEN layout, detached, 0 on padding and on tokens not in ``mask``; the policy losses
        multiply their per-token surrogate by it). Nothing happens when the engine reported no log-probs (``hf``).

        Logs, over all ranks' tokens in ``mask``: ``rollout/logprob_diff_mean``/``_max`` (|trainer - engine|
        log-prob of the sampled tokens, nats), ``rollout/is_weight_mean`` and ``rollout/is_clipped_fraction``
        (:func:`llmtune.rl.ops.engine_mismatch_metrics`).

        Args:
            experience: the rollout batch's experience (updated). batch: the rollout batch (its ``engine_logps``).
            fwd: the batch's :meth:`forward` over ``mask`` when already computed (its policy log-probs are the old
                log-probs), else the policy is run here. mask: (B, N) the tokens compared (default
                ``batch.loss_mask``, every sampled token; tool / environment tokens have no engine log-prob).

        Both sides of the ratio are log-probs under the SAME distribution: the engine's are under its sampling
        distribution (temperature, then ``top_k``/``top_p`` truncation, renormalised), so the trainer's are taken
        under the same truncation of its own logits (``sampling_logps``); with the full-vocabulary log-prob the
        on-policy weight would be the kept probability mass, not 1 (issue 30).
        """
        if batch.engine_logps is None:
            return
        mask = batch.loss_mask if mask is None else mask
        truncation = self.correction_truncation(batch)
        if fwd is None or fwd.logps is None:
            fwd = self.forward(batch, mask)
        if truncation is not None and fwd.sampling_logps is None:
            raise RuntimeError("engine_correction: the rollout forward was run without the engine's truncation: a bug")
        trainer_logps = fwd.sampling_logps if truncation is not None else fwd.logps
        sampled = mask.float()
        engine_logps = torch.where(sampled.bool(), batch.engine_logps, torch.zeros_like(batch.engine_logps))
        stats = ops.engine_mismatch_stats(trainer_logps, engine_logps, sampled, self.correction_cap)[None]  # (1, 6)
        if self.ranks.world > 1:
            stats = self.ranks.gather(stats)  # (ranks, 6)
        metrics = ops.engine_mismatch_metrics(stats)
        if "rollout/engine_logp_nonfinite_fraction" in metrics:
            log.warning("the rollout engine reported non-finite log-probs for %.2g%% of the sampled tokens (step %d): "
                        "their importance weight is 0 (an engine in bf16/fp16 overflowing? rollout.vllm.dtype)",
                        100 * metrics["rollout/engine_logp_nonfinite_fraction"], self.step())
        self.log_metrics(metrics)
        if self.correction:
            experience.add("is_weights", ops.truncated_is_weights(trainer_logps, engine_logps, sampled,
                                                                  self.correction_cap), Layout.TOKEN)


def run_iteration(loop: Loop, algorithm: Algorithm, iteration: int) -> list[list[dict[str, torch.Tensor]]]:
    """One iteration of online RL: the optimizer steps of rollout batch ``iteration``, each a list of micro-batch
    dicts for the stage's loss.

    Raises:
        RolloutEngineError: the engine failed (exit 69; the newest checkpoint is intact).
        RewardFunctionError: a reward function failed, or nothing in the batch can train (GRPO).
    """
    step = loop.step()
    # sync: the engine samples from the policy of this step (or the background sampler gets a snapshot of it)
    loop.rollouts.start(iteration, step)
    loop.seed(iteration)  # sampling, dropout and minibatch order from (seed, iteration, rank)
    # sample: one trajectory per prompt row (GRPO: num_generations per prompt), padded into a batch
    batch = loop.rollouts.batch(iteration, step)
    # score: the reward sources, the shaping steps in their order, which rows train and why not
    rewards = loop.score(batch)
    # experience: advantages, old / reference log-probs, values, importance weights; the loss mask is rewards'
    experience, order_key = algorithm.experience(loop, iteration, batch, rewards)
    # train: shuffled passes of optimizer steps, each cut into micro-batches
    return experience.minibatches(algorithm.passes, loop.minibatch, loop.micro, loop.generator(iteration), order_key)
