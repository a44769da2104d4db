"""Stopping cleanly on SIGTERM / SIGUSR1 (preemption: spot instances, SLURM ``--signal``) and Ctrl-C (SIGINT).

While a stage trains, the first signal only sets a flag: the current optimizer step is finished, a checkpoint is
written (even when ``train.save_steps`` is not due), the run stops with a message saying how to continue, and the
process exits with code 75 (SIGTERM/SIGUSR1, ``llmtune.errors.EXIT_PREEMPTED``) or 130 (Ctrl-C). Rerunning the same
command resumes from that checkpoint (``train.resume_from: auto``), so no optimizer step is lost. A second signal
exits at once (the newest complete checkpoint stays: checkpoints are written crash-safe); a repeat within
``REPEAT_GRACE_S`` seconds is taken as the same stop delivered twice (SLURM signals every process of a step, and
torchrun passes the signal it gets on to its workers).

With several processes every rank handles the signal, and the ranks agree at the end of every optimizer step
(one all-reduce of the signal number, max over ranks) so that all of them save and stop after the same step even
when the signal reached only some of them. PPO stops only at the end of a PPO iteration
(:meth:`CoreTrainer.can_stop_here`).

Before training starts (data, model loading) a signal stops at once (nothing to save); after the last optimizer
step the run is finished first (final evaluation, adapter, lineage) and exits 0.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch
from transformers import TrainerCallback

from llmtune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, LlmtuneError
from llmtune.utils import get_logger

log = get_logger("preempt")

REPEAT_GRACE_S = 3.0  # a repeat this soon is the same stop reaching us twice, not a user's second signal
STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None), signal.SIGINT)
                     if s is not None)


def exit_code(signum: int) -> int:
    """130 for Ctrl-C (SIGINT), 75 for SIGTERM/SIGUSR1."""
    return EXIT_INTERRUPTED if signum == signal.SIGINT else EXIT_PREEMPTED


def signal_name(signum: int) -> str:
    """``SIGTERM``, ``SIGUSR1``, ``SIGINT (Ctrl-C)``."""
    name = signal.Signals(signum).name
    return f"{name} (Ctrl-C)" if signum == signal.SIGINT else name


class PreemptedError(LlmtuneError):
    """Training stopped on a signal after writing a checkpoint (exit code 75, or 130 for Ctrl-C)."""

    def __init__(self, message: str, code: int = EXIT_PREEMPTED):
        super().__init__(message)
        self.exit_code = code


class StopRequest:
    """Signal handlers for one stage run (a context manager; installs nothing outside the main thread).

    ``phase`` is ``setup`` (a signal raises at once), ``training`` (a signal sets :attr:`signum`; the callback
    stops after the step) or ``finishing`` (the signal is noted; the run completes).
    """

    def __init__(self):
        self.signum = 0
        self._first = 0.0
        self.phase = "setup"
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame) -> None:
        name = signal_name(signum)
        now = time.monotonic()
        if self.signum and now - self._first < REPEAT_GRACE_S:
            return  # the same stop delivered twice (SLURM signals every process, torchrun forwards it too)
        if self.signum:  # the second signal: leave now; the newest complete checkpoint is intact
            print(f"\n{name} again: exiting at once (the newest complete checkpoint is kept; rerun the same command "
                  "to continue from it)", file=sys.stderr, flush=True)
            os._exit(exit_code(signum))
        self.signum, self._first = signum, now
        if self.phase == "setup":
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise PreemptedError(f"stopped by {name} before training started (nothing to save); rerun the same "
                                 "command to start it", exit_code(signum))
        if self.phase == "training":
            log.warning("%s: finishing the current optimizer step, then writing a checkpoint and stopping (send it "
                        "again to exit at once)", name)
        else:
            log.warning("%s after the last optimizer step: finishing the run first (final evaluation, adapter, "
                        "lineage); send it again to exit at once", name)


class StopOnSignalCallback(TrainerCallback):
    """At the end of each optimizer step: if a rank got a signal, save a checkpoint and stop training (all ranks).

    Args:
        request: the run's :class:`StopRequest`.
        can_stop: ``() -> bool``, whether the run may stop after this step (PPO: at the end of an iteration).

    Attributes:
        stopped: ``(signum, step)`` once training was stopped by a signal, else ``None``.
    """

    def __init__(self, request: StopRequest, can_stop=lambda: True):
        self.request = request
        self.can_stop = can_stop
        self.stopped: tuple[int, int] | None = None

    def on_step_end(self, args, state, control, **kwargs):
        signum = self.request.signum
        if args.world_size > 1:  # the signal may have reached only some ranks: all stop after the same step
            value = torch.tensor([signum], dtype=torch.int32, device=args.device)
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
            signum = int(value.item())
        if signum and self.can_stop():
            control.should_save = True
            control.should_training_stop = True
            self.stopped = (signum, state.global_step)
        return control
