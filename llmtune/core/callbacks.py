"""Trainer callbacks: metrics.jsonl (one JSON object per log/eval), read back and truncated on resume; the
plots drawn from it are :mod:`llmtune.core.plots`."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from llmtune.utils import append_jsonl, get_logger, read_jsonl

log = get_logger("metrics")


class MetricsJsonlCallback(TrainerCallback):
    """Append every log (training and eval) to ``metrics.jsonl`` on rank 0, with step and epoch.

    Training records carry ``loss`` (mean over the stage's items of the logged steps: trained tokens for SFT,
    pairs for RM/DPO), ``learning_rate``, ``grad_norm``, ``trained_tokens`` or ``trained_pairs`` (cumulative, all
    ranks; ``Stage.item_unit``), ``tokens_per_s`` (all non-pad tokens, all ranks), ``peak_mem_gb``, the stage's
    own metrics; eval records carry ``eval_*`` keys.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            append_jsonl(self.path, {"step": state.global_step, "epoch": state.epoch, **logs})


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a ``metrics.jsonl``, one per (step, kind): lines torn by a crash are skipped with a warning,
    and a record repeated for the same step with the same keys (a step re-run after a resume from an older
    checkpoint) keeps only its last version, in the position of the first. ``[]`` when the file does not exist."""
    path = Path(path)
    if not path.is_file():
        return []
    records: list[dict] = []
    where: dict[tuple, int] = {}
    for record in read_jsonl(path, skip_bad_lines=True):
        key = (record.get("step"), tuple(sorted(record)))
        if key in where:
            records[where[key]] = record
        else:
            where[key] = len(records)
            records.append(record)
    return records


def truncate_metrics(path: str | Path, step: int, *, including_step: bool = False) -> int:
    """Before resuming from the checkpoint of optimizer step ``step``: drop the records the resumed run will write
    again (steps after ``step``, and the end-of-training summary of the interrupted attempt) and torn lines.
    The file is rewritten atomically (temp file + rename).

    Args:
        including_step: drop the records of ``step`` too: ``samples.jsonl`` of PPO/GRPO, whose records carry the
            optimizer step at which their rollout was sampled (the resumed run samples the rollout of ``step``
            again).

    Returns:
        The number of records dropped.
    """
    import json
    import os

    path = Path(path)
    if not path.is_file():
        return 0
    records = read_jsonl(path, skip_bad_lines=True)
    kept = [r for r in records
            if not (isinstance(r.get("step"), int) and r["step"] >= step + (not including_step))
            and "train_runtime" not in r]
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in kept))
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    if len(kept) < len(records):
        log.info("%s: dropped %d record(s) after step %d (re-run from the checkpoint)", path, len(records) - len(kept),
                 step)
    return len(records) - len(kept)
