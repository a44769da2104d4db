"""The one trainer core every stage runs on: ``transformers.Trainer`` with a stage's loss.

We keep transformers' machinery (optimizer, schedules, fp16/bf16, DeepSpeed, gradient accumulation,
checkpoint/resume with RNG and data position, callbacks, TensorBoard) and own three things:

* exact accumulation — the step loss is the stage loss summed over micro-batches divided by the
  item count of the WHOLE optimizer step across all ranks (``Stage.count_items``), so 8x1, 2x4 and
  1x8 give the same gradients (transformers #34191);
* token-weighted evaluation — per-sample sums are gathered and reduced by the stage
  (``Stage.eval_metrics``), not averaged batch by batch;
* extra training metrics — trained tokens, tokens/s, peak memory and the stage's own metrics.

Units: ``global_batch_size`` samples per optimizer step over all ranks; ``micro_batch_size``
samples per rank per forward; accumulation = global / (micro * world_size).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import EarlyStoppingCallback, Trainer, TrainingArguments
from transformers.trainer_pt_utils import LengthGroupedSampler

from llmtune.config import Recipe
from llmtune.core.distributed import batch_layout
from llmtune.core.guard import NonFiniteGuard
from llmtune.core.memory import peak_memory_gb
from llmtune.core.recompute import recompute_cheap_activations
from llmtune.core.schedule import SCHEDULERS, apply_schedule_lr, build_scheduler
from llmtune.core.stage import Stage


def build_training_args(recipe: Recipe, run_dir: Path, has_eval: bool,
                        resuming: bool | None = None) -> TrainingArguments:
    """Translate a recipe into ``TrainingArguments`` (checkpoints go to ``run_dir/checkpoints``).

    ``resuming``: whether a checkpoint is resumed from (default: ``train.resume_from`` names one explicitly).
    """
    if resuming is None:
        resuming = recipe.train.resume_from not in (None, "auto")
    t, p = recipe.train, recipe.precision
    warmup: float = t.warmup_steps if t.warmup_steps else t.warmup_ratio
    if recipe.output.report_to:  # transformers >= 5 reads the TensorBoard directory from the environment
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(run_dir / "tensorboard")
    from llmtune.core.distributed import deepspeed_config, process_setup_kwargs

    deepspeed = deepspeed_config(recipe)  # None, or a fresh dict whose "auto" values transformers fills
    sampling = {}
    if t.group_by_length:  # transformers >= 5 names it train_sampling_strategy; older ones group_by_length
        fields = TrainingArguments.__dataclass_fields__
        sampling = ({"train_sampling_strategy": "group_by_length"} if "train_sampling_strategy" in fields
                    else {"group_by_length": True})
    setup = process_setup_kwargs(recipe)  # multi-process CPU runs (gloo); nothing on GPUs
    if p.bf16 and not torch.cuda.is_available():  # transformers refuses bf16 without a GPU unless told to use the CPU
        setup.setdefault("use_cpu", True)  # (torch autocasts to bf16 on CPUs; llmtune's check_precision advises it)
    return TrainingArguments(
        **sampling,
        **setup,
        output_dir=str(run_dir / "checkpoints"),
        per_device_train_batch_size=t.micro_batch_size,
        per_device_eval_batch_size=t.eval_batch_size or t.micro_batch_size,
        gradient_accumulation_steps=batch_layout(recipe)["accumulation_steps"],
        num_train_epochs=t.num_epochs,
        max_steps=t.max_steps or -1,
        learning_rate=t.learning_rate,
        lr_scheduler_type=SCHEDULERS[t.lr_scheduler],
        lr_scheduler_kwargs=dict(t.lr_scheduler_kwargs),
        warmup_steps=warmup,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_epsilon,
        max_grad_norm=t.max_grad_norm,
        optim=t.optim,
        seed=t.seed,
        data_seed=t.seed,
        bf16=p.bf16,
        fp16=p.fp16,
        tf32=p.tf32 if torch.cuda.is_available() else None,
        eval_strategy="steps" if (has_eval and t.eval_steps) else "no",
        # DeepSpeed: transformers cannot evaluate before train() builds the engine, so the baseline eval runs in it
        eval_on_start=bool(deepspeed) and has_eval and t.eval_at_start and not resuming,
        eval_steps=t.eval_steps,
        metric_for_best_model="eval_loss" if has_eval else None,
        greater_is_better=False if has_eval else None,
        save_strategy="steps" if t.save_steps else "no",
        save_steps=t.save_steps or 500,
        save_total_limit=t.save_total_limit,
        logging_steps=t.logging_steps,
        logging_nan_inf_filter=False,  # never hide a NaN loss; llmtune.core.guard skips and reports such steps
        report_to=list(recipe.output.report_to) or "none",
        remove_unused_columns=False,
        dataloader_num_workers=t.dataloader_num_workers,
        dataloader_pin_memory=torch.cuda.is_available(),
        ddp_find_unused_parameters=False,
        average_tokens_across_devices=True,
        deepspeed=deepspeed,
        gradient_checkpointing=False,  # enabled (non-reentrant) by the model helpers, never here
        disable_tqdm=False,
        label_names=["labels"],
        **dict(t.extra_args),  # validated: only fields llmtune does not set (llmtune.config.surface)
    )


class CoreTrainer(NonFiniteGuard, Trainer):
    """``transformers.Trainer`` driven by a :class:`~llmtune.core.stage.Stage`.

    Optimizer steps with a non-finite loss or gradient norm are skipped and counted
    (:class:`~llmtune.core.guard.NonFiniteGuard`; ``train.max_nonfinite_steps`` in a row stop the run).

    Args:
        stage: supplies ``count_items``, ``loss``, ``eval_stats`` and ``eval_metrics``.
        **kwargs: passed to ``transformers.Trainer`` (model, args, datasets, collator, callbacks...).
    """

    # Our stage losses are already divided by the step's item count: Trainer must not divide again.
    loss_is_scaled_for_ga = True

    def __init__(self, *args, stage: Stage, **kwargs):
        self.stage = stage
        self._metric_sums: dict[str, float] = defaultdict(float)
        self._metric_counts: dict[str, int] = defaultdict(int)
        self.trained_tokens = 0  # items (Stage.item_unit: tokens for SFT, pairs for RM/DPO), all ranks, this process
        self.seen_tokens = 0  # all non-pad tokens on this rank
        self._last_log_time = time.perf_counter()
        self._last_log_tokens = 0
        self.max_nonfinite_steps = stage.recipe.train.max_nonfinite_steps
        self._guard_state()
        self._window_rows = 0  # sequences since the last log on this rank (mean sequence length for the FLOPs)
        self._window_tokens = 0
        super().__init__(*args, compute_metrics=self._compute_metrics, **kwargs)
        # Older transformers decide "already scaled" from this flag instead of `loss_is_scaled_for_ga`.
        self.model_accepts_loss_kwargs = True

    # ---- counters that survive a resume ---------------------------------------------------------
    COUNTERS = "llmtune_counters.json"

    _staging_root: Path | None = None  # set while a checkpoint is being written (see _save_checkpoint)
    checkpoint_estimate: dict[str, int] | None = None  # bytes per checkpoint (llmtune.core.checkpoint), for messages

    def _get_output_dir(self, trial) -> str:
        return str(self._staging_root) if self._staging_root is not None else super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        """transformers' checkpoint, written crash-safe (:mod:`llmtune.core.checkpoint`): every rank writes into
        ``checkpoints/.tmp/checkpoint-N``, rank 0 adds the counters and the stage's extra state, then (once every rank
        has written) every rank fsyncs the files, and rank 0 adds the completeness marker, renames it to
        ``checkpoints/checkpoint-N`` and rotates (complete ones only).

        Raises:
            CheckpointSaveError: a rank could not write its files (disk full, I/O error): the staged directory is
                removed, the previous checkpoint is untouched (exit code 5).
        """
        import json

        from llmtune.core import checkpoint as ck

        root = Path(super()._get_output_dir(trial))
        final = root / f"checkpoint-{self.state.global_step}"
        staging = root / ck.STAGING
        staged = staging / final.name
        if self.is_world_process_zero():
            ck.clean_staging(root)  # what a killed save or deletion left: ours, unfinished
        self.accelerator.wait_for_everyone()
        failure: OSError | None = None
        best_before = self.state.best_model_checkpoint
        try:
            self._staging_root = staging
            super()._save_checkpoint(model, trial)
        except OSError as exc:
            failure = exc
        finally:
            self._staging_root = None
        if failure is None and self.is_world_process_zero():
            try:
                if self.state.best_model_checkpoint and Path(self.state.best_model_checkpoint) == staged:
                    self.state.best_model_checkpoint = str(final)  # the path it will have
                    self.state.save_to_json(str(staged / ck.TRAINER_STATE))
                elif self.state.best_model_checkpoint != best_before:
                    self.state.best_model_checkpoint = best_before
                (staged / self.COUNTERS).write_text(json.dumps({"trained": self.trained_tokens,
                                                                 "seen": self.seen_tokens,
                                                                 "nonfinite": self.nonfinite_steps}))
                self.save_extra_state(staged)
                if (staged / "adapter_config.json").is_file():  # every saved adapter is checked (DeepSpeed #4295)
                    from llmtune.models.verify import verify_saved_adapter

                    verify_saved_adapter(staged, self.model)
            except OSError as exc:
                failure = exc
        # fsync only once every rank has written: a rank walking the tree while another still writes into it
        # (rank 0's transformers files and extra state) can list a file that is gone when it opens it (ENOENT).
        # all_ranks_agree is the barrier.
        if all_ranks_agree(self, failure is None):
            try:
                ck.fsync_tree(staged)
            except OSError as exc:
                failure = exc
        if not all_ranks_agree(self, failure is None):
            if self.is_world_process_zero():
                ck.remove_staged(staged)
            previous = ck.newest_complete(root, report=False)
            raise ck.CheckpointSaveError(ck.save_failed_message(
                f"checkpoint {final.name}", failure or OSError("another rank failed to write its files"), root,
                self.checkpoint_estimate, previous)) from None
        if self.is_world_process_zero():
            ck.write_marker(staged, self.state.global_step, {"world_size": self.args.world_size})
            ck.commit(staged, final)
            ck.rotate(root, self.args.save_total_limit, keep=[self.state.best_model_checkpoint])
        self.accelerator.wait_for_everyone()

    def save_extra_state(self, checkpoint: Path) -> None:
        """Write a stage's own resumable state into the checkpoint being saved (rank 0; before it is committed)."""

    def can_stop_here(self) -> bool:
        """Whether a signal may stop training after the current optimizer step (every step; PPO: iteration ends)."""
        return True

    def load_counters(self, checkpoint: str | Path) -> None:
        """Restore the cumulative trained/seen counts saved with a checkpoint (0 if it has none)."""
        import json

        path = Path(checkpoint) / self.COUNTERS
        counters = json.loads(path.read_text()) if path.is_file() else {}
        self.trained_tokens = int(counters.get("trained", 0))
        self.seen_tokens = int(counters.get("seen", 0))
        self.nonfinite_steps = int(counters.get("nonfinite", 0))
        self._last_log_tokens = self.seen_tokens * self.args.world_size

    def train(self, *args, **kwargs):
        self._last_log_time = time.perf_counter()  # throughput counts training time, not loading or eval
        skipped_before = self.nonfinite_steps
        result = super().train(*args, **kwargs)
        skipped = self.nonfinite_steps - skipped_before
        steps = self.state.global_step - getattr(self, "_initial_global_step", 0)
        if skipped and steps > skipped:  # transformers averages over all steps; skipped ones added no loss
            result = result._replace(training_loss=result.training_loss * steps / (steps - skipped))
        return result

    def evaluate(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return super().evaluate(*args, **kwargs)
        finally:  # evaluations inside train() (eval_steps, eval_on_start) do not count as training time
            self._last_log_time += time.perf_counter() - start

    # ---- schedule (llmtune.core.schedule) ----------------------------------------------------------
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """transformers' schedule over ``num_training_steps`` optimizer steps, with the exact warm-up length."""
        if self.lr_scheduler is None:
            optimizer = optimizer if optimizer is not None else self.optimizer
            self.lr_scheduler = build_scheduler(self.stage.recipe.train, optimizer, num_training_steps)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _load_optimizer_and_scheduler(self, checkpoint):
        """Load the checkpoint's optimizer and scheduler state, then put the optimizer at the LR the (possibly
        longer) schedule of this run has at the resumed step: the checkpoint holds the interrupted schedule's."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            apply_schedule_lr(self.lr_scheduler)

    # ---- training -------------------------------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        """transformers' sampler, except that length grouping is seeded per epoch so that a resumed run
        replays exactly the order of the interrupted one (the stock LengthGroupedSampler draws from the
        global RNG, so a resume would skip some rows and repeat others)."""
        sampler = super()._get_train_sampler(train_dataset)
        if isinstance(sampler, LengthGroupedSampler):
            # Groups sized by the GLOBAL batch: accelerate deals consecutive micro-batches of this one order out to
            # the ranks, so every optimizer step holds the same rows whatever the number of processes.
            per_rank_step = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
            sampler = SeededLengthGroupedSampler.wrap(sampler, seed=self.args.data_seed or self.args.seed,
                                                      batch_size=per_rank_step * self.args.world_size)
        return sampler

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device) -> torch.Tensor:
        """Items of the whole optimizer step: summed over its micro-batches and over all ranks (and the stage's
        once-per-step statistics, :meth:`Stage.prepare_step`)."""
        self.stage.prepare_step(self, batch_samples)
        count = sum(self.stage.count_items(b).to(device) for b in batch_samples)
        count = torch.as_tensor(count, device=device)
        if self.args.world_size > 1:
            count = self.accelerator.gather(count.reshape(1)).sum()
        self.trained_tokens += round(float(count))  # a fraction when rows are shares of a rollout (GRPO segments)
        seen = sum(  # packed batches carry no attention_mask: every position is a real token
            int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel() for b in batch_samples
        )
        self.seen_tokens += seen
        self._window_tokens += seen
        self._window_rows += sum(  # padding-free SFT: the rows of a (1, L) sequence are numbered by row_index
            int(b["row_index"].max()) + 1 if "row_index" in b else b["input_ids"].shape[0] for b in batch_samples)
        return count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Stage loss of one micro-batch, normalised by the step's item count (all ranks).

        DDP/DeepSpeed average gradients over ranks, so the per-rank loss is multiplied by the world
        size to turn that average back into the sum over ranks divided by the global item count.
        """
        if num_items_in_batch is None:  # outside the training loop
            num_items_in_batch = self.stage.count_items(inputs)
        with recompute_cheap_activations() if model.training else contextlib.nullcontext():
            loss, metrics = self.stage.loss(model, inputs, num_items_in_batch.clamp(min=1))
        if model.training:
            for key, value in metrics.items():
                self._metric_sums[key] += float(value)
                self._metric_counts[key] += 1
        if self.args.world_size > 1 and model.training:
            loss = loss * self.args.world_size
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add trained tokens, throughput, peak memory and stage metrics to the training logs.

        With several processes this is a collective (as transformers' own logging step): it must be called on every
        rank. Stage metrics are averaged over the micro-batches of ALL ranks; ``peak_mem_gb`` is the largest rank's.
        """
        if "loss" in logs:
            now = time.perf_counter()
            logs[f"trained_{self.stage.item_unit}"] = self.trained_tokens
            seen = self.seen_tokens * self.args.world_size
            logs["tokens_per_s"] = (seen - self._last_log_tokens) / max(now - self._last_log_time, 1e-9)
            self._last_log_time, self._last_log_tokens = now, seen
            logs.update(self._flops_metrics(logs[self.flops_tokens_key]))
            keys = sorted(self._metric_sums)
            values = [self._metric_sums[k] for k in keys] + [float(self._metric_counts[k]) for k in keys]
            peak = peak_memory_gb()
            if self.args.world_size > 1 and keys:  # same stage, same keys on every rank
                sums = self.accelerator.reduce(torch.tensor(values, dtype=torch.float64, device=self.args.device),
                                               reduction="sum")
                values = sums.tolist()
            if self.args.world_size > 1:
                peak = float(self.accelerator.gather(torch.tensor([peak], device=self.args.device)).max())
            logs["peak_mem_gb"] = peak
            for i, key in enumerate(keys):
                logs[key] = values[i] / max(values[len(keys) + i], 1.0)
            self._metric_sums.clear()
            self._metric_counts.clear()
        super().log(logs, start_time)

    # The throughput the training FLOPs are counted over (online RL: its training time only, rollouts excluded),
    # and whether a step also runs a value model through the body (PPO).
    flops_tokens_key = "tokens_per_s"
    value_forward = False

    def _flops_metrics(self, tokens_per_s: float) -> dict[str, float]:
        """``flops_per_token`` (model FLOPs per processed token, :mod:`llmtune.core.flops`) at ``mean_seq_len``
        (tokens per sequence of the logging window, this rank), ``model_tflops_per_s`` = that x ``tokens_per_s``
        (all ranks) and ``mfu`` = that over the peak of all ranks' devices (only where the peak is known: GPU table
        or ``LLMTUNE_PEAK_TFLOPS``)."""
        from llmtune.core.flops import peak_tflops, train_flops_per_token

        seq_len = self._window_tokens / max(self._window_rows, 1)
        self._window_tokens = self._window_rows = 0
        reference = bool(getattr(self.stage, "reference_forward", False))
        per_token = train_flops_per_token(self.model, seq_len, reference_forward=reference,
                                          value_forward=self.value_forward)
        out = {"flops_per_token": per_token, "mean_seq_len": seq_len,
               "model_tflops_per_s": per_token * tokens_per_s / 1e12}
        peak = peak_tflops()
        if peak:
            out["mfu"] = out["model_tflops_per_s"] / (peak * self.args.world_size)
        return out

    # ---- evaluation -----------------------------------------------------------------------------
    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """Per-sample statistics of the stage, as a tuple in ``stage.eval_keys`` order (each (B,))."""
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            stats = self.stage.eval_stats(model, inputs)
        values = tuple(stats[k].detach().float() for k in self.stage.eval_keys)
        return None, values, values[0]  # label_ids must be non-None for compute_metrics to run

    def _compute_metrics(self, prediction) -> dict[str, float]:
        preds = prediction.predictions
        preds = preds if isinstance(preds, (tuple, list)) else (preds,)
        stats = {k: np.asarray(v, dtype=np.float64).reshape(-1) for k, v in zip(self.stage.eval_keys, preds)}
        return self.stage.eval_metrics(stats)


class SeededLengthGroupedSampler(LengthGroupedSampler):
    """LengthGroupedSampler whose permutation depends only on (seed, epoch)."""

    @classmethod
    def wrap(
        cls, sampler: LengthGroupedSampler, seed: int, batch_size: int | None = None
    ) -> "SeededLengthGroupedSampler":
        """Copy of ``sampler`` seeded by (seed, epoch); ``batch_size`` (samples) replaces its grouping size."""
        new = cls.__new__(cls)
        new.__dict__.update(sampler.__dict__)
        new.seed, new.epoch = seed, 0
        if batch_size is not None:
            new.batch_size = batch_size
        return new

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        self.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return super().__iter__()


def all_ranks_agree(trainer: Trainer, flag: bool) -> bool:
    """``flag`` AND-ed over all ranks (a collective: call it on every rank); the flag itself in one process."""
    if trainer.args.world_size <= 1:
        return flag
    value = torch.tensor([1 if flag else 0], dtype=torch.int32, device=trainer.args.device)
    torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MIN)
    return bool(value.item())


def early_stopping(recipe: Recipe) -> list[Any]:
    """HF's early-stopping callback when the recipe asks for it (monitors eval_loss)."""
    patience = recipe.train.early_stopping_patience
    return [EarlyStoppingCallback(early_stopping_patience=patience)] if patience else []
