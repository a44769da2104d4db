"""Numbers that went wrong during training: non-finite steps, non-finite weights, out of GPU memory.

* :class:`NonFiniteGuard` (a mixin of :class:`~llmtune.core.trainer.CoreTrainer`, so every stage, PPO included):
  an optimizer step whose loss (any micro-batch, any rank) or gradient norm is NaN/inf is **not applied**: its
  gradients are dropped (all micro-batches of the step), the optimizer is not stepped (weights and AdamW moments stay
  as they were) and the learning-rate schedule does not advance. ``global_step`` still advances — the step's
  batches are consumed, like a step skipped by fp16 loss scaling — so data order, ``max_steps``, checkpoints and
  PPO iterations stay aligned. Each skipped step is a ``nonfinite_step`` record in ``metrics.jsonl`` (step, loss,
  grad norm, training-set rows of its batch); training records carry the running ``nonfinite_steps``.
  ``train.max_nonfinite_steps`` skipped steps in a row stop the run with :class:`NonFiniteError` (exit code 3).
* :func:`check_trainable_weights`: a run never finishes with NaN/inf trainable weights.
* :func:`oom_guard`: ``torch.cuda.OutOfMemoryError`` becomes :class:`OutOfMemoryError` (exit code 4) with the
  memory figures and what to change in the recipe.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator

import torch

from llmtune.config import Recipe, RecipeError
from llmtune.errors import EXIT_NONFINITE, EXIT_OOM, LlmtuneError
from llmtune.utils import get_logger

log = get_logger("guard")

ROW_KEY = "llmtune_row"  # training-set position of each row of a batch: (B,) long, removed before the forward


class NonFiniteError(LlmtuneError, RuntimeError):
    """Training stopped on non-finite numbers (loss, gradient norm or weights)."""

    exit_code = EXIT_NONFINITE


class OutOfMemoryError(LlmtuneError, RuntimeError):
    """The accelerator ran out of memory; the message lists the memory figures and what to change."""

    exit_code = EXIT_OOM


# ---- training-set rows of each batch ----------------------------------------------------------------------
def with_row_index(rows: Any) -> Any:
    """``rows`` with a ``llmtune_row`` column (0..n-1) when they are dict rows; anything else unchanged.

    A ``datasets.Dataset`` stays a Dataset (length grouping keeps reading its ``length`` column).
    """
    if hasattr(rows, "add_column") and hasattr(rows, "column_names"):
        return rows if ROW_KEY in rows.column_names else rows.add_column(ROW_KEY, list(range(len(rows))))
    if hasattr(rows, "__len__") and len(rows) and isinstance(rows[0], dict):
        return _IndexedRows(rows)
    return rows


class _IndexedRows(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {**self.rows[i], ROW_KEY: i}


class RowIndexCollator:
    """Wrap a collator: rows' ``llmtune_row`` values become one (B,) long tensor of the batch; the wrapped
    collator never sees the key."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, rows: list) -> Any:
        if not rows or not isinstance(rows[0], dict) or ROW_KEY not in rows[0]:
            return self.collator(rows)
        index = torch.tensor([int(r[ROW_KEY]) for r in rows], dtype=torch.long)
        batch = self.collator([{k: v for k, v in r.items() if k != ROW_KEY} for r in rows])
        if isinstance(batch, dict):
            batch[ROW_KEY] = index
        return batch


# ---- the guard ----------------------------------------------------------------------------------------------
class NonFiniteGuard:
    """Mixin for ``transformers.Trainer`` (put it before Trainer): skip optimizer steps with a non-finite loss or
    gradient norm, count and log them, stop after ``max_nonfinite_steps`` in a row (see the module docstring).

    Hooks used: ``training_step`` (micro-batch losses are held back until the step is judged, so a skipped step
    never enters the logged loss; transformers' ``logging_nan_inf_filter`` is off), ``_get_grad_norm`` (the
    decision, once per optimizer step after clipping and before ``optimizer.step()``; with several processes the
    flag is summed over ranks so all agree), ``_maybe_log_save_evaluate`` (the record of a skipped step, the stop).

    Under DeepSpeed the engine applies the optimizer step inside ``backward``, before the gradient norm is known:
    there the first non-finite step stops the run (the weights of that step are not saved).
    """

    max_nonfinite_steps: int = 3

    def _guard_reset_step(self) -> None:
        self._step_loss: torch.Tensor | None = None
        self._step_rows: list[torch.Tensor] = []

    def _guard_state(self) -> None:
        if not hasattr(self, "nonfinite_steps"):
            self.nonfinite_steps = 0  # total over the run (saved with checkpoints)
            self.nonfinite_in_a_row = 0
            self._skipped_record: dict | None = None
            self._guard_reset_step()

    def get_train_dataloader(self):
        original, collator = self.train_dataset, self.data_collator
        self.train_dataset, self.data_collator = with_row_index(original), RowIndexCollator(collator)
        try:
            return super().get_train_dataloader()
        finally:
            self.train_dataset, self.data_collator = original, collator

    def training_step(self, model, inputs, num_items_in_batch=None):
        self._guard_state()
        rows = inputs.pop(ROW_KEY, None) if isinstance(inputs, dict) else None
        if rows is not None:
            self._step_rows.append(rows.reshape(-1))
        loss = super().training_step(model, inputs, num_items_in_batch)
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        return torch.zeros_like(loss)  # added to the logged loss only once the step is applied (below)

    def _get_grad_norm(self, model, grad_norm=None):
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self._guard_state()
        loss = self._step_loss if self._step_loss is not None else torch.zeros((), device=self.args.device)
        norm = torch.as_tensor(0.0 if grad_norm is None else grad_norm, dtype=torch.float32).to(loss.device)
        bad = torch.stack([~torch.isfinite(loss.float()).all(), ~torch.isfinite(norm)]).float()  # (loss, grad)
        if self.args.world_size > 1:
            bad = self.accelerator.reduce(bad, reduction="sum")
        bad_loss, bad_grad = float(bad[0]) > 0, float(bad[1]) > 0
        scaler = getattr(self.accelerator, "scaler", None)
        scaling = (scaler is not None and scaler.get_scale() > 1) or (self.is_deepspeed_enabled and self.args.fp16)
        if not bad_loss and bad_grad and scaling:
            # fp16 loss scaling: overflowing scaled gradients with a finite loss are routine; the GradScaler (or
            # DeepSpeed's loss scaler) skips the update and halves the scale itself, and the LR schedule waits.
            # Counted as fp16_overflow_steps, never a reason to stop; a GradScaler whose scale is down to 1 is not
            # exempt.
            self.fp16_overflow_steps = getattr(self, "fp16_overflow_steps", 0) + 1
            log.info("fp16 loss scale overflowed at optimizer step %d: the loss scaler skips this update",
                     self.state.global_step + 1)
            bad_grad, grad_norm = False, None
        if not (bad_loss or bad_grad):
            self._tr_loss += loss.to(self._tr_loss.device)
            self.nonfinite_in_a_row = 0
            self._set_skipped(False)
            self._guard_reset_step()
            return grad_norm
        losses = loss.reshape(1).float()
        rows = torch.cat(self._step_rows).tolist() if self._step_rows else []
        if self.args.world_size > 1:
            from accelerate.utils import gather_object

            losses = self.accelerator.gather(losses)
            rows = gather_object(rows)
        self.nonfinite_steps += 1
        self.nonfinite_in_a_row += 1
        step = self.state.global_step + 1
        self._skipped_record = {
            "nonfinite_step": step, "nonfinite_loss": _num(losses.mean()), "nonfinite_grad_norm": _num(norm),
            "nonfinite_rows": sorted(set(int(r) for r in rows)), "nonfinite_steps": self.nonfinite_steps,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }
        log.warning("optimizer step %d not applied: loss %s, gradient norm %s (training rows %s); %d in a row",
                    step, self._skipped_record["nonfinite_loss"], self._skipped_record["nonfinite_grad_norm"],
                    _short(self._skipped_record["nonfinite_rows"]), self.nonfinite_in_a_row)
        if self.is_deepspeed_enabled:
            raise NonFiniteError(self._stop_message(deepspeed=True))
        model.zero_grad(set_to_none=True)  # every micro-batch's gradients: AdamW skips parameters without a grad
        self._set_skipped(True)
        self._guard_reset_step()
        # the logged loss is averaged over applied steps only: transformers divides by global_step - last logged
        self._globalstep_last_logged += 1
        return None

    def _set_skipped(self, skipped: bool) -> None:
        """Make ``accelerator.optimizer_step_was_skipped`` say so, so the loop does not step the LR schedule.
        With fp16 loss scaling accelerate sets the flag itself at ``optimizer.step()`` (the scaler also skips)."""
        if hasattr(self.optimizer, "_is_overflow") and getattr(self.accelerator, "scaler", None) is None:
            self.optimizer._is_overflow = skipped

    def _maybe_log_save_evaluate(self, tr_loss, grad_norm, model, *args, **kwargs):
        record, self._skipped_record = getattr(self, "_skipped_record", None), None
        if record is not None:
            self.log(record)
            if self.nonfinite_in_a_row >= self.max_nonfinite_steps:
                raise NonFiniteError(self._stop_message(record=record))
        return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, *args, **kwargs)

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs:
            logs["nonfinite_steps"] = getattr(self, "nonfinite_steps", 0)
            if getattr(self, "fp16_overflow_steps", 0):
                logs["fp16_overflow_steps"] = self.fp16_overflow_steps
        super().log(logs, *args, **kwargs)

    def _stop_message(self, record: dict | None = None, deepspeed: bool = False) -> str:
        record = record or self._skipped_record or {}
        step, n = record.get("nonfinite_step"), self.nonfinite_in_a_row
        lr = self.args.learning_rate
        head = (f"stopped at optimizer step {step}: the loss was {record.get('nonfinite_loss')} and the gradient "
                f"norm {record.get('nonfinite_grad_norm')} (not finite)")
        if deepspeed:
            head += (". Under DeepSpeed the optimizer step is applied inside backward, so llmtune cannot skip it: the "
                     "run stops at the first non-finite step and nothing of it is saved")
        else:
            head += (f" in {n} optimizer steps in a row (train.max_nonfinite_steps={self.max_nonfinite_steps}); none "
                     f"of them was applied ({self.nonfinite_steps} non-finite step(s) in this run, see metrics.jsonl)")
        return (
            f"{head}. Rows of the batch (positions in the tokenized training set): "
            f"{_short(record.get('nonfinite_rows', []))}. Likely causes: the learning rate is too high "
            f"(train.learning_rate={lr:g}: lower it, add train.warmup_steps, keep train.max_grad_norm > 0); fp16 "
            "overflow (use precision.bf16: true, or fp32); a bad row in the batch (look at those rows). No adapter "
            "or lineage.json was written; checkpoints written before are intact (resume with "
            "train.resume_from=latest after changing the recipe, or start again)."
        )


def _num(x: Any) -> float | str:
    value = float(x)
    return value if math.isfinite(value) else str(value)  # "nan"/"inf": metrics.jsonl stays strict JSON


def _short(rows: list[int], limit: int = 16) -> str:
    text = ", ".join(str(r) for r in rows[:limit])
    return (text + f", ... ({len(rows)} rows)") if len(rows) > limit else (text or "unknown")


# ---- final weights ------------------------------------------------------------------------------------------
def nonfinite_tensors(named: Iterator[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding any NaN/inf value (ZeRO-3 parameters: this rank's partition)."""
    bad = []
    for name, tensor in named:
        data = getattr(tensor, "ds_tensor", None)
        data = tensor.detach() if data is None else data.detach()
        if data.numel() and data.is_floating_point() and not bool(torch.isfinite(data).all()):
            bad.append(name)
    return bad


def check_trainable_weights(trainer) -> None:
    """Refuse to finish a run whose trainable weights hold NaN/inf (checked on every rank, agreed by all).

    Raises:
        NonFiniteError: naming the tensors (the adapter and lineage.json are then not written).
    """
    model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    bad = nonfinite_tensors((n, p) for n, p in model.named_parameters() if p.requires_grad)
    if trainer.args.world_size > 1:
        from accelerate.utils import gather_object

        bad = sorted(set(gather_object(bad)))
    if bad:
        raise NonFiniteError(
            f"the trained weights hold NaN/inf values in {len(bad)} tensor(s), e.g. {', '.join(bad[:5])}; the run is "
            "not saved as finished (no adapter, no lineage.json). Likely causes: a learning rate that is too high, "
            "fp16 overflow (use precision.bf16), or a bad row; lower train.learning_rate and start again."
        )


# ---- out of memory ------------------------------------------------------------------------------------------
def memory_figures() -> str:
    """Allocated / reserved / peak / total memory of the current CUDA device, in GiB (or why there are none)."""
    if not torch.cuda.is_available():
        return "no CUDA device in this process, so no GPU memory figures"
    gib = 2**30
    dev = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(dev).total_memory
    return (f"GPU {dev}: {torch.cuda.memory_allocated(dev) / gib:.2f} GiB allocated, "
            f"{torch.cuda.memory_reserved(dev) / gib:.2f} GiB reserved, "
            f"peak {torch.cuda.max_memory_allocated(dev) / gib:.2f} GiB, total {total / gib:.2f} GiB")


def oom_advice(recipe=None) -> str:
    """What to change in a recipe to need less memory (naming its current values when a recipe is given)."""
    def cur(value: Any) -> str:
        return f" (now {value})" if recipe is not None else ""

    t, m, d = (recipe.train, recipe.model, recipe.data) if recipe is not None else (None, None, None)
    items = [
        f"lower train.micro_batch_size{cur(t and t.micro_batch_size)} (global_batch_size stays; accumulation grows)",
        f"train.gradient_checkpointing: true{cur(t and t.gradient_checkpointing)}",
        f"QLoRA: model.load_in_4bit: true{cur(m and m.load_in_4bit)}",
        f"a higher DeepSpeed ZeRO stage, distributed.zero_stage: 2 or 3{cur(recipe and recipe.distributed.zero_stage)}",
        f"lower data.max_length{cur(d and d.max_length)}",
    ]
    if recipe is not None and t.eval_batch_size:
        items.append(f"lower train.eval_batch_size (now {t.eval_batch_size})")
    return "; ".join(items)


@contextlib.contextmanager
def oom_guard(recipe=None) -> Iterator[None]:
    """Turn ``torch.cuda.OutOfMemoryError`` raised inside into :class:`OutOfMemoryError` with figures and advice.

    Raises:
        OutOfMemoryError: exit code 4.
    """
    try:
        yield
    except torch.cuda.OutOfMemoryError as exc:
        raise OutOfMemoryError(oom_message(exc, recipe)) from None


def oom_message(exc: BaseException, recipe=None) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else "CUDA out of memory"
    return (f"out of GPU memory ({first[:300]}). Memory: {memory_figures()}. To need less memory: "
            f"{oom_advice(recipe)}.")


def check_precision(recipe: Recipe) -> None:
    """Refuse precision settings this machine cannot run, before any weights are loaded.

    Raises:
        RecipeError: fp16 without a CUDA device (fp16 mixed precision needs GPU loss scaling). tf32 is
            simply ignored without CUDA.
    """
    if torch.cuda.is_available():
        return
    problems = []
    if recipe.precision.fp16:
        problems.append(("precision.fp16", "fp16 mixed precision needs a CUDA GPU; on CPU use precision.bf16: true "
                         "or fp32 (both off)"))
    if problems:
        raise RecipeError(problems)
