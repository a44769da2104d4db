"""The online-RL trainer shared by PPO and GRPO: rollouts feed transformers' own training loop.

Everything around the optimizer step is ``transformers.Trainer``'s (optimizer, schedule, clipping, DDP/DeepSpeed
no-sync and accumulation, fp16/bf16, logging, callbacks, checkpoints with optimizer/scheduler state): the trainer's
dataloader only counts optimizer steps (:class:`_StepSlots`), and :meth:`OnlineRLTrainer.get_batch_samples` hands the
loop the micro-batches of the next optimizer step instead of dataloader rows, running one iteration
(:func:`llmtune.rl.iteration.run_iteration`: sync -> sample -> score -> experience -> train, top to bottom) when the
last one is used up. Gradient accumulation is exact as in the other stages: the loss of a micro-batch is its sum
divided by the stage's item count of the whole optimizer step over all ranks
(:meth:`CoreTrainer._get_num_items_in_batch`).

What the trainer builds (and nothing else calls back into it): the rollout side (:class:`llmtune.rl.rollouts.Rollouts`:
the engine of :func:`llmtune.rl.engines.build_engine`, built from the policy, the agent loop, the background sampler),
the rewards (:class:`llmtune.rewards.shaping.Rewards`), the stage's algorithm (:class:`llmtune.rl.iteration.Algorithm`)
and the :class:`~llmtune.rl.iteration.Loop` an iteration reads; around them, what belongs to transformers' loop: the
greedy evaluation, sample logs, adapter checkpoints, and the time split between generation and training.

Resume: a checkpoint is only written at the end of an iteration (one rollout batch; save_steps is a multiple of
it), so a resumed run starts with a fresh rollout. Sampling, dropout and minibatch order are seeded from (seed,
iteration, rank), not from the RNG state saved in the checkpoint, so a resumed run draws exactly what the
uninterrupted run drew.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from llmtune.core.rundir import SAMPLES
from llmtune.core.trainer import CoreTrainer
from llmtune.data.prompts import PromptCollator
from llmtune.data.templates import stop_token_ids
from llmtune.rewards.shaping import Rewards, shaping_from_recipe
from llmtune.rewards.sources import build_reward_sources
from llmtune.rl.engines import EngineSite, Policy, build_engine, sampling_from_recipe
from llmtune.rl.iteration import Loop, run_iteration
from llmtune.rl.model import POLICY
from llmtune.rl.rollouts import Ranks, Rollouts, build_agent_loop, conversation_fields
from llmtune.utils import get_logger

log = get_logger("rl")


def _number(x: torch.Tensor) -> float | None:
    """A score for the sample logs: None where every reward function abstained (JSON has no NaN)."""
    value = float(x)
    return None if value != value else value


class _StepSlots(torch.utils.data.Dataset):
    """What the trainer's dataloader iterates over: one item per (optimizer step x sample), nothing else. It only
    gives transformers' loop its length (max_steps x global batch); the rows come from the rollouts."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _slot_collate(items: list[int]) -> dict[str, torch.Tensor]:
    return {"slot": torch.tensor(items)}


class OnlineRLTrainer(CoreTrainer):
    """``CoreTrainer`` whose micro-batches come from rollouts; a stage subclass implements :meth:`build_model` and
    :meth:`build_algorithm` (its :class:`~llmtune.rl.iteration.Algorithm`, which sets ``steps_per_iteration``).

    Constructed by the runner like every stage trainer: ``train_dataset``/``eval_dataset`` are prompt rows
    (``llmtune.data.prompts``), ``data_collator`` left-pads them, ``model`` is the peft policy (adapter ``default``).
    ``recipe.rollout`` supplies the sampling settings (``temperature``/``top_p``/``top_k``, ``max_new_tokens``,
    ``eval_max_new_tokens``) and the engine; the stage's section (``recipe.<stage name>``) ``sample_every``.

    Raises:
        ValueError: the tokenizer has no way to end a completion (no EOS, no end-of-turn token).
        ModelLoadError: a reward run cannot be loaded.
        RewardFunctionError: a reward function cannot be imported or returns bad values.
        RecipeError: ``rollout.max_staleness`` that cannot work (an hf engine, less than one iteration).
    """

    flops_tokens_key = "train_tokens_per_s"  # model FLOPs / MFU of the optimizer steps over their own time
    score_name, length_name, per_source_eval = "score", "response_length", False  # eval metric names
    kl_per_token = False  # eval_kl in the unit of the stage's training `kl`: per response (PPO) or per token (GRPO)

    def __init__(self, *positional, stage, model, train_dataset, eval_dataset=None, data_collator=None,
                 processing_class=None, **kwargs):
        recipe = stage.recipe
        self.cfg = getattr(recipe, stage.name)
        self.rollout = recipe.rollout  # sampling settings and the rollout engine (shared by PPO and GRPO)
        self.tokenizer = processing_class
        self.prompts, self.eval_prompts = train_dataset, eval_dataset
        # THE stop set (tokenizer EOS, template end of turn, the model's generation-config EOS list): every engine
        # stops on these ids and nothing else
        self.stop_ids = stop_token_ids(processing_class, getattr(model, "generation_config", None))
        if not self.stop_ids:
            raise ValueError("the tokenizer has no EOS token and its chat template ends turns with no special token: "
                             "responses could never end; set the tokenizer's eos_token (or data.chat_template)")
        self.pad_id = PromptCollator(processing_class).pad_token_id  # prompts left-, completions right-padded
        args = kwargs.pop("args")
        self.algorithm = self.build_algorithm(recipe, train_dataset, args)
        self.steps_per_iteration = self.algorithm.steps_per_iteration
        self._buffer: list[list[dict[str, torch.Tensor]]] = []
        self._rollout_s = 0.0  # seconds spent making experience since the last log (not training)
        self._iteration_start: float | None = None  # when the current iteration started (its rollout batch)
        self._eval_s = 0.0  # seconds of evaluation since then
        self.agent_tools = stage.agent_tools()  # multi-turn tools, or None
        environment = self.agent_tools.environment if self.agent_tools else None
        sources = build_reward_sources(recipe.reward, processing_class, recipe_dir=stage.recipe_dir,
                                       precision=recipe.precision,
                                       environment_weight=recipe.agent.environment_reward_weight
                                       if environment is not None and hasattr(environment, "reward") else None,
                                       multi_turn=recipe.agent.enabled)
        self.rewards = Rewards(sources, shaping_from_recipe(recipe), processing_class)
        wrapped = self.build_model(model, recipe)
        args.metric_for_best_model = None  # evaluated by generation: there is no eval_loss to track
        slots = _StepSlots((recipe.train.max_steps or 0) * recipe.train.global_batch_size)
        super().__init__(*positional, stage=stage, model=wrapped, args=args, train_dataset=slots,
                         eval_dataset=eval_dataset, data_collator=_slot_collate, processing_class=processing_class,
                         **kwargs)
        sources.to(self.args.device)
        a = self.args
        reduce = (lambda x: self.accelerator.reduce(x, reduction="sum")) if a.world_size > 1 else (lambda x: x)
        gather = self.accelerator.gather if a.world_size > 1 else (lambda x: x)
        self.ranks = Ranks(a.process_index, a.world_size, a.seed, a.device, reduce, gather)
        self.rollouts = self._build_rollouts(recipe)
        self.loop = Loop(self.rollouts, self.rewards, self.model, self.ranks, lambda: self.state.global_step,
                         self.add_metrics, self.write_samples, self.rollout.temperature,
                         a.per_device_eval_batch_size, recipe.train.global_batch_size // a.world_size,
                         a.per_device_train_batch_size, a.seed if self.rollout.seed is None else self.rollout.seed,
                         self.compute_loss_context_manager, self.rollout.vllm.importance_sampling_correction,
                         self.rollout.vllm.importance_sampling_cap)

    def _build_rollouts(self, recipe) -> Rollouts:
        """The rollout side: the engine (hf or vLLM, built from the policy and where it runs), the multi-turn loop of
        ``agent:``, and with ``rollout.max_staleness`` > 0 the background sampler ``max_staleness //
        steps_per_iteration`` iterations ahead.

        Raises:
            RecipeError: ``max_staleness`` with an engine that samples on the training model (hf: nothing to
                overlap), or below one iteration's optimizer steps (no whole rollout batch could be sampled ahead).
        """
        from llmtune.config import RecipeError

        policy = Policy(self.accelerator.unwrap_model(self.model).policy, POLICY, lambda: self.state.global_step,
                        self.args.device, self._generation_model, can_merge=self._can_merge())
        site = EngineSite(self.run_dir, self.args.process_index, self.args.world_size, self.args.device)
        engine = build_engine(recipe, policy, site, self.pad_id)
        bound, spi = self.rollout.max_staleness, self.steps_per_iteration
        try:
            if bound and bound < spi:
                name = self.cfg.__class__.__name__.removesuffix("Config").lower()
                raise RecipeError([("rollout.max_staleness", f"{bound} optimizer steps is less than one iteration "
                                    f"({spi} steps: {name} rollout batch / train.global_batch_size x its passes): a "
                                    f"batch sampled one iteration ahead is {spi} steps stale. Set it to 0 or >= "
                                    f"{spi} (a multiple of {spi}: {spi} = one iteration ahead)")])
            agent = (build_agent_loop(recipe, engine, self.tokenizer, self.agent_tools, self.stop_ids)
                     if self.agent_tools else None)
            return Rollouts(engine, agent, sampling_from_recipe(recipe, self.stop_ids),
                            sampling_from_recipe(recipe, self.stop_ids, greedy=True), self.algorithm.rollout_rows,
                            self.args.seed if self.rollout.seed is None else self.rollout.seed, self.pad_id,
                            self.ranks, self.add_metrics, self.model, max_staleness=bound,
                            lookahead=bound // spi if bound else 0,
                            iterations=-(-(self.args.max_steps or 0) // spi))
        except BaseException:
            engine.close()
            raise

    @contextlib.contextmanager
    def _generation_model(self):
        """The peft policy ready to ``generate``: under DeepSpeed ZeRO-3 its gathered weights
        (``trl.models.utils.unwrap_model_for_generation``), in the trainer's autocast."""
        from trl.models.utils import unwrap_model_for_generation

        with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as unwrapped, \
                self.compute_loss_context_manager():
            yield unwrapped.policy

    def _can_merge(self) -> bool:
        """Merging the adapter for sampling swaps parameter tensors in place: not under ZeRO-3 (partitioned,
        gathered only for generation) or FSDP (sharded flat parameters)."""
        if getattr(self, "is_fsdp_enabled", False):
            return False
        if getattr(self, "is_deepspeed_enabled", False):
            plugin = self.accelerator.state.deepspeed_plugin
            return plugin is None or plugin.zero_stage != 3
        return True

    # ---- what a stage supplies ------------------------------------------------------------------
    def build_model(self, policy, recipe) -> torch.nn.Module:
        """The module trained (a :class:`~llmtune.rl.model.PolicyModel` or a subclass) around the peft policy."""
        raise NotImplementedError

    def build_algorithm(self, recipe, prompts, args):
        """The stage's :class:`~llmtune.rl.iteration.Algorithm` (with ``steps_per_iteration``: optimizer steps per
        rollout batch), from the recipe, the prompt rows and the training arguments (``seed``, ``process_index``,
        ``world_size``: called before transformers' constructor)."""
        raise NotImplementedError

    @property
    def run_dir(self) -> Path:
        return Path(self.args.output_dir).parent

    # ---- the dataloader only counts steps ---------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def _load_rng_state(self, checkpoint):
        """Not restored: every iteration seeds sampling, dropout and minibatch order from (seed, iteration, rank),
        so a resumed run already draws what the uninterrupted run drew."""
        return

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The micro-batches of the next optimizer step and its item count (all micro-batches, all ranks); a new
        iteration (:func:`~llmtune.rl.iteration.run_iteration`) when the last rollout batch is used up. Every
        iteration logs ``iteration_s`` (wall seconds of the previous one, sampling + training, evaluations
        excluded)."""
        for _ in range(num_batches):  # keep the step-counting dataloader in step with the loop
            try:
                next(epoch_iterator)
            except StopIteration:
                break
        if not self._buffer:
            start = time.perf_counter()
            if self._iteration_start is not None:  # the previous iteration, sampling + training, evaluations excluded
                self.add_metrics({"iteration_s": start - self._iteration_start - self._eval_s})
            self._iteration_start, self._eval_s = start, 0.0
            self._buffer = run_iteration(self.loop, self.algorithm, self.state.global_step // self.steps_per_iteration)
            self._rollout_s += time.perf_counter() - start
        micro_batches = self._buffer.pop(0)
        return micro_batches, self._get_num_items_in_batch(micro_batches, device)

    def close(self) -> None:
        """Free the rollout engine and the background sampler (the runner calls this when the stage ends, also on
        errors)."""
        rollouts = getattr(self, "rollouts", None)
        if rollouts is not None:
            rollouts.close()

    def add_metrics(self, metrics: dict[str, float]) -> None:
        """Add metrics to the next training log (averaged with the other values logged until then, all ranks)."""
        for key, value in metrics.items():
            self._metric_sums[key] += float(value)
            self._metric_counts[key] += 1

    def write_samples(self, iteration: int, records: list[dict]) -> None:
        """Append a few rollout records (prompt, completion, rewards ...) to ``samples.jsonl`` (main process)."""
        if not self.is_world_process_zero():
            return
        with (self.run_dir / SAMPLES).open("a") as f:
            for record in records:
                f.write(json.dumps({"step": self.state.global_step, "iteration": iteration, **record}) + "\n")

    # ---- logging: generation and training time apart --------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Training logs also carry ``train_tokens_per_s`` (tokens through forward/backward per second of the
        optimizer steps, rollouts excluded; all ranks) and ``generation_share`` (fraction of the wall time since
        the last log spent sampling)."""
        if "loss" in logs:
            elapsed = max(time.perf_counter() - self._last_log_time, 1e-9)
            seen = self.seen_tokens * self.args.world_size
            logs["train_tokens_per_s"] = (seen - self._last_log_tokens) / max(elapsed - self._rollout_s, 1e-9)
            logs["generation_share"] = min(self.rollouts.generation_s / elapsed, 1.0)
            self._rollout_s = self.rollouts.generation_s = 0.0
        super().log(logs, start_time)

    # ---- evaluation: greedy responses to held-out prompts ------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Greedy responses to the held-out prompts (sharded over ranks), scored like the rollouts.

        Returns (and logs), with ``<score>``/``<length>`` the stage's names (PPO: ``score``/``response_length``,
        GRPO: ``reward``/``completion_length``): ``eval_<score>`` (mean weighted reward), ``eval_<score>_std``,
        ``eval_rewards/<source>`` (each source's mean, GRPO), ``eval_kl`` (the exact KL(policy || reference) over
        the response tokens of the greedy path, nats, in the unit of the stage's training ``kl``: summed per response
        and averaged over responses for PPO, averaged over all response tokens for GRPO (``kl_per_token``)), ``eval_<length>`` (tokens),
        ``eval_truncated_fraction``, ``eval_prompts``. The reward is the task reward (the sources and an environment's
        per-turn rewards), without any shaping term (:mod:`llmtune.rewards.shaping`).
        """
        rows_all = eval_dataset if eval_dataset is not None else self.eval_prompts
        if rows_all is None or len(rows_all) == 0:
            return {}
        eval_start = time.perf_counter()
        self.rollouts.drain()  # the engine is the background sampler's until it is done
        self.rollouts.engine.sync(self.state.global_step)  # greedy answers of the policy of this step
        indices = list(range(len(rows_all)))[self.args.process_index::self.args.world_size]
        size = self.args.per_device_eval_batch_size
        per_row, samples = [], []
        names = self.rewards.names
        from tqdm.auto import tqdm

        progress = tqdm(total=len(indices), desc="eval: greedy responses", unit="prompt", leave=False,
                        disable=not self.is_world_process_zero() or self.args.disable_tqdm)
        for start in range(0, len(indices), size):
            rows = [rows_all[i] for i in indices[start:start + size]]
            batch = self.rollouts.sample(rows, greedy=True)
            fwd = self.loop.forward(batch, reference=True, exact_kl=True, temperature=1.0)
            result = self.rewards.score(batch, self.args.device)
            total, per_source = result.task, result.per_source
            mask = batch.completion_mask
            kl = (fwd.kl_exact * batch.loss_mask).sum(1)  # over the policy's tokens (not a tool result's)
            per_row.append(torch.stack([total.to(kl.device), kl, mask.sum(1).float(), (~batch.ended).float(),
                                        batch.loss_mask.sum(1).float(),
                                        *(per_source[n].to(kl.device) for n in names)], 1))
            progress.update(len(rows))
            if len(samples) < 8:
                for b, (row, text) in enumerate(zip(rows, result.completions)):
                    samples.append({"prompt": row["prompt"], "response": text, "score": _number(total[b]),
                                    **({"rewards": {n: _number(per_source[n][b]) for n in names}}
                                       if self.per_source_eval else {}),
                                    **conversation_fields(batch.trajectories[b])})
        progress.close()
        stats = torch.cat(per_row) if per_row else torch.zeros(0, 5 + len(names), device=self.args.device)
        if self.args.world_size > 1:
            stats = self.accelerator.gather_for_metrics(stats)
        score, kl, length, truncated, sampled = stats[:, :5].T
        p, s = metric_key_prefix, self.score_name
        scored = score[~torch.isnan(score)]  # rows on which every reward function abstained have no score
        # a mean over no rows is left out (and said), never logged as NaN: metrics.jsonl stays valid JSON and a
        # missing number cannot be read as a measured one
        metrics = {}
        if len(scored):
            metrics[f"{p}_{s}"] = float(scored.mean())
            metrics[f"{p}_{s}_std"] = float(scored.std()) if len(scored) > 1 else 0.0
        else:
            log.warning("every reward function abstained on all %d eval prompts: no %s_%s at step %d",
                        len(score), p, s, self.state.global_step)
        if self.per_source_eval:
            for i, n in enumerate(names):
                column = stats[:, 5 + i]
                if (~torch.isnan(column)).any():
                    metrics[f"{p}_rewards/{n}"] = float(column.nanmean())
        metrics.update({
            f"{p}_kl": float(kl.sum() / sampled.sum().clamp(min=1)) if self.kl_per_token else float(kl.mean()),
            f"{p}_{self.length_name}": float(length.mean()),
            f"{p}_truncated_fraction": float(truncated.mean()),
            f"{p}_prompts": float(len(score)),
        })
        if len(scored) < len(score):
            metrics[f"{p}_rewards/abstained"] = 1.0 - len(scored) / len(score)
        if self.is_world_process_zero():
            path = self.run_dir / f"eval_samples_step{self.state.global_step}.jsonl"
            path.write_text("".join(json.dumps(s) + "\n" for s in samples[:8]))
        self._eval_s += time.perf_counter() - eval_start
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ---- checkpoints: the policy adapter (never the frozen base) ------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the policy adapter (peft layout) and the stage's extras (:meth:`save_extra`). ``state_dict``
        (gathered by transformers under ZeRO-3) has the wrapper's ``policy.`` prefix."""
        out = Path(output_dir or self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        policy_sd = None if state_dict is None else {
            k[len("policy."):]: v for k, v in state_dict.items() if k.startswith("policy.")}
        model.policy.save_pretrained(str(out), state_dict=policy_sd, safe_serialization=True)
        self.save_extra(out, model, state_dict)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(str(out))

    def save_extra(self, out: Path, model, state_dict: dict | None) -> None:
        """What a stage saves beside the policy adapter (PPO: its value model); default nothing."""

    def save_extra_state(self, checkpoint: Path) -> None:
        """With rollouts sampled ahead: the adapters of the batches submitted but not yet trained on
        (:func:`llmtune.rl.prefetch.save_snapshots`), so that a run resumed here samples them again identically."""
        if self.rollouts.prefetch is not None:
            from llmtune.rl.prefetch import save_snapshots

            save_snapshots(checkpoint, self.rollouts.prefetch.untaken())

    def load_counters(self, checkpoint) -> None:
        super().load_counters(checkpoint)
        if self.rollouts.prefetch is not None:
            from llmtune.rl.prefetch import load_snapshots

            self.rollouts.prefetch.restore(load_snapshots(Path(checkpoint)))

    def can_stop_here(self) -> bool:
        """A signal stops online RL only at the end of an iteration (PPO, GRPO): a checkpoint inside one would lose
        the rest of its rollout batch."""
        return self.state.global_step % self.steps_per_iteration == 0

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(self.accelerator.unwrap_model(self.model).policy,
                                  load_file(str(Path(resume_from_checkpoint) / "adapter_model.safetensors")),
                                  adapter_name="default")
