"""Trainer callbacks: metrics.jsonl (one JSON object per log/eval) and loss.png at the end."""

from __future__ import annotations

from pathlib import Path

from transformers import TrainerCallback

from llmtune.utils import append_jsonl, read_jsonl


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

    records = read_jsonl(metrics_path) if Path(metrics_path).exists() else []
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
