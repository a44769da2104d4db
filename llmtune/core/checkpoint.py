"""Crash-safe checkpoints: staged writes, a completeness marker written last, atomic rename, safe rotation.

transformers writes ``checkpoints/checkpoint-N`` in place, so a kill during a save leaves a directory that looks like
a checkpoint but is not (empty, an adapter without ``trainer_state.json``...). Here every save goes to
``checkpoints/.tmp/checkpoint-N`` (all ranks write their files there: ZeRO shards, per-rank RNG states), every file
and directory is fsynced, rank 0 writes :data:`MARKER` (the step and the size of every file) last, fsyncs it and
renames the directory to ``checkpoints/checkpoint-N`` (one atomic ``rename``), then fsyncs ``checkpoints/``. A kill
at any instant therefore leaves either the complete new checkpoint or none, and the previous one untouched.

A checkpoint is *complete* when its marker is present and every file it lists exists with its recorded size.
Checkpoints written before this module existed (no marker) count as complete when they hold ``trainer_state.json``
(transformers writes it after the weights, optimizer and RNG states). Everything else is *partial*: never picked for
a resume, never counted by rotation, never deleted (it is reported).

Deleting (rotation, replacing a checkpoint of the same step) is crash-safe the same way: the directory is first
renamed into the staging area (``.tmp/deleted-checkpoint-N``), then removed, so a kill half-way through never
leaves a partial ``checkpoint-N``. The staging area holds only our unfinished work; the next save empties it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Iterable

from llmtune.errors import EXIT_DISK, LlmtuneError
from llmtune.utils import get_logger

log = get_logger("checkpoint")

MARKER = "llmtune_checkpoint.json"
STAGING = ".tmp"  # checkpoints/.tmp/checkpoint-N while a save is in progress
TRAINER_STATE = "trainer_state.json"
_NAME = re.compile(r"^checkpoint-(\d+)$")


class CheckpointSaveError(LlmtuneError):
    """A checkpoint (or the final adapter) could not be written: disk full, quota, permissions, I/O error.

    Exit code 5. The message names the directory, the OS error, the space needed and free, and says that the
    previous checkpoint is intact.
    """

    exit_code = EXIT_DISK


# ---- completeness -------------------------------------------------------------------------------------------
def step_of(path: str | Path) -> int | None:
    """N of a ``checkpoint-N`` directory name, else ``None``."""
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def why_incomplete(path: str | Path) -> str | None:
    """``None`` when ``path`` is a complete checkpoint, else the reason it is not (for messages)."""
    path = Path(path)
    if not path.is_dir():
        return "not a directory"
    marker = path / MARKER
    if not marker.is_file():
        if (path / TRAINER_STATE).is_file():  # written by an older llmtune: transformers writes this file last
            return None
        return f"no {MARKER} and no {TRAINER_STATE} (its save was interrupted)"
    try:
        files = json.loads(marker.read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MARKER} is unreadable"
    for name, size in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {size} were written"
    return None


def is_complete(path: str | Path) -> bool:
    """Whether ``path`` is a complete checkpoint (see the module docstring)."""
    return why_incomplete(path) is None


def scan(checkpoints_dir: str | Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The ``checkpoint-N`` directories under ``checkpoints_dir``, by step (oldest first).

    Returns:
        ``(complete, partial)``: complete checkpoints, and ``(path, reason)`` for the others, staged saves
        (``.tmp/checkpoint-N``, an interrupted save) included.
    """
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return [], []
    complete, partial = [], []
    for path in sorted((p for p in root.iterdir() if step_of(p) is not None), key=step_of):
        reason = why_incomplete(path)
        if reason is None:
            complete.append(path)
        else:
            partial.append((path, reason))
    staging = root / STAGING
    if staging.is_dir():
        partial += [(p, "an interrupted save (removed by the next save)")
                    for p in sorted(staging.iterdir(), key=lambda p: p.name) if step_of(p) is not None]
    return complete, partial


def newest_complete(checkpoints_dir: str | Path, report: bool = True) -> Path | None:
    """Newest complete checkpoint, or ``None``; with ``report``, logs every partial one newer than it (skipped,
    left in place)."""
    complete, partial = scan(checkpoints_dir)
    found = complete[-1] if complete else None
    if report:
        newest = step_of(found) if found is not None else -1
        for path, reason in partial:
            if (step_of(path) or 0) > newest:
                log.warning("skipping %s: incomplete (%s); it is left in place", path, reason)
    return found


# ---- writing ------------------------------------------------------------------------------------------------
def fsync_tree(root: str | Path) -> None:
    """fsync every file and directory under ``root`` (``root`` included)."""
    root = Path(root)
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(dirpath)


def fsync_dir(path: str | Path) -> None:
    """fsync a directory (makes a rename or a new entry in it durable)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_marker(staged: Path, step: int, extra: dict | None = None) -> None:
    """Write :data:`MARKER` into the staged checkpoint: the step and every file's size (relative path -> bytes)."""
    files = {str(p.relative_to(staged)): p.stat().st_size for p in sorted(staged.rglob("*")) if p.is_file()
             and p.name != MARKER}
    tmp = staged / (MARKER + ".tmp")
    with open(tmp, "w") as fh:
        fh.write(json.dumps({"step": step, "files": files, **(extra or {})}, indent=1))
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(staged / MARKER)
    fsync_dir(staged)


def commit(staged: Path, final: Path) -> None:
    """Move a staged, fsynced checkpoint (marker written) to its final name atomically.

    An existing ``final`` (a checkpoint of the same step written earlier) is moved into the staging area first and
    removed after the rename, with a log line.
    """
    replaced = None
    if final.exists():
        replaced = staged.parent / f"deleted-{final.name}"
        if replaced.exists():
            shutil.rmtree(replaced)
        os.rename(final, replaced)
    os.rename(staged, final)
    fsync_dir(final.parent)
    if replaced is not None:
        log.info("replaced the earlier %s (%s) with the new one", final, why_incomplete(replaced) or "complete")
        shutil.rmtree(replaced, ignore_errors=True)
    remove_staged(staged)


def discard(path: Path) -> None:
    """Delete a checkpoint directory so that a kill half-way leaves no partial ``checkpoint-N``: it is renamed into
    the staging area first (``.tmp/deleted-checkpoint-N``), then removed."""
    trash = path.parent / STAGING / f"deleted-{path.name}"
    trash.parent.mkdir(exist_ok=True)
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash, ignore_errors=True)
    remove_staged(trash)


def clean_staging(checkpoints_dir: str | Path) -> None:
    """Remove what killed saves and deletions left in the staging area (``.tmp/``): ours, never a checkpoint."""
    staging = Path(checkpoints_dir) / STAGING
    if staging.exists():
        shutil.rmtree(staging)


def remove_staged(staged: Path) -> None:
    """Remove one staged (unfinished) save: only that directory, and the staging area if it is left empty."""
    if staged.exists():
        shutil.rmtree(staged, ignore_errors=True)
    staging = staged.parent
    if staging.is_dir() and not any(staging.iterdir()):
        staging.rmdir()


def rotate(checkpoints_dir: str | Path, limit: int | None, keep: Iterable[str | Path] = ()) -> list[Path]:
    """Delete the oldest complete checkpoints beyond ``limit`` (``train.save_total_limit``).

    Only complete checkpoints are counted and deleted; the newest complete one and those in ``keep`` (the best
    checkpoint) are never deleted; partial ones are left alone.

    Returns:
        The deleted directories.
    """
    if not limit:
        return []
    complete, _ = scan(checkpoints_dir)
    protected = {Path(p).resolve() for p in keep if p} | ({complete[-1].resolve()} if complete else set())
    excess = len(complete) - max(limit, len(protected & {p.resolve() for p in complete}))
    deleted = []
    for path in complete:
        if excess <= 0:
            break
        if path.resolve() in protected:
            continue
        discard(path)
        log.info("deleted %s (train.save_total_limit=%d)", path, limit)
        deleted.append(path)
        excess -= 1
    return deleted


# ---- disk space ---------------------------------------------------------------------------------------------
MIB = 2**20
TOKENIZER_ALLOWANCE = 16 * MIB  # tokenizer files, trainer state, scheduler, RNG states, configs


def estimate_checkpoint_bytes(model, *, optimizer_state_per_param: int = 8, master_weights: bool = False,
                              world_size: int = 1) -> dict[str, int]:
    """Bytes one checkpoint needs, from the model's parameter counts and dtypes.

    Args:
        model: the model being trained (peft model, or the PPO policy+value module).
        optimizer_state_per_param: bytes of optimizer state per trainable parameter (AdamW: two fp32 moments = 8).
        master_weights: DeepSpeed keeps an fp32 copy of the trainable weights in its checkpoint (4 bytes each).
        world_size: processes (each saves its RNG state).

    Returns:
        ``{"weights", "optimizer", "other", "total"}`` in bytes. ``weights`` are the trainable parameters in their
        dtype (the adapter; every parameter for a full fine-tune).
    """
    trainable = [p for p in model.parameters() if p.requires_grad]
    numel = [getattr(p, "ds_numel", p.numel()) for p in trainable]  # ZeRO-3 partitions hold ds_numel elements
    n = sum(numel)
    weights = sum(k * p.element_size() for k, p in zip(numel, trainable))
    optimizer = n * (optimizer_state_per_param + (4 if master_weights else 0))
    other = TOKENIZER_ALLOWANCE + 16_384 * world_size
    return {"weights": weights, "optimizer": optimizer, "other": other, "total": weights + optimizer + other}


def free_bytes(path: str | Path) -> int:
    """Free bytes for an unprivileged user on the file system holding ``path`` (or its nearest existing parent)."""
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    return shutil.disk_usage(existing).free


def check_free_space(path: str | Path, estimate: dict[str, int]) -> None:
    """Refuse to start training when ``path``'s file system cannot hold one checkpoint.

    Raises:
        CheckpointSaveError: free space < ``estimate["total"]`` (the numbers are in the message).
    """
    free = free_bytes(path)
    if free < estimate["total"]:
        raise CheckpointSaveError(
            f"not enough disk space for a checkpoint in {path}: one needs about {fmt_bytes(estimate['total'])} "
            f"(trainable weights {fmt_bytes(estimate['weights'])} + optimizer state {fmt_bytes(estimate['optimizer'])}"
            f" + tokenizer/state/RNG {fmt_bytes(estimate['other'])}), only {fmt_bytes(free)} are free; free some "
            "space or set output.dir to a larger file system")


def save_failed_message(what: str, exc: OSError, path: Path, estimate: dict[str, int] | None,
                        previous: Path | None) -> str:
    """The user-facing message of a failed save (which error, how much space is needed and free, what is kept)."""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        reason = f"the disk is full ({reason})"
    need = f"; one checkpoint needs about {fmt_bytes(estimate['total'])}" if estimate else ""
    kept = (f"the previous checkpoint {previous} is intact" if previous is not None
            else "no earlier checkpoint exists")
    return (f"could not write {what} in {path}: {reason}{need}, {fmt_bytes(free_bytes(path))} are free. Its unfinished "
            f"files were removed and {kept}. Free some space (or fix the file system) and rerun the same command: it "
            "continues from the newest complete checkpoint")


def fmt_bytes(n: float) -> str:
    """``1536 -> '1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
