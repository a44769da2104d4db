"""Asynchronous rollouts (``rollout.max_staleness`` > 0): the next rollout batches are sampled while the trainer
trains on the current one.

One background thread talks to the engine (an engine in another process: vLLM, colocated or a server), in order.
At the start of iteration ``i`` (the trainer at step ``s = i x steps_per_iteration``) the trainer takes a snapshot
of its adapter (in the training thread: the adapter is not being updated then; a few milliseconds for a LoRA) and
makes sure iterations ``i .. i + lookahead`` are submitted; each new submission is "push this snapshot as version
``s``, then sample iteration j's prompts with it". The thread never waits for the trainer and the trainer never
waits for a push: it only waits when the batch it needs next is not sampled yet. The engine idles only while it has
nothing submitted (measured: ``rollout/engine_idle_s``).

A batch submitted at step ``s`` for iteration ``j`` is trained from step ``j x steps_per_iteration``, so its
staleness (optimizer steps between the policy that sampled it and the policy at the start of the iteration that
trains on it) is ``(j - i) x steps_per_iteration <= lookahead x steps_per_iteration <= max_staleness`` by
construction; it is checked again per trajectory (:meth:`llmtune.rl.rollouts.Rollouts.too_stale`: the rewards mark
such a trajectory stale) and nothing trains on one beyond the bound.

Reproducibility: the prompts and seeds of iteration ``j`` depend only on (seed, j, rank), never on timing, and the
snapshot a batch was sampled with is fixed when it is submitted, so a run is as reproducible as a synchronous one.
A checkpoint keeps the snapshots of the batches submitted but not yet trained on (:meth:`RolloutPrefetcher.untaken`),
so a run resumed there (after a crash or kill -9 with rollouts in flight) samples those batches again from the same
adapter bytes with the same seeds (:meth:`RolloutPrefetcher.restore`).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from llmtune.rl.types import AdapterSnapshot, SamplingParams, Trajectory

SNAPSHOTS = "rollout_snapshots"  # in a checkpoint: the adapters of the rollouts still to be trained on


@dataclass
class Prefetched:
    """One iteration's rollouts sampled in the background.

    Attributes:
        iteration: the iteration they are for. version: the policy version they were sampled with.
        trajectories: in the order of the iteration's prompt rows. seconds: sampling time (s, the engine's).
        engine_idle_s: how long the engine had nothing to do before this batch was submitted (s).
    """

    iteration: int
    version: int
    trajectories: list[Trajectory]
    seconds: float
    engine_idle_s: float = 0.0


@dataclass
class _Job:
    snapshot: AdapterSnapshot
    future: Future = field(default_factory=Future)


class RolloutPrefetcher:
    """Rollout batches sampled ahead of the trainer, in one background thread (see the module docstring).

    Args:
        engine: an engine with ``snapshot(version)``, ``push(snapshot)`` and ``generate(..., version=)`` (vLLM).
        sample: ``fn(rows, groups, sampling, version) -> trajectories``: the sampling itself, run in the background
            thread (it must not use collectives or torch's global RNG; ``sampling.seed`` seeds it).
        lookahead: iterations sampled ahead of the one being trained (>= 1).
        iterations: the run's number of iterations (nothing is sampled past the last).
    """

    def __init__(self, engine, sample: Callable[[list, list, SamplingParams, int], list[Trajectory]],
                 lookahead: int, iterations: int):
        if lookahead < 1:
            raise ValueError(f"lookahead must be >= 1, got {lookahead}")
        self.engine, self.sample, self.lookahead, self.iterations = engine, sample, lookahead, iterations
        self.engine.background = True  # it samples while the trainer trains: it never sleeps
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="llmtune-rollouts")
        self._jobs: dict[int, _Job] = {}
        self._restored: dict[int, AdapterSnapshot] = {}
        self._lock = threading.Lock()
        self._idle_since: float | None = time.perf_counter()  # the worker has nothing to do since then
        self._closed = False

    # ---- the training thread -----------------------------------------------------------------------
    def schedule(self, iteration: int, plan: Callable[[int], tuple[list, list, SamplingParams]],
                 snapshot: Callable[[], AdapterSnapshot]) -> None:
        """Make sure iterations ``iteration .. iteration + lookahead`` (not past the last) are submitted.

        Args:
            plan: ``fn(j) -> (rows, groups, sampling)`` of iteration ``j`` (this rank's rows; ``sampling.seed`` set).
            snapshot: the policy adapter now (called at most once, only when something new is submitted).
        """
        current = None
        for j in range(iteration, min(iteration + self.lookahead, self.iterations - 1) + 1):
            if j in self._jobs:
                continue
            snap = self._restored.pop(j, None)
            if snap is None:
                current = current or snapshot()
                snap = current
            rows, groups, sampling = plan(j)
            job = _Job(snap)
            self._jobs[j] = job
            self._executor.submit(self._work, job, j, rows, groups, sampling)

    def take(self, iteration: int) -> tuple[Prefetched, float]:
        """The rollouts of ``iteration`` (submitted by :meth:`schedule`) and how long the trainer waited for them (s).

        Raises:
            whatever sampling raised (an engine error: exit 69).
        """
        job = self._jobs.pop(iteration)
        start = time.perf_counter()
        result = job.future.result()
        return result, time.perf_counter() - start

    def drain(self) -> None:
        """Wait until nothing is being sampled (before the trainer uses the engine itself: an evaluation); what
        was sampled stays to be taken. Errors stay with their batch (raised by :meth:`take`)."""
        for job in list(self._jobs.values()):
            try:
                job.future.exception()
            except BaseException:  # noqa: BLE001 - cancelled: nothing to wait for
                pass

    def untaken(self) -> dict[int, AdapterSnapshot]:
        """``{iteration: snapshot}`` of the batches submitted but not yet taken: what a checkpoint written now must
        keep for a resumed run to sample them again identically."""
        return {j: job.snapshot for j, job in sorted(self._jobs.items())}

    def restore(self, snapshots: dict[int, AdapterSnapshot]) -> None:
        """Sample these iterations from these snapshots when they are scheduled (a resumed run)."""
        self._restored.update(snapshots)

    def close(self) -> None:
        """Stop: cancel what has not started, do not wait for what runs (its engine is being closed too)."""
        self._closed = True
        for job in self._jobs.values():
            job.future.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ---- the background thread ---------------------------------------------------------------------
    def _work(self, job: _Job, iteration: int, rows, groups, sampling) -> None:
        if not job.future.set_running_or_notify_cancel() or self._closed:
            return
        try:
            idle = time.perf_counter() - self._idle_since if self._idle_since is not None else 0.0
            self._idle_since = None
            self.engine.push(job.snapshot)
            start = time.perf_counter()
            trajectories = self.sample(rows, groups, sampling, job.snapshot.version)
            job.future.set_result(Prefetched(iteration, job.snapshot.version, trajectories,
                                             time.perf_counter() - start, idle))
        except BaseException as exc:  # noqa: BLE001 - the trainer raises it when it takes this batch
            job.future.set_exception(exc)
        finally:
            self._idle_since = time.perf_counter()


# ---- checkpoints ---------------------------------------------------------------------------------------------
def save_snapshots(checkpoint: Path, snapshots: dict[int, AdapterSnapshot]) -> None:
    """Write ``{iteration: snapshot}`` into ``checkpoint/rollout_snapshots`` (one adapter per version)."""
    if not snapshots:
        return
    root = Path(checkpoint) / SNAPSHOTS
    root.mkdir(parents=True, exist_ok=True)
    for snap in {s.version: s for s in snapshots.values()}.values():
        folder = root / f"v{snap.version}"
        folder.mkdir(exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps(snap.config))
        (folder / "adapter_model.safetensors").write_bytes(snap.weights)
    plan = {str(j): {"version": s.version, "sha256": s.sha256} for j, s in snapshots.items()}
    (root / "plan.json").write_text(json.dumps(plan, indent=1))


def load_snapshots(checkpoint: Path) -> dict[int, AdapterSnapshot]:
    """The snapshots :func:`save_snapshots` wrote ({} when the checkpoint has none: a synchronous run's).

    Raises:
        ValueError: a snapshot's bytes do not match the digest recorded for it (a damaged checkpoint).
    """
    import hashlib

    root = Path(checkpoint) / SNAPSHOTS
    if not (root / "plan.json").is_file():
        return {}
    out: dict[int, AdapterSnapshot] = {}
    for j, entry in json.loads((root / "plan.json").read_text()).items():
        folder = root / f"v{entry['version']}"
        weights = (folder / "adapter_model.safetensors").read_bytes()
        digest = hashlib.sha256(weights).hexdigest()
        if digest != entry["sha256"]:
            raise ValueError(f"{folder}: the adapter's sha256 {digest[:12]} is not the {entry['sha256'][:12]} recorded "
                             "for it: the checkpoint is damaged; resume from an earlier one")
        out[int(j)] = AdapterSnapshot(int(entry["version"]), json.loads((folder / "adapter_config.json").read_text()),
                                      weights, digest)
    return out
