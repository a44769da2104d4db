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


def plot_losses(metrics_path: str | Path, out_path: str | Path) -> Path | None:
    """Draw train loss and eval loss against optimizer steps into a PNG; ``None`` when nothing to draw."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_jsonl(metrics_path) if Path(metrics_path).exists() else []
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
