"""The run's plots, drawn at the end of a stage from ``metrics.jsonl`` into ``plots/``:

    plots/summary.png       the few curves that say whether the stage works (``Stage.plot_metrics``: SFT loss;
                            RM accuracy and margin; DPO-family reward accuracy and margins; PPO/GRPO reward, KL,
                            length, clip fraction), each with its eval points
    plots/all_metrics.png   every series that varies (constant ones, e.g. ``nonfinite_steps`` = 0 or a fixed
                            ``kl_coef``, are left out; bookkeeping, throughput and timings are not curves)
    plots/agent.png         multi-turn runs only (``agent/`` metrics logged): what an agent run is judged by, per
                            rollout batch (:func:`agent_panels`): each reward source's mean (the task reward apart
                            from any shaping term) with its eval twin, tool calls per trajectory, the truncated
                            share (with its eval twin), how rollouts ended, tool errors and turns

Selection is pure (:func:`metric_panels`, :func:`varying_panels`, :func:`summary_panels`); drawing
(:func:`panel_figure`) uses matplotlib's object API on the Agg canvas (no pyplot, no global backend switch) with a
fixed layout: ``tight_layout`` measured every tick label of every panel and took most of the time (26 panels: 23 of
46 s under cProfile on a loaded 2-core machine).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Union

Series = list[tuple[int, float]]  # (optimizer step, value)
Panel = dict[str, Series]  # label -> points: "train"/"eval" for one metric, the metric keys for a group
PlotEntry = Union[str, tuple[str, ...]]  # one metric (its panel with its eval twin), or metrics that share a panel

SUMMARY = "summary.png"
ALL_METRICS = "all_metrics.png"
AGENT = "agent.png"
# plots/agent.png after the reward panels: calls, truncation, finish reasons, tool errors, turns (llmtune.rl.agent)
AGENT_PANELS: tuple[PlotEntry, ...] = (
    "agent/tool_calls", "truncated_fraction",
    ("agent/finish_stop", "agent/finish_length", "agent/finish_turns", "agent/finish_error"),
    "agent/tool_error_rate", "agent/turns")

# not curves: bookkeeping, throughput and timings, cumulative counters, constant eval set sizes
_NOT_PLOTTED = {"step", "epoch", "total_flos", "peak_mem_gb", "tokens_per_s", "kl_coef_target"}
_NOT_PLOTTED_PARTS = ("runtime", "per_second", "model_preparation_time")
_NOT_PLOTTED_PREFIXES = ("train_", "trained_", "seen_")
_NOT_PLOTTED_SUFFIXES = ("_prompts", "_pairs", "_rows", "_tokens", "_items")
_LAST = ("learning_rate", "grad_norm")  # optimiser health panels go last
_UNITS = {"response_length": "tokens", "completion_length": "tokens", "grad_norm": "before clipping"}


def _plotted(key: str, value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and key not in _NOT_PLOTTED
            and not key.startswith(_NOT_PLOTTED_PREFIXES) and not key.endswith(_NOT_PLOTTED_SUFFIXES)
            and not any(p in key for p in _NOT_PLOTTED_PARTS))


def metric_panels(records: list[dict]) -> dict[str, Panel]:
    """Group the numeric series of ``metrics.jsonl`` into panels: ``{panel: {"train": [(step, v)], "eval": [...]}}``.

    A training metric ``m`` and its eval twin ``eval_m`` share a panel (PPO's ``eval_score`` joins ``score_mean``,
    GRPO's ``eval_reward`` joins ``reward_mean``); ``loss`` comes first, then every stage metric in the order it
    first appears, ``learning_rate`` and ``grad_norm`` last. The end-of-training record (``train_runtime``,
    ``train_loss``, ...) and records without a ``step`` are not points of a curve.
    """
    records = [r for r in records if "step" in r and "train_runtime" not in r]
    train_keys = {k for r in records if not any(x.startswith("eval_") for x in r) for k in r}
    panels: dict[str, Panel] = {}
    for r in records:
        for key, value in r.items():
            if not _plotted(key, value):
                continue
            kind = "eval" if key.startswith("eval_") else "train"
            name = key.removeprefix("eval_")
            if kind == "eval" and name not in train_keys and f"{name}_mean" in train_keys:
                name = f"{name}_mean"
            panels.setdefault(name, {"train": [], "eval": []})[kind].append((r["step"], float(value)))
    order = sorted(panels, key=lambda n: (n != "loss", n in _LAST, _LAST.index(n) if n in _LAST else 0))
    return {n: panels[n] for n in order}


def is_constant(panel: Panel) -> bool:
    """True when the panel has at least two points and all of them (train and eval) are equal (NaN equals NaN):
    a line that says nothing (``nonfinite_steps`` = 0, a fixed ``kl_coef``). One point is not constant: a lone
    eval is drawn and labelled."""
    values = [v for points in panel.values() for _, v in points]
    return len(values) >= 2 and all(v == values[0] or (math.isnan(v) and math.isnan(values[0])) for v in values)


def varying_panels(panels: dict[str, Panel]) -> dict[str, Panel]:
    """The panels of :func:`metric_panels` without the constant ones (:func:`is_constant`), order kept."""
    return {name: panel for name, panel in panels.items() if not is_constant(panel)}


def summary_panels(panels: dict[str, Panel], chosen: tuple[PlotEntry, ...]) -> dict[str, Panel]:
    """The stage's chosen panels (``Stage.plot_metrics``) in the order chosen; a metric the run did not log is
    skipped (a recipe without eval, GRPO without a reference model has no ``kl``).

    Args:
        panels: :func:`metric_panels` of the run (constant panels included: a flat reward is what the summary
            must show).
        chosen: entries; a string names one panel (a training metric with its eval twin); a tuple of names draws
            those metrics in one panel titled ``"a, b"`` whose series are labelled by metric (``rewards/chosen``,
            ``eval_rewards/chosen``, ...).

    Returns:
        ``{title: panel}``; one-metric panels keep their ``"train"``/``"eval"`` labels.
    """
    out: dict[str, Panel] = {}
    for entry in chosen:
        if isinstance(entry, str):
            if entry in panels:
                out[entry] = panels[entry]
            continue
        present = [m for m in entry if m in panels]
        group: Panel = {}
        for m in present:
            for kind, points in panels[m].items():
                if points:
                    group[m if kind == "train" else f"eval_{m}"] = points
        if group:
            out[", ".join(present)] = group
    return out


def agent_panels(panels: dict[str, Panel]) -> dict[str, Panel]:
    """The panels of ``plots/agent.png``, or ``{}`` for a run that logged no ``agent/`` metric (not multi-turn).

    First one panel per reward source, ``rewards/<source>_mean`` of the training rollouts with its eval twin
    (``eval_rewards/<source>``): a task reward apart from shaping terms (a format bonus, a per-call cost), since a
    total can rise while the task reward does not; ``reward_mean`` (the weighted total) instead when the run logged
    no source. Then :data:`AGENT_PANELS` (:func:`summary_panels`: a metric the run did not log is skipped).

    Args:
        panels: :func:`metric_panels` of the run.
    """
    if not any(name.startswith("agent/") for name in panels):
        return {}
    sources = [n for n in panels if n.startswith("rewards/") and n.endswith("_mean")]
    chosen = summary_panels(panels, (*(sources or ["reward_mean"]), *AGENT_PANELS))
    finish = ", ".join(m for m in AGENT_PANELS[2] if m in panels)  # the finish reasons' panel: a short title
    return {("agent/finish_* (share of rollouts)" if name == finish else name): panel
            for name, panel in chosen.items()}


def draw_panels(panels: dict[str, Panel], out_path: str | Path, title: str | None = None, cols: int = 3,
                dpi: int = 100) -> Path:
    """Draw panels (:func:`panel_figure`) into one PNG of ``cols`` x 360 px by 250 px per row (+ title) at the
    default ``dpi`` of 100.

    Raises:
        OSError: the PNG cannot be written.
    """
    fig = panel_figure(panels, title, cols, dpi)
    fig.savefig(out_path, dpi=dpi)
    return Path(out_path)


def panel_figure(panels: dict[str, Panel], title: str | None = None, cols: int = 3, dpi: int = 100):
    """A matplotlib ``Figure`` of the panels (x: optimizer step), ``cols`` per row, each 3.6 x 2.5 inches.

    A series of one point (an eval run once) is a large marker labelled with its value; a constant panel says so
    in its title. The layout is fixed (margins in inches), not ``tight_layout``; no pyplot (nothing global).
    """
    from matplotlib.figure import Figure

    cols = max(1, min(cols, len(panels)))
    rows = math.ceil(len(panels) / cols)
    w, h, top, bottom, left, right = 3.6, 2.5, 0.35 + 0.3 * bool(title), 0.5, 0.65, 0.2  # inches
    width, height = max(cols * w, 6.0), rows * h + top  # a title fits over one panel
    fig = Figure(figsize=(width, height), dpi=dpi)
    fig.subplots_adjust(left=left / width, right=1 - right / width, top=1 - top / height,
                        bottom=bottom / height, hspace=0.5, wspace=0.35)
    axes = list(fig.subplots(rows, cols, squeeze=False).flat)
    for ax, (name, panel) in zip(axes, panels.items()):
        steps_drawn = [s for points in panel.values() for s, _ in points]
        middle = (min(steps_drawn) + max(steps_drawn)) / 2
        for label, points in panel.items():
            if not points:
                continue
            steps, values = zip(*points)
            is_eval = label == "eval" or label.startswith("eval_")
            if len(points) == 1:
                line, = ax.plot(steps, values, "D" if is_eval else "o", ms=7, label=label)
                left = steps[0] > middle  # the label on the side with room (an eval at the end: to the left)
                ax.annotate(f"{values[0]:.4g}", (steps[0], values[0]), xytext=(-7 if left else 7, 5),
                            textcoords="offset points", ha="right" if left else "left", fontsize=7,
                            color=line.get_color())
            else:  # the points marked while they are few enough to tell apart
                ax.plot(steps, values, ("o-" if is_eval else ".-") if len(points) <= 60 else "-", lw=1.2,
                        ms=4 if is_eval else 3, label=label)
        unit = _UNITS.get(name, "")
        constant = is_constant(panel)
        first = next(v for points in panel.values() for _, v in points)
        ax.set_title(name + (f" ({unit})" if unit else "") + (f"  [constant {first:.4g}]" if constant else ""),
                     fontsize=9, y=1.0)  # an explicit y: no measuring of the tick labels to place it
        ax.set_xlabel("optimizer step", fontsize=8, labelpad=1)
        ax.tick_params(labelsize=7)
        ax.locator_params(nbins=5)
        ax.locator_params(axis="x", integer=True)  # steps
        ax.grid(alpha=0.3)
        if sum(bool(p) for p in panel.values()) > 1:
            ax.legend(fontsize=6)
    for ax in axes[len(panels):]:  # the rest of the last row
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10, y=1 - 0.12 / height, va="top")
    return fig


def plot_run(metrics_path: str | Path, plot_dir: str | Path, chosen: tuple[PlotEntry, ...] = ("loss",),
             title: str | None = None) -> list[Path]:
    """Write ``plots/summary.png`` (the stage's chosen panels, :func:`summary_panels`),
    ``plots/all_metrics.png`` (every varying series, :func:`varying_panels`) and, for a multi-turn run,
    ``plots/agent.png`` (:func:`agent_panels`) of a run's ``metrics.jsonl``.

    Args:
        metrics_path: the run's ``metrics.jsonl`` (torn lines skipped, :func:`llmtune.core.callbacks.read_metrics`).
        plot_dir: the run's ``plots/`` (created).
        chosen: the stage's ``plot_metrics``.
        title: figure title (e.g. ``llmtune dpo: runs/dpo``).

    Returns:
        The PNGs written; a figure with nothing to draw is not written (``[]`` for a missing or empty file).
    """
    from llmtune.core.callbacks import read_metrics

    panels = metric_panels(read_metrics(metrics_path))
    figures = [(SUMMARY, summary_panels(panels, chosen), 3), (ALL_METRICS, varying_panels(panels), 4),
               (AGENT, agent_panels(panels), 3)]
    written = []
    for name, selected, cols in figures:
        if selected:
            Path(plot_dir).mkdir(parents=True, exist_ok=True)
            written.append(draw_panels(selected, Path(plot_dir) / name, title, cols=cols))
    return written
