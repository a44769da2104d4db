"""GRPO's algorithm (:class:`GRPO`, one iteration's experience) on the shared online-RL trainer
(:class:`llmtune.rl.trainer.OnlineRLTrainer`; the iteration itself reads top to bottom in
:func:`llmtune.rl.iteration.run_iteration`).

One iteration = ``grpo.rollout_batch_size / num_generations`` prompts over all ranks (dealt round-robin), each
sampled ``num_generations`` times from the current policy; every completion is scored by the reward sources and the
shaping steps (:mod:`llmtune.rewards.shaping`: missing EOS, DAPO's overlong penalty, tool shaping; per-turn rewards
add their return); the advantages (``advantage_estimator``) are computed on the rank that holds the group, over the
rows that train only: a row that does not train (truncated under ``mask_truncated_completions``, dropped by dynamic
sampling, every reward function abstained, its infrastructure failed, too stale) never moves a baseline. Groups are
found by explicit group ids, never by position; ``scale_rewards: batch`` and ``reinforce_plus_plus`` sum their
moments over ranks. Then ``num_iterations`` shuffled passes of optimizer steps of ``train.global_batch_size``
completions run over it.
A group may span micro-batches and optimizer steps: its advantages are fixed at sampling time, and the loss of a
micro-batch is its sum divided by the item count of the whole optimizer step on all ranks (tokens for
``token_mean``, completions otherwise), so the split into micro-batches and ranks never changes a step.

Old log-probs (the sampling policy, for the importance ratio) are computed at sampling time when the policy moves
before the completions are used (several optimizer steps per rollout batch, or ``num_iterations`` > 1); otherwise
the ratio is exactly 1 in value (the loss gets no old log-probs and uses the current ones, detached). With
``beta`` > 0 the reference log-probs (adapters disabled) are computed at sampling time too.
"""

from __future__ import annotations

import torch

from llmtune.config import RecipeError
from llmtune.core.guard import ROW_KEY
from llmtune.rewards.shaping import RewardResult, Skip
from llmtune.rl.iteration import Loop
from llmtune.rl.model import PolicyModel
from llmtune.rl.ops import kl_estimate, masked_mean
from llmtune.rl.rollouts import conversation_fields, prompt_indices
from llmtune.rl.trainer import OnlineRLTrainer
from llmtune.rl.types import Experience, Layout, RolloutBatch
from llmtune.stages.grpo import ops
from llmtune.utils import get_logger

log = get_logger("grpo")
IDLE_ITERATIONS_WARN = 2  # iterations in a row without a learning signal before the warning


class GRPOTrainer(OnlineRLTrainer):
    """``OnlineRLTrainer`` whose micro-batches are groups of sampled completions (see the module docstring).

    Raises:
        RecipeError: the prompts of a rollout batch do not divide over the ranks.
        ModelLoadError: a reward run cannot be loaded.
        RewardFunctionError: a reward function cannot be imported or returns bad values.
    """

    score_name, length_name, per_source_eval = "reward", "completion_length", True
    kl_per_token = True  # eval_kl per token, as the training `kl` (kl_sum / trained tokens)

    def build_algorithm(self, recipe, prompts, args) -> GRPO:
        return GRPO(recipe, prompts, args.seed, args.process_index, args.world_size)

    def build_model(self, policy, recipe) -> PolicyModel:
        """The policy wrapped with its reference (adapters disabled).

        Raises:
            ModelLoadError: the policy has no adapter (``adapter.type: none``): the reference would be the policy.
        """
        from peft import PeftModel

        from llmtune.models import ModelLoadError

        if not isinstance(policy, PeftModel):
            raise ModelLoadError("GRPO's reference is the policy with its adapter disabled; adapter.type: none has "
                                 "no adapter to disable (set adapter.type: lora)")
        return PolicyModel(policy)


class GRPO:
    """GRPO's part of an iteration (:class:`llmtune.rl.iteration.Algorithm`): which prompts, and the experience of a
    scored rollout batch of groups.

    Args:
        recipe: the typed recipe (``grpo``, ``train.global_batch_size``). prompts: the prompt rows.
        seed: ``train.seed`` (prompt order, dynamic sampling's extra prompts). rank, world: this process.

    Raises:
        RecipeError: the prompts of a rollout batch do not divide over the ranks.
    """

    def __init__(self, recipe, prompts, seed: int, rank: int, world: int):
        self.grpo = g = recipe.grpo
        n_prompts = g.rollout_batch_size // g.num_generations
        if n_prompts % world:
            raise RecipeError([("grpo.rollout_batch_size", f"{g.rollout_batch_size} completions = {n_prompts} prompts "
                                f"x num_generations {g.num_generations} do not divide over {world} processes; use "
                                f"a multiple of {g.num_generations * world}")])
        self.prompts, self.seed, self.rank, self.world = prompts, seed, rank, world
        self.local_prompts = n_prompts // world
        self.steps_per_iteration = g.num_iterations * g.rollout_batch_size // recipe.train.global_batch_size
        self.passes = g.num_iterations
        self.needs_old_logps = self.steps_per_iteration > 1
        self.idle_iterations = 0

    # ---- which prompts ----------------------------------------------------------------------------------------
    def rollout_rows(self, iteration: int) -> tuple[list[dict], list[int]]:
        """This rank's prompts of iteration ``iteration``, each ``num_generations`` times (group id = the prompt's
        index among this rank's prompts)."""
        indices = prompt_indices(len(self.prompts), self.seed, iteration, self.local_prompts * self.world, self.rank,
                                 self.world)
        return self._grouped([self.prompts[i] for i in indices])

    def _grouped(self, rows: list[dict]) -> tuple[list[dict], list[int]]:
        G = self.grpo.num_generations
        return [row for row in rows for _ in range(G)], [b // G for b in range(len(rows) * G)]

    def _extra_prompts(self, iteration: int, round_: int) -> list[dict]:
        """Dynamic sampling: this rank's share of a fresh random draw of prompts, seeded by (seed, iteration,
        round)."""
        gen = torch.Generator().manual_seed(self.seed + 1_000_003 * iteration + 104_729 * round_)
        picks = torch.randint(len(self.prompts), (self.local_prompts * self.world,), generator=gen).tolist()
        return [self.prompts[i] for i in picks[self.rank::self.world]]

    # ---- dynamic sampling -------------------------------------------------------------------------------------
    @staticmethod
    def _silent(batch: RolloutBatch, rewards: RewardResult) -> torch.Tensor:
        """(B,) bool: rows of groups without signal (their trainable rewards all equal, or < 2 trainable rows)."""
        return ops.group_all_equal(rewards.total, batch.group_ids, rewards.trains)

    def _resample(self, loop: Loop, iteration: int, batch: RolloutBatch, rewards: RewardResult
                  ) -> tuple[RolloutBatch, RewardResult, int]:
        """DAPO dynamic sampling: replace groups without signal by informative groups of extra prompts, for up to
        ``max_resample_rounds`` rounds (every rank samples each round while any rank still needs to, so collective
        generation under ZeRO-3 stays in step). Returns the batch, its rewards and the rounds run."""
        rounds = 0
        for round_ in range(1, self.grpo.max_resample_rounds + 1):
            silent = self._silent(batch, rewards)
            need = loop.ranks.reduce(torch.tensor([float(silent.any())], device=loop.ranks.device))
            if float(need) == 0:
                break
            rounds = round_
            extra = loop.rollouts.sample(*self._grouped(self._extra_prompts(iteration, round_)))
            extra_rewards = loop.score(extra)
            extra_silent = self._silent(extra, extra_rewards)
            extra_ids, ids = extra.group_ids, batch.group_ids
            good = [int(i) for i in extra_ids.unique() if not extra_silent[extra_ids == i].any()]
            bad = [int(i) for i in ids.unique() if silent[ids == i].any()]
            swaps = list(zip(bad, good))
            if swaps:
                batch, rewards = replace_groups(batch, rewards, extra, extra_rewards, swaps, loop.rollouts.pad_id)
        return batch, rewards, rounds

    # ---- the experience ---------------------------------------------------------------------------------------
    def experience(self, loop: Loop, iteration: int, batch: RolloutBatch, rewards: RewardResult
                   ) -> tuple[Experience, torch.Tensor]:
        """Advantages over the rows that train (after dynamic sampling), old / reference log-probs when needed, the
        engine's importance weights; logs the rollout metrics and a few samples. Returns the experience and the
        within-step order key (rows of one prompt, then of similar prompt lengths, share a micro-batch, whose common
        padding :meth:`~llmtune.rl.types.Experience.micro_batch` drops)."""
        g = self.grpo
        silent_first = self._silent(batch, rewards)  # counted before any resampling
        rounds = 0
        if g.dynamic_sampling == "resample":
            batch, rewards, rounds = self._resample(loop, iteration, batch, rewards)
        reward, group_ids = rewards.total, batch.group_ids
        silent = ops.group_all_equal(reward, group_ids, rewards.trains)
        if g.dynamic_sampling != "off":
            rewards.exclude(silent, Skip.NO_SIGNAL)
        keep = rewards.trains
        # every statistic below is over the rows that train (bug: masked rows used to move their group's baseline)
        tokens = batch.sampled_tokens()  # (B,) every segment's, for a rollout that is several rows
        stats = ops.advantage_moments(g.advantage_estimator, g.scale_rewards, reward, keep, tokens)
        if stats is not None and loop.ranks.world > 1:
            stats = loop.ranks.reduce(stats.to(loop.ranks.device))
        advantages = ops.compute_advantages(g.advantage_estimator, reward, group_ids, keep, g.scale_rewards, stats,
                                            tokens)
        self._check_signal(loop, iteration, rewards, keep & (advantages != 0))

        # the learner's rows: one per rollout, or one per segment of a rollout whose agent rewrote its history, each
        # with its rollout's advantage (every sampled token is in one row: see segment_weights)
        train, rollout = batch.training_rows()
        experience = Experience.from_batch(train, rewards.loss_mask(train, rollout))
        experience.add("advantages", advantages[rollout.to(advantages.device)], Layout.SEQUENCE)
        if train is not batch:
            experience.add("rollout_tokens", segment_weights(experience["loss_mask"], rollout), Layout.SEQUENCE)
        if all("index" in row for row in train.rows):  # (S,) prompt rows, named by the non-finite guard
            experience.add(ROW_KEY, torch.tensor([int(r["index"]) for r in train.rows], device=reward.device),
                           Layout.SEQUENCE)
        kl_rollout, fwd = None, None
        if self.needs_old_logps or g.beta > 0:
            fwd = loop.forward(train, reference=g.beta > 0)  # every sampled token (rollout_kl counts them all)
            sampled = train.loss_mask
            if self.needs_old_logps:
                experience.add("old_logps", fwd.logps * sampled, Layout.TOKEN)
            if g.beta > 0:
                experience.add("ref_logps", fwd.ref_logps * sampled, Layout.TOKEN)
                kl_rollout = masked_mean(kl_estimate(fwd.logps, fwd.ref_logps, g.kl_estimator), sampled.float())
        loop.engine_correction(experience, train, fwd)

        loop.log_metrics(self._rollout_metrics(loop, batch, rewards, silent_first, silent, keep, rounds, kl_rollout))
        if iteration % g.sample_every == 0:
            texts = rewards.completions
            loop.write_samples(iteration, [
                {"prompt": batch.rows[b]["prompt"], "completion": texts[b],
                 "reward": None if rewards.abstained[b] else float(reward[b]),
                 "rewards": {n: _finite_or_none(v[b]) for n, v in rewards.per_source.items()},
                 **({"shaping": {n: float(v[b]) for n, v in rewards.terms.items()}} if rewards.terms else {}),
                 "advantage": float(advantages[b]), "trained": bool(keep[b]),
                 **conversation_fields(batch.trajectories[b])}
                for b in range(min(len(texts), 2 * g.num_generations))])
        n = train.completion_mask.shape[0]
        return experience, train.prompt_mask.sum(1).cpu() * n + train.group_ids.cpu()

    def _check_signal(self, loop: Loop, iteration: int, rewards: RewardResult, informative: torch.Tensor) -> None:
        """A run that learns nothing says so (issue 30; the docs promise "never a silent 0").

        Raises:
            RewardFunctionError: every reward source abstained (returned None) on every completion of the rollout
                batch on all ranks, or (multi-turn) the environment / tool infrastructure failed on every rollout:
                nothing could train, so the run stops instead of finishing "done" with loss 0.

        Warns once per streak when no completion carried a learning signal (every group's trainable rewards equal)
        (no trained row with a non-zero advantage, whatever the estimator) for ``IDLE_ITERATIONS_WARN`` iterations in
        a row, naming the likely causes.
        """
        abstained, failed = rewards.abstained, rewards.failed
        counts = torch.tensor([float(abstained.sum()), float(abstained.numel()), float(informative.sum()),
                               float(failed.sum())], device=loop.ranks.device)
        if loop.ranks.world > 1:
            counts = loop.ranks.reduce(counts)
        n_abstained, rows, n_informative, n_failed = (int(x) for x in counts.tolist())
        step = loop.step()
        if rows and n_abstained == rows:
            from llmtune.rewards.functions import RewardFunctionError

            if n_failed == rows:
                example = next((f for f in rewards.failures if f), "") or "see samples.jsonl"
                raise RewardFunctionError(
                    f"iteration {iteration} (step {step}): the environment or tool infrastructure failed on all "
                    f"{rows} rollouts ({example}), so nothing can train; fix the environment / tool service (an "
                    "InfrastructureError, or reset raising), then rerun the same command: the newest checkpoint is "
                    "intact")
            names = ", ".join(loop.rewards.names)
            raise RewardFunctionError(
                f"iteration {iteration} (step {step}): every reward source ({names}) abstained "
                f"(returned None) on all {rows} completions, so nothing can train (the loss would be 0). Check the "
                "reward functions on the completions in samples.jsonl (a parser that never matches this model's "
                "output format? data without the references the function needs?); the newest checkpoint is intact")
        self.idle_iterations = 0 if n_informative else self.idle_iterations + 1
        if self.idle_iterations == IDLE_ITERATIONS_WARN:
            log.warning(
                "GRPO trained nothing in the last %d iterations (up to step %d): every advantage was 0 (in every group "
                "the rewards of the trainable completions were equal). Likely causes: a reward that is constant "
                "on these completions (see rewards/<name>_std in metrics.jsonl and the completions in samples.jsonl), "
                "a task always solved or never solved by this model (try easier/harder prompts or a partial-credit "
                "reward), sampling with too little variety (rollout.temperature, top_p, top_k), or "
                "grpo.num_generations too small; grpo.dynamic_sampling: resample replaces such groups",
                self.idle_iterations, step)

    def _rollout_metrics(self, loop: Loop, batch: RolloutBatch, rewards: RewardResult, silent_first, silent, keep,
                         rounds, kl) -> dict[str, float]:
        """Means over all ranks' completions of this iteration; rewards over the rows that have one (per source:
        the rows it scored); ``rewards/abstained`` = fraction of rows on which every source abstained; the task
        reward and the shaping terms apart (:meth:`llmtune.rewards.shaping.Rewards.metrics`)."""
        names = list(rewards.per_source)
        overlong = rewards.terms.get("overlong", torch.zeros_like(rewards.total))
        per_row = torch.stack([rewards.total.float(), batch.completion_mask.sum(1).float(), (~batch.ended).float(),
                               keep.float(), rewards.abstained.float(), overlong.float(), silent_first.float(),
                               silent.float(), *(rewards.per_source[n].float() for n in names)], 1)  # (B, 8 + S)
        per_row = loop.ranks.gather(per_row)
        scored = per_row[per_row[:, 4] == 0, 0]
        metrics = {
            "reward_mean": _mean(scored), "reward_std": _std(scored),
            "completion_length": float(per_row[:, 1].mean()), "truncated_fraction": float(per_row[:, 2].mean()),
            "all_equal_group_fraction": float(per_row[:, 6].mean()),  # every group has G rows: = fraction of groups
            "trained_completion_fraction": float(per_row[:, 3].mean()),
            "rewards/abstained": float(per_row[:, 4].mean()),
        }
        for i, name in enumerate(names):
            column = per_row[:, 8 + i]
            column = column[~torch.isnan(column)]
            metrics[f"rewards/{name}_mean"], metrics[f"rewards/{name}_std"] = _mean(column), _std(column)
        metrics.update(loop.rewards.metrics(rewards, loop.ranks.gather, loop.step()))
        if self.grpo.dynamic_sampling == "resample":
            metrics["all_equal_group_fraction_after_resampling"] = float(per_row[:, 7].mean())
            metrics["resample_rounds"] = float(rounds)
        if kl is not None:
            metrics["rollout_kl"] = float(kl)  # per token, sampling policy vs reference (0 before the first step)
        return metrics


def segment_weights(loss_mask: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """(S,) fp32: for each training row, the tokens in the loss of its whole rollout (all its segments).

    How a rollout that is several segments (an agent that rewrote its history) is weighted: each segment is a row
    with the rollout's advantage, and every token the policy sampled is in exactly one of them, so under
    ``token_mean`` a token weighs what it would in one joined row. Under ``sequence_mean`` and ``constant`` (whose
    unit is a completion) a row's token sum is divided by its ROLLOUT's tokens and the row counts as its share of them
    (:func:`llmtune.stages.grpo.ops.count_items`): the segments of one rollout add up to that rollout's mean and count
    as one completion, as if it had joined. (Not 1/segments per row: that would make a token's weight depend on where
    the agent happened to rewrite its history.)

    Args:
        loss_mask: (S, N) the loss mask of the rows. rollout: (S,) the rollout of each row.
    """
    per_row = loss_mask.float().sum(1)
    totals = torch.zeros(int(rollout.max()) + 1 if len(rollout) else 0, device=per_row.device)
    totals.index_add_(0, rollout.to(per_row.device), per_row)
    return totals[rollout.to(per_row.device)]


def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if len(x) else float("nan")


def _std(x: torch.Tensor) -> float:
    return float(x.std()) if len(x) > 1 else 0.0


def _finite_or_none(x: torch.Tensor) -> float | None:
    return None if torch.isnan(x) else float(x)


def replace_groups(batch: RolloutBatch, rewards: RewardResult, extra: RolloutBatch, extra_rewards: RewardResult,
                   swaps: list[tuple[int, int]], pad_id: int) -> tuple[RolloutBatch, RewardResult]:
    """``batch`` with the rows of group id ``bad`` replaced by ``extra``'s rows of group id ``good`` for each
    ``(bad, good)`` (found by group ids, not by position; the replaced rows keep the id ``bad``), the trajectories
    padded again into one batch, and their rewards alike.

    Raises:
        ValueError: the two groups of a swap do not have the same number of rows.
    """
    from dataclasses import replace

    trajectories = list(batch.trajectories)
    take = torch.arange(len(trajectories))  # row b of the result comes from batch (b) or extra (B + j)
    ids, extra_ids = batch.group_ids, extra.group_ids
    for bad, good in swaps:
        dst = (ids == bad).nonzero().flatten().tolist()
        src = (extra_ids == good).nonzero().flatten().tolist()
        if len(dst) != len(src):
            raise ValueError(f"group {bad} has {len(dst)} rows but replacement group {good} has {len(src)}")
        for d, j in zip(dst, src):
            trajectories[d] = replace(extra.trajectories[j], group=bad)
            take[d] = len(trajectories) + j
    merged = RolloutBatch.from_trajectories(trajectories, pad_id, rewards.total.device)
    return merged, rewards.merge(extra_rewards, take)
