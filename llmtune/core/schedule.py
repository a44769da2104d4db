"""Learning-rate schedules: transformers' schedulers, with the warm-up length and the resumed LR made exact.

transformers builds the schedule (``get_scheduler``: linear / cosine / constant with warm-up). Two things are ours:

* the warm-up length: ``train.warmup_steps``, else ``ceil(train.warmup_ratio x total optimizer steps)``
  (transformers reads a warm-up value >= 1 as a step count, so ``warmup_ratio: 1.0`` gave a 1-step warm-up);
* the LR after a resume: a checkpoint restores the optimizer's param groups with the LR the interrupted run set
  after its last step, and the scheduler state without recomputing it. With ``train.max_steps`` raised, the first
  resumed step therefore ran at the FINISHED schedule's last value (0 for linear/cosine) and the new schedule took
  over one step later. :func:`apply_schedule_lr` sets every param group to the new schedule's value at the
  resumed step, so the LR of every step equals ``schedule(step - 1)`` of the schedule the run now has.
"""

from __future__ import annotations

import math

import torch
from transformers import get_scheduler

from llmtune.config.surface import SCHEDULE_NAMES
from llmtune.utils import get_logger

log = get_logger("schedule")

SCHEDULERS = SCHEDULE_NAMES  # train.lr_scheduler -> transformers' scheduler name


def warmup_steps(train, total_steps: int) -> int:
    """Warm-up length in optimizer steps: ``train.warmup_steps``, else ``ceil(warmup_ratio x total_steps)``.

    Args:
        train: the recipe's ``train`` section (``warmup_steps``, ``warmup_ratio``).
        total_steps: optimizer steps of the whole run (the schedule's length).
    """
    return train.warmup_steps if train.warmup_steps else math.ceil(train.warmup_ratio * total_steps)


def build_scheduler(train, optimizer: torch.optim.Optimizer, total_steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """transformers' scheduler ``train.lr_scheduler`` over ``total_steps`` optimizer steps with the exact warm-up
    and the schedule's own arguments (``train.lr_scheduler_kwargs``, validated in llmtune.config.surface).

    Args:
        train: the recipe's ``train`` section.
        optimizer: the optimizer whose param groups the scheduler sets (peak LR = their initial ``lr``).
        total_steps: optimizer steps of the whole run.
    """
    return get_scheduler(SCHEDULERS[train.lr_scheduler], optimizer=optimizer,
                         num_warmup_steps=warmup_steps(train, total_steps), num_training_steps=total_steps,
                         scheduler_specific_kwargs=dict(getattr(train, "lr_scheduler_kwargs", None) or {}))


def apply_schedule_lr(scheduler) -> list[float] | None:
    """Set the optimizer's LR to the scheduler's own value at its current step (after loading a checkpoint).

    Works through wrappers (accelerate's ``AcceleratedScheduler``, DeepSpeed's) down to the torch scheduler. For a
    ``LambdaLR`` (every transformers warm-up/decay schedule) the value is ``base_lr x lr_lambda(last_epoch)``, where
    ``last_epoch`` = optimizer steps already done; the scheduler's ``get_last_lr()`` (what metrics.jsonl logs as
    ``learning_rate``) is set to the same value.

    Returns:
        The LR per param group now in force, or None for a scheduler without a closed form (left unchanged).
    """
    while not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) and hasattr(scheduler, "scheduler"):
        scheduler = scheduler.scheduler
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        lrs = [base * fn(scheduler.last_epoch) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    elif hasattr(scheduler, "_get_closed_form_lr"):
        lrs = list(scheduler._get_closed_form_lr())
    else:
        log.warning("cannot recompute the learning rate of %s after resuming; it continues from the checkpoint",
                    type(scheduler).__name__)
        return None
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    scheduler._last_lr = list(lrs)
    return lrs
