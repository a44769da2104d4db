"""Trainer callbacks: metrics.jsonl (one JSON object per log/eval) and loss.png at the end."""

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


def plot_losses(metrics_path: str | Path, out_path: str | Path) -> Path | None:
    """Draw train loss and eval loss against optimizer steps into a PNG; ``None`` when nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    if not train and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if evals:
        ax.plot(*zip(*evals), "o-", label="eval loss", lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean per trained token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return Path(out_path)


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


def truncate_metrics(path: str | Path, step: int) -> int:
    """Before resuming from the checkpoint of optimizer step ``step``: drop the records the resumed run will write
    again (steps after ``step``, and the end-of-training summary of the interrupted attempt) and torn lines.
    The file is rewritten atomically (temp file + rename).

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
            if not (isinstance(r.get("step"), int) and r["step"] > step) and "train_runtime" not in r]
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
