"""GRPO on the shared online-RL trainer (:class:`llmtune.rl.trainer.OnlineRLTrainer`).

One iteration = ``grpo.rollout_batch_size / num_generations`` prompts over all ranks (dealt round-robin), each
sampled ``num_generations`` times from the current policy; every completion is scored by the reward sources, the
group-relative advantages are computed on the rank that holds the group (``scale_rewards: batch`` gathers the std
over ranks), then ``num_iterations`` shuffled passes of optimizer steps of ``train.global_batch_size`` completions
run over it. A group may span micro-batches and optimizer steps: its advantages are fixed at sampling time, and
the loss of a micro-batch is its sum divided by the item count of the whole optimizer step on all ranks (tokens
for ``token_mean``, completions otherwise), so the split into micro-batches and ranks never changes a step.

Old log-probs (the sampling policy, for the importance ratio) are computed at sampling time when the policy moves
before the completions are used (several optimizer steps per rollout batch, or ``num_iterations`` > 1); otherwise
the ratio is exactly 1 in value and the current log-probs stand in for them (detached). With ``beta`` > 0 the
reference log-probs (adapters disabled) are computed at sampling time too.
"""

from __future__ import annotations

import torch

from llmtune.config import RecipeError
from llmtune.core.guard import ROW_KEY
from llmtune.rl.model import PolicyModel
from llmtune.rl.ops import kl_estimate, masked_mean
from llmtune.rl.rollout import decode_responses, join, trim
from llmtune.rl.trainer import OnlineRLTrainer
from llmtune.stages.grpo import ops


class GRPOTrainer(OnlineRLTrainer):
    """``OnlineRLTrainer`` whose micro-batches are groups of sampled completions (see the module docstring).

    Raises:
        RecipeError: the prompts of a rollout batch do not divide over the ranks.
        ModelLoadError: a reward run cannot be loaded.
        RewardFunctionError: a reward function cannot be imported or returns bad values.
    """

    score_name, length_name, per_source_eval = "reward", "completion_length", True

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
    def sample_groups(self, rows: list[dict]) -> dict:
        """``num_generations`` completions of each prompt row, scored: ``query_ids``/``query_mask`` (B, P),
        ``responses``/``mask`` (B, N), ``ended`` (B,), ``reward`` (B,) total, ``per_source`` {name: (B,)},
        ``rows`` (B prompt rows), ``engine_logps`` (B, N) or None (see ``OnlineRLTrainer.sample``), B = len(rows) x
        G, grouped consecutively."""
        G = self.grpo.num_generations
        rows = [row for row in rows for _ in range(G)]
        batch = self.prompt_batch(rows)
        responses, mask, ended, engine_logps = self.sample(batch)
        total, per_source = self.rewards.score(batch["input_ids"], batch["attention_mask"], responses, mask, rows)
        return {"query_ids": batch["input_ids"], "query_mask": batch["attention_mask"], "responses": responses,
                "mask": mask, "ended": ended, "reward": total, "per_source": per_source, "rows": rows,
                "engine_logps": engine_logps}

    def _extra_prompts(self, iteration: int, round_: int) -> list[dict]:
        """Dynamic sampling: this rank's share of a fresh random draw of prompts, seeded by (seed, iteration,
        round)."""
        gen = torch.Generator().manual_seed(self.args.seed + 1_000_003 * iteration + 104_729 * round_)
        picks = torch.randint(len(self.prompts), (self.local_prompts * self.args.world_size,), generator=gen).tolist()
        return [self.prompts[i] for i in picks[self.args.process_index::self.args.world_size]]

    def _resample(self, iteration: int, groups: dict) -> tuple[dict, int]:
        """DAPO dynamic sampling: replace groups whose rewards are all equal by informative groups of extra prompts,
        for up to ``max_resample_rounds`` rounds (every rank samples each round while any rank still needs to, so
        collective generation under ZeRO-3 stays in step). Returns the groups and the rounds run."""
        G, rounds = self.grpo.num_generations, 0
        for round_ in range(1, self.grpo.max_resample_rounds + 1):
            equal = _all_equal(groups["reward"], G)
            need = torch.tensor([float(equal.any())], device=self.args.device)
            if self.args.world_size > 1:
                need = self.accelerator.reduce(need, reduction="sum")
            if float(need) == 0:
                break
            rounds = round_
            extra = self.sample_groups(self._extra_prompts(iteration, round_))
            good = [g for g in range(extra["reward"].shape[0] // G) if not _all_equal(extra["reward"], G)[g]]
            bad = [g for g in range(equal.shape[0]) if equal[g]]
            swaps = list(zip(bad, good))
            if swaps:
                groups = _replace_groups(groups, extra, swaps, G, self.pad_id)
        return groups, rounds

    def make_experience(self, iteration: int) -> list[list[dict[str, torch.Tensor]]]:
        """Sample and score one rollout batch of groups, compute advantages, log its metrics and return the
        optimizer steps (``num_iterations`` shuffled passes), each a list of micro-batch dicts."""
        g, G = self.grpo, self.grpo.num_generations
        self._seed(iteration)
        rows = [self.prompts[i] for i in self.prompt_indices(iteration, self.local_prompts * self.args.world_size)]
        groups = self.sample_groups(rows)
        all_equal_first = _all_equal(groups["reward"], G)  # counted before any resampling
        rounds = 0
        if g.dynamic_sampling == "resample":
            groups, rounds = self._resample(iteration, groups)
        responses, mask, ended = groups["responses"], groups["mask"], groups["ended"]
        reward = groups["reward"].clone()
        if g.missing_eos_penalty is not None:
            reward = reward + g.missing_eos_penalty * (~ended).float()
        batch_std = None
        if g.scale_rewards == "batch":
            everything = self.accelerator.gather(reward) if self.args.world_size > 1 else reward
            batch_std = float(everything.std())
        advantages, all_equal = ops.group_advantages(reward, G, g.scale_rewards, batch_std)
        keep = torch.ones_like(reward, dtype=torch.bool)
        if g.dynamic_sampling != "off":
            keep &= ~all_equal.repeat_interleave(G)
        if g.mask_truncated_completions:
            keep &= ended
        loss_mask = mask * keep[:, None].long()

        width = groups["query_ids"].shape[1]
        inputs = join(groups["query_ids"], groups["query_mask"], responses, mask)
        experience = {**inputs, "responses": responses, "response_mask": mask, "loss_mask": loss_mask,
                      "advantages": advantages}
        if all("index" in row for row in groups["rows"]):  # (B,) prompt rows, named by the non-finite guard
            experience[ROW_KEY] = torch.tensor([int(r["index"]) for r in groups["rows"]], device=responses.device)
        kl_rollout, fwd = None, {}
        if self.needs_old_logps or g.beta > 0:
            fwd = self.forward_chunks(inputs, responses, with_values=False, reference=g.beta > 0,
                                      temperature=self.rollout.temperature, policy=True)
            if self.needs_old_logps:
                experience["old_logps"] = fwd["logps"] * mask
            if g.beta > 0:
                experience["ref_logps"] = fwd["ref_logps"] * mask
                kl_rollout = masked_mean(kl_estimate(fwd["logps"], fwd["ref_logps"], g.kl_estimator), mask.float())
        self.engine_correction(experience, inputs, responses, mask, groups["engine_logps"], fwd.get("logps"))

        self.add_metrics(self._rollout_metrics(groups, reward, all_equal_first, all_equal, keep, rounds, kl_rollout))
        if iteration % g.sample_every == 0:
            texts = decode_responses(self.tokenizer, responses, mask)
            self.write_samples(iteration, [
                {"prompt": groups["rows"][b]["prompt"], "completion": texts[b], "reward": float(reward[b]),
                 "rewards": {n: float(v[b]) for n, v in groups["per_source"].items()},
                 "advantage": float(advantages[b])} for b in range(min(len(texts), 2 * G))])

        steps = []
        gen = torch.Generator().manual_seed(self.args.seed + 1_000_003 * iteration + self.args.process_index)
        micro = self.args.per_device_train_batch_size
        n = responses.shape[0]
        for _ in range(g.num_iterations):
            order = torch.randperm(n, generator=gen)
            for start in range(0, n, self.local_minibatch):
                idx = order[start:start + self.local_minibatch]
                steps.append([trim(experience, idx[m:m + micro].to(responses.device), width)
                              for m in range(0, len(idx), micro)])
        return steps

    def _rollout_metrics(self, groups, reward, all_equal_first, all_equal, keep, rounds, kl) -> dict[str, float]:
        """Means over all ranks' completions of this iteration."""
        names = list(groups["per_source"])
        mask = groups["mask"]
        per_row = torch.stack([reward.float(), mask.sum(1).float(), (~groups["ended"]).float(), keep.float(),
                               *(groups["per_source"][n].float() for n in names)], 1)  # (B, 4 + sources)
        per_group = torch.stack([all_equal_first.float(), all_equal.float()], 1)  # (B/G, 2)
        if self.args.world_size > 1:
            per_row, per_group = self.accelerator.gather(per_row), self.accelerator.gather(per_group)
        metrics = {
            "reward_mean": float(per_row[:, 0].mean()), "reward_std": float(per_row[:, 0].std()),
            "completion_length": float(per_row[:, 1].mean()), "truncated_fraction": float(per_row[:, 2].mean()),
            "all_equal_group_fraction": float(per_group[:, 0].mean()),
            "trained_completion_fraction": float(per_row[:, 3].mean()),
        }
        for i, name in enumerate(names):
            metrics[f"rewards/{name}_mean"] = float(per_row[:, 4 + i].mean())
            metrics[f"rewards/{name}_std"] = float(per_row[:, 4 + i].std())
        if self.grpo.dynamic_sampling == "resample":
            metrics["all_equal_group_fraction_after_resampling"] = float(per_group[:, 1].mean())
            metrics["resample_rounds"] = float(rounds)
        if kl is not None:
            metrics["rollout_kl"] = float(kl)  # per token, sampling policy vs reference (0 before the first step)
        return metrics


def _all_equal(rewards: torch.Tensor, group: int) -> torch.Tensor:
    grouped = rewards.view(-1, group)
    return (grouped == grouped[:, :1]).all(1)


def _pad_to(x: torch.Tensor, width: int, value: int, left: bool) -> torch.Tensor:
    pad = torch.full((x.shape[0], width - x.shape[1]), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if left else [x, pad], 1)


def _replace_groups(groups: dict, extra: dict, swaps: list[tuple[int, int]], G: int, pad_id: int) -> dict:
    """``groups`` with group ``bad`` replaced by ``extra``'s group ``good`` for each ``(bad, good)``; prompts are
    re-padded on the left and completions on the right to the wider of the two batches."""
    P = max(groups["query_ids"].shape[1], extra["query_ids"].shape[1])
    N = max(groups["responses"].shape[1], extra["responses"].shape[1])
    out = {"per_source": {}, "rows": list(groups["rows"]), "engine_logps": None}
    layout = {"query_ids": (P, pad_id, True), "query_mask": (P, 0, True), "responses": (N, pad_id, False),
              "mask": (N, 0, False)}
    if groups.get("engine_logps") is not None and extra.get("engine_logps") is not None:
        layout["engine_logps"] = (N, 0.0, False)
    for key, (width, value, left) in layout.items():
        a, b = _pad_to(groups[key], width, value, left), _pad_to(extra[key], width, value, left)
        out[key] = _swap_rows(a, b, swaps, G)
    for key in ("ended", "reward"):
        out[key] = _swap_rows(groups[key], extra[key], swaps, G)
    for name in groups["per_source"]:
        out["per_source"][name] = _swap_rows(groups["per_source"][name], extra["per_source"][name], swaps, G)
    for bad, good in swaps:
        out["rows"][bad * G:(bad + 1) * G] = extra["rows"][good * G:(good + 1) * G]
    return out


def _swap_rows(a: torch.Tensor, b: torch.Tensor, swaps: list[tuple[int, int]], G: int) -> torch.Tensor:
    a = a.clone()
    for bad, good in swaps:
        a[bad * G:(bad + 1) * G] = b[good * G:(good + 1) * G]
    return a
