"""The plots of a finished CLI run: both PNGs written, and the summary's panels read back from its metrics.jsonl
with the stage's Stage.plot_metrics (so the names a stage declares are the names it logs)."""

from llmtune.core.callbacks import read_metrics
from llmtune.core.plots import metric_panels, summary_panels
from llmtune.stages import STAGES


def summary_of(run, stage: str) -> dict:
    """``{panel: {label: points}}`` of ``run``'s summary figure; asserts ``plots/`` holds the two PNGs."""
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["all_metrics.png", "summary.png"]
    return summary_panels(metric_panels(read_metrics(run / "metrics.jsonl")), STAGES[stage].plot_metrics)
