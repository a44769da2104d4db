"""GRPO on the shared online-RL trainer (:class:`llmtune.rl.trainer.OnlineRLTrainer`).

One iteration = ``grpo.rollout_batch_size / num_generations`` prompts over all ranks (dealt round-robin), each
sampled ``num_generations`` times from the current policy; every completion is scored by the reward sources (plus
DAPO's overlong penalty); the advantages (``advantage_estimator``) are computed on the rank that holds the group,
over the rows that train only: a row with an empty loss mask (truncated under ``mask_truncated_completions``,
dropped by dynamic sampling, every reward function abstained) never moves a baseline. Groups are found by explicit
group ids, never by position; ``scale_rewards: batch`` and ``reinforce_plus_plus`` sum their moments over ranks.
Then ``num_iterations`` shuffled passes of optimizer steps of ``train.global_batch_size`` completions run over it.
A group may span micro-batches and optimizer steps: its advantages are fixed at sampling time, and the loss of a
micro-batch is its sum divided by the item count of the whole optimizer step on all ranks (tokens for
``token_mean``, completions otherwise), so the split into micro-batches and ranks never changes a step.

Old log-probs (the sampling policy, for the importance ratio) are computed at sampling time when the policy moves
before the completions are used (several optimizer steps per rollout batch, or ``num_iterations`` > 1); otherwise
the ratio is exactly 1 in value (the loss gets no old log-probs and uses the current ones, detached). With
``beta`` > 0 the reference log-probs (adapters disabled) are computed at sampling time too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from llmtune.config import RecipeError
from llmtune.core.guard import ROW_KEY
from llmtune.rl.model import PolicyModel
from llmtune.rl.ops import kl_estimate, masked_mean
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

    def __init__(self, *positional, stage, **kwargs):
        recipe = stage.recipe
        self.grpo = g = recipe.grpo
        world = int(kwargs["args"].world_size)
        prompts = g.rollout_batch_size // g.num_generations
        if prompts % world:
            raise RecipeError([("grpo.rollout_batch_size", f"{g.rollout_batch_size} completions = {prompts} prompts "
                                f"x num_generations {g.num_generations} do not divide over {world} processes; use "
                                f"a multiple of {g.num_generations * world}")])
        self.local_prompts = prompts // world
        self.local_minibatch = recipe.train.global_batch_size // world
        self.steps_per_iteration = g.num_iterations * g.rollout_batch_size // recipe.train.global_batch_size
        self.needs_old_logps = self.steps_per_iteration > 1
        super().__init__(*positional, stage=stage, **kwargs)

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

    # ---- rollouts ---------------------------------------------------------------------------------
    def rollout_rows(self, iteration: int) -> tuple[list[dict], list[int]]:
        """This rank's prompts of iteration ``iteration``, each ``num_generations`` times (group id = the prompt's
        index among this rank's prompts)."""
        rows = [self.prompts[i] for i in self.prompt_indices(iteration, self.local_prompts * self.args.world_size)]
        return self._grouped(rows)

    def _grouped(self, rows: list[dict]) -> tuple[list[dict], list[int]]:
        G = self.grpo.num_generations
        return [row for row in rows for _ in range(G)], [b // G for b in range(len(rows) * G)]

    def sample_groups(self, rows: list[dict]) -> Groups:
        """``num_generations`` trajectories of each prompt row, sampled now and scored (:class:`Groups`;
        B = len(rows) x G, the group id of a row = its prompt's index in ``rows``)."""
        return self.score_groups(self.sample(*self._grouped(rows)))

    def score_groups(self, batch) -> Groups:
        """A rollout batch of groups scored (rewards, abstentions, penalties): :class:`Groups`."""
        g = self.grpo
        total, per_source = self.score(batch)
        abstained = torch.isnan(total)
        reward = torch.nan_to_num(total, nan=0.0)
        if g.missing_eos_penalty is not None:
            reward = reward + g.missing_eos_penalty * (~batch.ended).float()
        overlong = torch.zeros_like(reward)
        if g.overlong_buffer_tokens:
            overlong = ops.overlong_penalty(batch.completion_mask.sum(1), self.rollout.max_new_tokens,
                                            g.overlong_buffer_tokens, g.overlong_penalty_factor).to(reward.device)
            reward = reward + overlong
        return Groups(batch, reward, abstained, overlong, per_source)

    def trainable(self, groups: Groups) -> torch.Tensor:
        """(B,) bool: rows that can train before dynamic sampling — not abstained, not beyond
        ``rollout.max_staleness``, and ended when ``mask_truncated_completions``."""
        keep = ~groups.abstained & ~self.too_stale(groups.batch)
        if self.grpo.mask_truncated_completions:
            keep &= groups.batch.ended
        return keep

    def _extra_prompts(self, iteration: int, round_: int) -> list[dict]:
        """Dynamic sampling: this rank's share of a fresh random draw of prompts, seeded by (seed, iteration,
        round)."""
        gen = torch.Generator().manual_seed(self.args.seed + 1_000_003 * iteration + 104_729 * round_)
        picks = torch.randint(len(self.prompts), (self.local_prompts * self.args.world_size,), generator=gen).tolist()
        return [self.prompts[i] for i in picks[self.args.process_index::self.args.world_size]]

    def _silent(self, groups: Groups) -> torch.Tensor:
        """(B,) bool: rows of groups without signal (their trainable rewards all equal, or < 2 trainable rows)."""
        return ops.group_all_equal(groups.reward, groups.batch.group_ids, self.trainable(groups))

    def _resample(self, iteration: int, groups: Groups) -> tuple[Groups, int]:
        """DAPO dynamic sampling: replace groups without signal by informative groups of extra prompts, for up to
        ``max_resample_rounds`` rounds (every rank samples each round while any rank still needs to, so collective
        generation under ZeRO-3 stays in step). Returns the groups and the rounds run."""
        rounds = 0
        for round_ in range(1, self.grpo.max_resample_rounds + 1):
            silent = self._silent(groups)
            need = torch.tensor([float(silent.any())], device=self.args.device)
            if self.args.world_size > 1:
                need = self.accelerator.reduce(need, reduction="sum")
            if float(need) == 0:
                break
            rounds = round_
            extra = self.sample_groups(self._extra_prompts(iteration, round_))
            extra_silent = self._silent(extra)
            extra_ids, ids = extra.batch.group_ids, groups.batch.group_ids
            good = [int(i) for i in extra_ids.unique() if not extra_silent[extra_ids == i].any()]
            bad = [int(i) for i in ids.unique() if silent[ids == i].any()]
            swaps = list(zip(bad, good))
            if swaps:
                groups = replace_groups(groups, extra, swaps, self.pad_id)
        return groups, rounds

    def make_experience(self, iteration: int) -> list[list[dict[str, torch.Tensor]]]:
        """Sample and score one rollout batch of groups, compute advantages over the rows that train, log its
        metrics and return the optimizer steps (``num_iterations`` shuffled passes), each a list of micro-batch
        dicts."""
        g = self.grpo
        self._seed(iteration)
        groups = self.score_groups(self.rollout_batch(iteration))
        silent_first = self._silent(groups)  # counted before any resampling
        rounds = 0
        if g.dynamic_sampling == "resample":
            groups, rounds = self._resample(iteration, groups)
        batch, reward = groups.batch, groups.reward
        group_ids, mask = batch.group_ids, batch.completion_mask
        keep = self.trainable(groups)
        silent = ops.group_all_equal(reward, group_ids, keep)
        if g.dynamic_sampling != "off":
            keep &= ~silent
        # every statistic below is over the rows that train (bug: masked rows used to move their group's baseline)
        tokens = batch.loss_mask.sum(1)
        stats = ops.advantage_moments(g.advantage_estimator, g.scale_rewards, reward, keep, tokens)
        if stats is not None and self.args.world_size > 1:
            stats = self.accelerator.reduce(stats.to(self.args.device), reduction="sum")
        advantages = ops.compute_advantages(g.advantage_estimator, reward, group_ids, keep, g.scale_rewards, stats,
                                            tokens)
        failed = torch.tensor([bool(t.info.get("infrastructure_error")) for t in batch.trajectories],
                              device=groups.abstained.device)
        example = next((t.info["infrastructure_error"] for t in batch.trajectories
                        if t.info.get("infrastructure_error")), "")
        self._check_signal(iteration, groups.abstained, keep & (advantages != 0), failed, example)

        experience = Experience.from_batch(batch)
        experience.add("loss_mask", batch.loss_mask * keep[:, None].long(), Layout.TOKEN)
        experience.add("advantages", advantages, Layout.SEQUENCE)
        if all("index" in row for row in batch.rows):  # (B,) prompt rows, named by the non-finite guard
            experience.add(ROW_KEY, torch.tensor([int(r["index"]) for r in batch.rows], device=mask.device),
                           Layout.SEQUENCE)
        kl_rollout, fwd = None, None
        if self.needs_old_logps or g.beta > 0:
            fwd = self.forward(batch, reference=g.beta > 0)
            sampled = batch.loss_mask
            if self.needs_old_logps:
                experience.add("old_logps", fwd.logps * sampled, Layout.TOKEN)
            if g.beta > 0:
                experience.add("ref_logps", fwd.ref_logps * sampled, Layout.TOKEN)
                kl_rollout = masked_mean(kl_estimate(fwd.logps, fwd.ref_logps, g.kl_estimator), sampled.float())
        self.engine_correction(experience, batch, fwd)

        self.add_metrics(self._rollout_metrics(groups, silent_first, silent, keep, rounds, kl_rollout))
        if iteration % g.sample_every == 0:
            texts = self.scored(batch).completions
            self.write_samples(iteration, [
                {"prompt": batch.rows[b]["prompt"], "completion": texts[b],
                 "reward": None if groups.abstained[b] else float(reward[b]),
                 "rewards": {n: _finite_or_none(v[b]) for n, v in groups.per_source.items()},
                 "advantage": float(advantages[b]), "trained": bool(keep[b]), **self.conversation(batch, b)}
                for b in range(min(len(texts), 2 * g.num_generations))])

        steps = []
        gen = torch.Generator().manual_seed(self.args.seed + 1_000_003 * iteration + self.args.process_index)
        micro = self.args.per_device_train_batch_size
        n = mask.shape[0]
        # within an optimizer step the split into micro-batches changes nothing (sums / the step's item count):
        # rows of one prompt, then of similar prompt lengths, share a micro-batch (micro_batch drops their common
        # padding)
        prompt_len = batch.prompt_mask.sum(1).cpu()
        for _ in range(g.num_iterations):
            order = torch.randperm(n, generator=gen)
            for start in range(0, n, self.local_minibatch):
                idx = order[start:start + self.local_minibatch]
                idx = idx[torch.argsort(prompt_len[idx] * n + group_ids.cpu()[idx], stable=True)]
                steps.append([experience.micro_batch(idx[m:m + micro].to(mask.device))
                              for m in range(0, len(idx), micro)])
        return steps

    def _check_signal(self, iteration: int, abstained: torch.Tensor, informative: torch.Tensor,
                      infrastructure: torch.Tensor, example: str = "") -> None:
        """A run that learns nothing says so (issue 30; the docs promise "never a silent 0").

        Raises:
            RewardFunctionError: every reward source abstained (returned None) on every completion of the rollout
                batch on all ranks, or (multi-turn) the environment / tool infrastructure failed on every rollout:
                nothing could train, so the run stops instead of finishing "done" with loss 0.

        Warns once per streak when no completion carried a learning signal (every group's trainable rewards equal)
        (no trained row with a non-zero advantage, whatever the estimator) for ``IDLE_ITERATIONS_WARN`` iterations in
        a row, naming the likely causes.
        """
        counts = torch.tensor([float(abstained.sum()), float(abstained.numel()), float(informative.sum()),
                               float(infrastructure.sum())], device=self.args.device)
        if self.args.world_size > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        n_abstained, rows, n_informative, n_failed = (int(x) for x in counts.tolist())
        if rows and n_abstained == rows:
            from llmtune.rewards.functions import RewardFunctionError

            if n_failed == rows:
                raise RewardFunctionError(
                    f"iteration {iteration} (step {self.state.global_step}): the environment or tool infrastructure "
                    f"failed on all {rows} rollouts ({example or 'see samples.jsonl'}), so nothing can train; fix the "
                    "environment / tool "
                    "service (an InfrastructureError, or reset raising), then rerun the same command: the newest "
                    "checkpoint is intact")
            names = ", ".join(self.rewards.names)
            raise RewardFunctionError(
                f"iteration {iteration} (step {self.state.global_step}): every reward source ({names}) abstained "
                f"(returned None) on all {rows} completions, so nothing can train (the loss would be 0). Check the "
                "reward functions on the completions in samples.jsonl (a parser that never matches this model's "
                "output format? data without the references the function needs?); the newest checkpoint is intact")
        self._idle_iterations = 0 if n_informative else getattr(self, "_idle_iterations", 0) + 1
        if self._idle_iterations == IDLE_ITERATIONS_WARN:
            log.warning(
                "GRPO trained nothing in the last %d iterations (up to step %d): every advantage was 0 (in every group "
                "the rewards of the trainable completions were equal). Likely causes: a reward that is constant "
                "on these completions (see rewards/<name>_std in metrics.jsonl and the completions in samples.jsonl), "
                "a task always solved or never solved by this model (try easier/harder prompts or a partial-credit "
                "reward), sampling with too little variety (rollout.temperature, top_p, top_k), or "
                "grpo.num_generations too small; grpo.dynamic_sampling: resample replaces such groups",
                self._idle_iterations, self.state.global_step)

    def _rollout_metrics(self, groups: Groups, silent_first, silent, keep, rounds, kl) -> dict[str, float]:
        """Means over all ranks' completions of this iteration; rewards over the rows that have one (per source:
        the rows it scored); ``rewards/abstained`` = fraction of rows on which every source abstained."""
        names = list(groups.per_source)
        batch = groups.batch
        per_row = torch.stack([groups.reward.float(), batch.completion_mask.sum(1).float(), (~batch.ended).float(),
                               keep.float(), groups.abstained.float(), groups.overlong.float(), silent_first.float(),
                               silent.float(), *(groups.per_source[n].float() for n in names)], 1)  # (B, 8 + S)
        if self.args.world_size > 1:
            per_row = self.accelerator.gather(per_row)
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
        if self.grpo.overlong_buffer_tokens:
            metrics["rewards/overlong_penalty_mean"] = float(per_row[:, 5].mean())
        if self.grpo.dynamic_sampling == "resample":
            metrics["all_equal_group_fraction_after_resampling"] = float(per_row[:, 7].mean())
            metrics["resample_rounds"] = float(rounds)
        if kl is not None:
            metrics["rollout_kl"] = float(kl)  # per token, sampling policy vs reference (0 before the first step)
        return metrics


@dataclass
class Groups:
    """A rollout batch of GRPO groups, scored.

    Attributes:
        batch: the trajectories (``group_ids`` (B,): the prompt of each row; rows of a group need not be adjacent).
        reward: (B,) the reward the loss uses (the sources' weighted total + ``missing_eos_penalty`` + DAPO's overlong
            penalty; 0 where every source abstained). abstained: (B,) bool, every source abstained.
        overlong: (B,) the overlong penalty. per_source: {name: (B,) raw scores, NaN = abstained}.
    """

    batch: RolloutBatch
    reward: torch.Tensor
    abstained: torch.Tensor
    overlong: torch.Tensor
    per_source: dict[str, torch.Tensor]


def _mean(x: torch.Tensor) -> float:
    return float(x.mean()) if len(x) else float("nan")


def _std(x: torch.Tensor) -> float:
    return float(x.std()) if len(x) > 1 else 0.0


def _finite_or_none(x: torch.Tensor) -> float | None:
    return None if torch.isnan(x) else float(x)


def replace_groups(groups: Groups, extra: Groups, swaps: list[tuple[int, int]], pad_id: int) -> Groups:
    """``groups`` with the rows of group id ``bad`` replaced by ``extra``'s rows of group id ``good`` for each
    ``(bad, good)`` (found by group ids, not by position; the replaced rows keep the id ``bad``), the trajectories
    padded again into one batch.

    Raises:
        ValueError: the two groups of a swap do not have the same number of rows.
    """
    trajectories = list(groups.batch.trajectories)
    take = torch.arange(len(trajectories))  # row b of the result comes from groups (b) or extra (B + j)
    ids, extra_ids = groups.batch.group_ids, extra.batch.group_ids
    for bad, good in swaps:
        dst = (ids == bad).nonzero().flatten().tolist()
        src = (extra_ids == good).nonzero().flatten().tolist()
        if len(dst) != len(src):
            raise ValueError(f"group {bad} has {len(dst)} rows but replacement group {good} has {len(src)}")
        for d, j in zip(dst, src):
            trajectories[d] = replace(extra.batch.trajectories[j], group=bad)
            take[d] = len(trajectories) + j
    device = groups.reward.device
    batch = RolloutBatch.from_trajectories(trajectories, pad_id, device)
    pick = take.to(device)

    def merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b.to(a.device)])[pick.to(a.device)]

    return Groups(batch, merge(groups.reward, extra.reward), merge(groups.abstained, extra.abstained),
                  merge(groups.overlong, extra.overlong),
                  {n: merge(v, extra.per_source[n]) for n, v in groups.per_source.items()})
