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


# not curves: bookkeeping, throughput and timings, cumulative counters, constant eval set sizes
_NOT_PLOTTED = {"step", "epoch", "total_flos", "peak_mem_gb", "tokens_per_s", "kl_coef_target"}
_NOT_PLOTTED_PARTS = ("runtime", "per_second", "model_preparation_time")
_NOT_PLOTTED_PREFIXES = ("train_", "trained_", "seen_")
_NOT_PLOTTED_SUFFIXES = ("_prompts", "_pairs", "_rows", "_tokens", "_items")
_LAST = ("learning_rate", "grad_norm")  # optimiser health panels go last
_UNITS = {"kl": "nats per response",
          "response_length": "tokens", "learning_rate": "", "grad_norm": "before clipping"}


def _plotted(key: str, value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and key not in _NOT_PLOTTED
            and not key.startswith(_NOT_PLOTTED_PREFIXES) and not key.endswith(_NOT_PLOTTED_SUFFIXES)
            and not any(p in key for p in _NOT_PLOTTED_PARTS))


def metric_panels(records: list[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Group the numeric series of ``metrics.jsonl`` into panels: ``{panel: {"train": [(step, v)], "eval": [...]}}``.

    A training metric ``m`` and its eval twin ``eval_m`` share a panel (PPO's ``eval_score`` joins ``score_mean``);
    ``loss`` comes first, then every stage metric in the order it first appears (RM accuracy/margin, DPO
    rewards/accuracies and margins, PPO score, KL, response length, ...), ``learning_rate`` and ``grad_norm`` last.
    """
    train_keys = {k for r in records if not any(x.startswith("eval_") for x in r) for k in r}
    panels: dict[str, dict[str, list]] = {}
    for r in records:
        for key, value in r.items():
            if not _plotted(key, value) or "step" not in r:
                continue
            kind = "eval" if key.startswith("eval_") else "train"
            name = key.removeprefix("eval_")
            if kind == "eval" and name not in train_keys and f"{name}_mean" in train_keys:
                name = f"{name}_mean"
            panels.setdefault(name, {"train": [], "eval": []})[kind].append((r["step"], float(value)))
    order = sorted(panels, key=lambda n: (n != "loss", n in _LAST, _LAST.index(n) if n in _LAST else 0))
    return {n: panels[n] for n in order}


def plot_losses(metrics_path: str | Path, out_path: str | Path, title: str | None = None) -> Path | None:
    """Draw every stage metric of ``metrics.jsonl`` against optimizer steps into one PNG, one panel per metric with
    its training curve and eval points (:func:`metric_panels`); ``None`` when nothing to draw.

    Args:
        metrics_path: the run's ``metrics.jsonl``.
        out_path: the PNG to write (``loss.png``).
        title: figure title (e.g. ``llmtune dpo: runs/dpo``).
    """
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    panels = metric_panels(records)
    if not panels:
        return None
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.9 * rows), squeeze=False)
    for ax, (name, series) in zip(axes.flat, panels.items()):
        if series["train"]:
            ax.plot(*zip(*series["train"]), ".-", label="train", lw=1.2, ms=3)
        if series["eval"]:
            ax.plot(*zip(*series["eval"]), "o-", label="eval", lw=1.2, ms=4)
        unit = _UNITS.get(name.removesuffix("_mean"), "")
        ax.set_title(name + (f" ({unit})" if unit else ""), fontsize=9)
        ax.set_xlabel("optimizer step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if series["train"] and series["eval"]:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (2.9 * rows)) if title else None)
    fig.savefig(out_path, dpi=100)
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
