"""Before -> after table of a pipeline run: did every stage's held-out metric move the right way?

Reads ``<pipeline dir>/<step>/metrics.jsonl`` of every trained step (the pipeline's ``pairs`` step and the ``merged``
export have none and are skipped). "before" is the eval record logged at step 0 (``train.eval_at_start: true``),
"after" is the last eval record (the evaluation after training). The stage of a step is read from its
``recipe.resolved.yaml``.

Usage:  python scripts/quickstart_report.py runs/quickstart_pipeline      (scripts/quickstart.sh calls it)
Exit status: 0 (a report), 2 when the directory holds no trained step.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import yaml

from llmtune.core.stage import HIGHER, LOWER, HeldOutMetric  # noqa: F401 (HIGHER: the other direction)
from llmtune.stages import STAGES
from llmtune.utils import read_jsonl

LN2 = math.log(2)  # DPO's loss when the policy equals its reference (every margin 0)
STAGE_ORDER = ["sft", "rm", "dpo", "orpo", "simpo", "kto", "ppo", "grpo"]


def before_after(records: list[dict], metric: str) -> tuple[float | None, float | None]:
    """``(value at step 0, last value)`` of ``metric`` among the eval records of a ``metrics.jsonl``.

    The step-0 value exists only when the run evaluated before training (``train.eval_at_start``); the last value
    is the evaluation after training. Either is None when no record has it (a number, not NaN).
    """
    values = [(r.get("step"), r[metric]) for r in records
              if isinstance(r.get(metric), (int, float)) and not isinstance(r.get(metric), bool)
              and math.isfinite(r[metric])]
    if not values:
        return None, None
    before = next((v for step, v in values if step == 0), None)
    last_step, after = values[-1]
    if last_step == 0 and len(values) == 1:  # only the start eval exists (training interrupted): no "after"
        after = None
    return before, after


def verdict(before: float | None, after: float | None, direction: str | None, chance: float | None = None) -> str:
    """``yes`` / ``NO`` / ``-`` (not judged) / why it cannot be judged. ``direction``: ``"higher"``/``"lower"`` is
    better, None = not judged. ``chance``: the after value must also be above it (a pair accuracy; DPO's step-0
    accuracy is 0, every margin an exact tie)."""
    if direction is None:
        return "-"
    if before is None:
        return "no step-0 eval (train.eval_at_start: false)" if after is not None else "no eval"
    if after is None:
        return "no eval after training"
    better = after < before if direction == LOWER else after > before
    if better and chance is not None and after <= chance:
        return f"NO (not above chance {chance:g})"
    return "yes" if better else "NO"


def step_dirs(pipeline_dir: Path) -> list[tuple[str, str, Path]]:
    """``(step name, stage, run dir)`` of every trained step under ``pipeline_dir``, in stage order."""
    found = []
    for run in sorted(p for p in pipeline_dir.iterdir() if p.is_dir()):
        recipe, metrics = run / "recipe.resolved.yaml", run / "metrics.jsonl"
        if not (recipe.is_file() and metrics.is_file()):
            continue
        stage = (yaml.safe_load(recipe.read_text()) or {}).get("stage", "?")
        found.append((run.name, str(stage), run))
    rank = {s: i for i, s in enumerate(STAGE_ORDER)}
    return sorted(found, key=lambda f: (rank.get(f[1], len(rank)), f[0]))


def report_rows(pipeline_dir: Path) -> list[dict]:
    """One row per (step, metric): ``step``, ``stage``, ``metric``, ``direction``, ``before``, ``after``,
    ``verdict``."""
    rows = []
    for name, stage, run in step_dirs(pipeline_dir):
        records = [r for r in read_jsonl(run / "metrics.jsonl", skip_bad_lines=True)
                   if any(k.startswith("eval_") for k in r)]
        declared = STAGES[stage].held_out_metrics if stage in STAGES else (HeldOutMetric("eval_loss", LOWER),)
        for m in declared:  # the stage's own declaration (llmtune.core.stage.Stage.held_out_metrics)
            before, after = before_after(records, m.name)
            if before is None and after is None:
                continue
            rows.append({"step": name, "stage": stage, "metric": m.name, "direction": m.better,
                         "before": before, "after": after, "verdict": verdict(before, after, m.better, m.chance)})
    return rows


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def print_report(rows: list[dict], title: str) -> None:
    """The rich table: step | stage | metric (better when) | before | after | moved the right way?"""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("step", "stage", "held-out metric", "before", "after", "moved the right way?"):
        table.add_column(col, overflow="fold")
    for r in rows:
        label = r["metric"] + (f" ({r['direction']} is better)" if r["direction"] else "")
        if r["stage"] == "dpo" and r["metric"] == "eval_loss":
            label += f", ln 2 = {LN2:.4f}"
        style = {"yes": "green", "NO": "red"}.get(r["verdict"], "")
        table.add_row(r["step"], r["stage"], label, _num(r["before"]), _num(r["after"]),
                      f"[{style}]{r['verdict']}[/{style}]" if style else r["verdict"])
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pipeline_dir", type=Path, help="the pipeline's directory (pipeline.dir)")
    args = parser.parse_args(argv)
    if not args.pipeline_dir.is_dir():
        print(f"error: {args.pipeline_dir} is not a directory; pass the pipeline's pipeline.dir "
              "(default runs/quickstart_pipeline)", file=sys.stderr)
        return 2
    rows = report_rows(args.pipeline_dir)
    if not rows:
        print(f"error: no trained step with eval metrics under {args.pipeline_dir} (each step writes "
              "<step>/metrics.jsonl); run the pipeline first", file=sys.stderr)
        return 2
    print_report(rows, f"held-out metrics before -> after training: {args.pipeline_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
