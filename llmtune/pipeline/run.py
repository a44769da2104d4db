"""Running a validated pipeline: each step's state on disk (skip / resume / restart), the training, pairs and export
steps, and the summary table and ``pipeline_summary.json``. See :mod:`llmtune.pipeline`."""

from __future__ import annotations

import copy
import gc
import json
import logging
import math
import os
import time
from pathlib import Path

import yaml

from llmtune.config import Recipe, RecipeError
from llmtune.core import rundir as rd
from llmtune.core.callbacks import read_metrics
from llmtune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED
from llmtune.pipeline.pairs import PAIRS_FILE, PAIRS_REPORT, SAMPLES, PairsError, build_pairs, read_samples
from llmtune.pipeline.spec import (
    MERGED, PAIRS_STATE, SUMMARY_FILE, Pipeline, PipelineError, Step, load_pipeline,
)
from llmtune.utils import setup_logging, write_json

def _disk_state(step: Step) -> str:
    """What the step's directory holds: complete / checkpoint-N / partial / new."""
    if step.done_marker.is_file():
        return "complete"
    if step.kind != "pairs":
        ckpt = rd.RunDir(step.dir).latest_checkpoint()
        if ckpt is not None:
            return ckpt.name
    elif (step.dir / SAMPLES).is_file():
        return f"{len(read_samples(step.dir / SAMPLES))} prompts sampled"
    return "partial" if step.dir.is_dir() and any(step.dir.iterdir()) else "new"


def _stale_inputs(step: Step, pipe: Pipeline) -> list[str]:
    """Earlier steps finished after this step's current attempt started (their output changed under it)."""
    if not step.start_marker.is_file():
        return []
    started = step.start_marker.stat().st_mtime
    out = []
    for name in step.inputs:
        marker = pipe.step(name).done_marker
        if marker.is_file() and marker.stat().st_mtime > started:
            out.append(name)
    return out


def _comparable(recipe_dump: dict) -> dict:
    """A resolved recipe without the keys the pipeline sets per attempt (resume_from, overwrite)."""
    out = copy.deepcopy(recipe_dump)
    out.get("train", {}).pop("resume_from", None)
    out.get("output", {}).pop("overwrite", None)
    return out


def _differences(old: dict, new: dict) -> list[str]:
    keys = []
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section), new.get(section)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += [f"{section}.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            keys.append(f"{section}: {a!r} -> {b!r}")
    return keys


def _resolved(recipe: Recipe, base_dir: Path) -> Recipe:
    """The recipe as run_stage will record it: what the stage fills in when built (RM: the score head joins
    ``adapter.modules_to_save``) and ``model.from_run`` inherited; without their log lines."""
    from llmtune.models import inherit_from_run
    from llmtune.stages import STAGES

    quiet = [logging.getLogger(name) for name in ("llmtune.models.lineage", "llmtune")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.WARNING)
    try:
        if recipe.stage in STAGES:
            recipe = STAGES[recipe.stage](recipe.model_copy(deep=True)).recipe
        return inherit_from_run(recipe, base_dir)[0]
    finally:
        for logger, level in zip(quiet, levels):
            logger.setLevel(level)


def plan_stage(step: Step, pipe: Pipeline) -> tuple[str, Recipe | None, str]:
    """Decide what to do with a training step: ``(action, recipe to run, why)``.

    Actions: ``skip`` (complete with the same recipe), ``resume`` (checkpoints, no lineage), ``restart``
    (partial or stale, or changed with ``output.overwrite``), ``train`` (new).

    Raises:
        PipelineError: the directory holds a run trained (or interrupted) with another recipe and the step does
            not set ``output.overwrite: true``.
    """
    run = rd.RunDir(step.dir)
    base = step.recipe
    hint = (f"remove {step.dir} to train it again, or rerun with {step.name}.output.overwrite=true "
            "(later steps that use it are then retrained too)")
    stale = _stale_inputs(step, pipe)
    fresh = base.model_copy(deep=True)
    fresh.output.overwrite, fresh.train.resume_from = True, None
    if stale:
        return "restart", fresh, f"{', '.join(stale)} finished after this step started: its input changed"
    if run.is_complete:
        expected = _resolved(base, pipe.base_dir).model_dump(mode="json")
        done = yaml.safe_load((run / rd.RECIPE).read_text()) if (run / rd.RECIPE).is_file() else {}
        diff = _differences(_comparable(done or {}), _comparable(expected))
        if not diff:
            return "skip", None, "complete with this recipe"
        if step.overwrite:
            return "restart", fresh, f"recipe changed ({'; '.join(diff[:3])}), output.overwrite is set"
        raise PipelineError(f"step {step.name!r}: {step.dir} is complete but was trained with another recipe "
                            f"({'; '.join(diff[:5])}{' ...' if len(diff) > 5 else ''}); {hint}")
    ckpt = run.latest_checkpoint()
    if ckpt is not None:
        try:
            run.check_resume_recipe(_resolved(base, pipe.base_dir).model_dump(mode="json"))
        except RecipeError as exc:
            if step.overwrite:
                return "restart", fresh, "the interrupted run had another recipe, output.overwrite is set"
            raise PipelineError(f"step {step.name!r}: {step.dir} holds an interrupted run ({ckpt.name}) with another "
                                f"recipe:\n{exc}\n{hint}") from None
        resume = base.model_copy(deep=True)
        resume.train.resume_from, resume.output.overwrite = "latest", False
        return "resume", resume, f"continuing from {ckpt.name}"
    if (run / rd.RECIPE).exists() or (run / rd.CHECKPOINTS).exists():
        return "restart", fresh, "interrupted before its first checkpoint"
    return "train", base, "new"


def _run_training(step: Step, pipe: Pipeline, console) -> dict:
    from llmtune.core import launch as launcher
    from llmtune.config import dump_recipe
    from llmtune.core.runner import run_stage
    from llmtune.stages import STAGES

    action, recipe, why = plan_stage(step, pipe)
    console.print(f"  {action}: {why}")
    if action != "skip" and launcher.needs_launch(recipe):  # several processes or DeepSpeed: through torchrun
        path = pipe.dir / f"{step.name}.launch.yaml"
        dump_recipe(recipe, path)
        code = launcher.relaunch(step.kind, str(path), [], recipe)
        if code in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
            from llmtune.core.preempt import PreemptedError

            raise PreemptedError(f"step {step.name!r} was stopped by a signal after writing a checkpoint; run the same "
                                 "command again to continue", code)
        if code != 0:
            raise PipelineError(f"step {step.name!r}: the launched stage failed (exit code {code}); fix it and run "
                                "the same command again (finished steps are kept)")
    elif action != "skip":
        run_stage(STAGES[step.kind](recipe, recipe_dir=pipe.source.parent), base_dir=pipe.base_dir)
        gc.collect()
    return {"action": {"skip": "skipped", "resume": "resumed", "restart": "retrained", "train": "trained"}[action]}


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}h {m % 60:02d}m" if m >= 60 else (f"{m}m {s:02d}s" if m else f"{s}s")


def run_pipeline(pipe: Pipeline, console=None) -> list[dict]:
    """Run every step in order (skipping, resuming or restarting as its directory says), then export.

    Returns:
        The summary rows of this invocation: per step ``name``, ``kind``, ``action``, ``steps``, ``train_loss``,
        ``metric`` + ``metric_value``, ``wall_s`` (this invocation), ``trained_wall_s`` (as recorded by the run),
        ``artifact``. ``<pipeline.dir>/pipeline_summary.json`` keeps, for a skipped step, the numbers of the run
        that did its work (:func:`_write_summary`).

    Raises:
        PipelineError: see :func:`plan_stage`; a pairs step without any pair; a failed export verification.
        RecipeError, DataError, ModelLoadError: from the stages.
    """
    from llmtune.utils import make_console

    setup_logging()
    console = console or make_console(stderr=True)
    pipe.dir.mkdir(parents=True, exist_ok=True)
    _print_plan(pipe, console)
    rows, t_start = [], time.perf_counter()
    active = [s for s in pipe.steps if s.used]
    total = len(active) + int(pipe.export.enabled)
    for n, step in enumerate(active, 1):
        console.rule(f"[bold]step {n}/{total}: {step.name}[/] ({step.kind}) -> {step.dir}")
        t0 = time.perf_counter()
        result = _run_pairs(step, pipe, console) if step.kind == "pairs" else _run_training(step, pipe, console)
        wall = time.perf_counter() - t0
        rows.append(_summary_row(step, result, wall))
        console.print(f"  [green]{step.name} {rows[-1]['action']}[/] in {_fmt_time(wall)} "
                      f"(pipeline {_fmt_time(time.perf_counter() - t_start)})")
    for step in pipe.steps:
        if not step.used:
            rows.append({"name": step.name, "kind": step.kind, "action": "not needed", "artifact": None})
    if pipe.export.enabled:
        console.rule(f"[bold]step {total}/{total}: export[/] {pipe.export.step} -> {pipe.dir / MERGED}")
        t0 = time.perf_counter()
        rows.append(_run_export(pipe, console, t0))
    _write_summary(pipe, rows, time.perf_counter() - t_start, console)
    print_summary(rows, console, time.perf_counter() - t_start)
    return rows


# the numbers a step's artifact carries (lineage, pairs report, verification): equal -> the same artifact
_ARTIFACT_KEYS = ("kind", "artifact", "steps", "train_loss", "metric", "metric_value", "trained_wall_s")


def _write_summary(pipe: Pipeline, rows: list[dict], wall: float, console) -> None:
    """Write ``pipeline_summary.json``: the numbers of the runs that did the work. A step skipped now keeps the
    ``action`` and ``wall_s`` of its row in the earlier summary when that row describes the same artifact (same
    :data:`_ARTIFACT_KEYS`); ``wall_s`` at the top = this invocation + the kept rows' ``wall_s``; ``last_run_wall_s``
    = this invocation. A rerun that skips every step and keeps every row leaves the file as it was."""
    path = pipe.dir / SUMMARY_FILE
    try:
        earlier = {r["name"]: r for r in json.loads(path.read_text())["steps"]} if path.is_file() else {}
    except (ValueError, KeyError, TypeError):  # unreadable or another shape: written anew
        earlier = {}
    kept, merged = 0.0, []
    for row in rows:
        old = earlier.get(row["name"])
        if (row["action"] == "skipped" and old and old.get("action") not in (None, "skipped")
                and isinstance(old.get("wall_s"), (int, float))
                and all(old.get(k) == row.get(k) for k in _ARTIFACT_KEYS)):
            row, kept = {**row, "action": old["action"], "wall_s": old["wall_s"]}, kept + old["wall_s"]
        merged.append(row)
    if earlier and merged == list(earlier.values()) and all(r["action"] == "skipped" for r in rows):
        console.print(f"nothing to do: {path} keeps the numbers of the runs that did the work")
        return
    write_json(path, {"pipeline": str(pipe.source), "dir": str(pipe.dir), "steps": merged,
                      "wall_s": round(wall + kept, 1), "last_run_wall_s": round(wall, 1)})


def _print_plan(pipe: Pipeline, console) -> None:
    from rich.table import Table

    for note in pipe.notes:
        console.print(f"[dim]{note}[/]")
    table = Table(title=f"pipeline {pipe.source.name} -> {pipe.dir}")
    for col in ("#", "step", "kind", "reads", "on disk"):
        table.add_column(col)
    for n, step in enumerate(pipe.steps, 1):
        state = _disk_state(step) if step.used else "not needed (no later step reads it)"
        table.add_row(str(n), step.name, step.kind, ", ".join(step.inputs) or "-", state)
    if pipe.export.enabled:
        table.add_row(str(len(pipe.steps) + 1), "export", pipe.export.dtype, pipe.export.step,
                      "complete" if (pipe.dir / MERGED / "verification.json").is_file() else "new")
    console.print(table)


# ---------------------------------------------------------------------------------------------------------------
# Summary


def _key_metric(kind: str, run_dir: Path, summary: dict) -> tuple[str | None, float | None]:
    """The stage's ``key_metric`` (e.g. eval_loss, eval_accuracy): from the run's final eval, else the last
    metrics.jsonl record with it, else the last record with its training counterpart (the name without eval_)."""
    from llmtune.stages import STAGES

    name = getattr(STAGES.get(kind), "key_metric", "eval_loss")
    final = summary.get("eval_after") or {}
    if isinstance(final.get(name), (int, float)):
        return name, float(final[name])
    path = run_dir / rd.METRICS
    records = read_metrics(path)
    for key in (name, name.removeprefix("eval_")):
        for record in reversed(records):
            if isinstance(record.get(key), (int, float)):
                return key, float(record[key])
    return None, None


def _summary_row(step: Step, result: dict, wall: float) -> dict:
    row = {"name": step.name, "kind": step.kind, "action": result["action"], "wall_s": round(wall, 1),
           "artifact": str(step.artifact)}
    if step.kind == "pairs":
        report = result["report"]
        row.update(metric="pairs", metric_value=report["pairs"],
                   detail=f"{report['pairs']}/{report['prompts']} prompts paired "
                          f"({report['pairs_with_reference']} with the reference)",
                   trained_wall_s=report.get("wall_s"))
        return row
    lineage = json.loads(step.done_marker.read_text()) if step.done_marker.is_file() else {}
    summary = lineage.get("summary", {})
    metric, value = _key_metric(step.kind, step.dir, summary)
    row.update(steps=summary.get("steps"), train_loss=summary.get("train_loss"), metric=metric,
               metric_value=value, trained_wall_s=summary.get("wall_s"), artifact=str(step.dir / rd.ADAPTER))
    return row


def print_summary(rows: list[dict], console, total_s: float) -> None:
    """The final table: step, kind, what happened, steps, train loss, key metric, wall time, artifact."""
    from rich.table import Table

    def num(x, fmt=".4g"):
        return "-" if x is None else format(x, fmt) if isinstance(x, float) and math.isfinite(x) else str(x)

    table = Table(title=f"llmtune pipeline: done in {_fmt_time(total_s)}")
    for col in ("step", "kind", "action", "steps", "train loss", "key metric", "wall", "artifact"):
        table.add_column(col, overflow="fold")
    for r in rows:
        metric = r.get("detail") or (f"{r['metric']} {num(r.get('metric_value'))}" if r.get("metric") else "-")
        wall = _fmt_time(r.get("wall_s"))
        if r["action"] == "skipped" and r.get("trained_wall_s") is not None:
            wall = f"- (took {_fmt_time(r['trained_wall_s'])})"
        table.add_row(r["name"], r["kind"], r["action"], num(r.get("steps")), num(r.get("train_loss")), metric,
                      wall, r.get("artifact") or "-")
    console.print(table)


# ---------------------------------------------------------------------------------------------------------------
# Export


def _run_export(pipe: Pipeline, console, t0: float) -> dict:
    """Export the last policy step into ``<dir>/merged``; skipped when a passed verification of it is newer."""
    from llmtune.export.merge import export_run

    run_dir, out = pipe.step(pipe.export.step).dir, pipe.dir / MERGED
    verification = out / "verification.json"
    row = {"name": "export", "kind": "export", "artifact": str(out)}
    if verification.is_file():
        old = json.loads(verification.read_text())
        dtype_ok = pipe.export.dtype in ("auto", old.get("dtype"))
        newer = verification.stat().st_mtime > (run_dir / rd.LINEAGE).stat().st_mtime
        if old.get("passed") and old.get("run_dir") == str(run_dir) and dtype_ok and newer:
            console.print(f"  skip: {out} already holds a verified export of {run_dir}")
            return _run_gguf(pipe, console, {**row, "action": "skipped", **_export_metric(old)})
    console.print(f"  merging the adapter chain of {run_dir}")
    report = export_run(run_dir, dtype=pipe.export.dtype, out_dir=out)
    row.update(action="exported", wall_s=round(time.perf_counter() - t0, 1), **_export_metric(report))
    if not report.get("passed"):
        raise PipelineError(f"export of {run_dir} failed verification ({out / 'verification.json'}): "
                            f"max |diff| {report.get('max_abs_diff')} > tolerance {report.get('tolerance')}")
    return _run_gguf(pipe, console, row)


def _run_gguf(pipe: Pipeline, console, row: dict) -> dict:
    """``pipeline.export.gguf``: the merged model as GGUF files in ``<dir>/gguf`` (skipped when a passed GGUF
    verification newer than the merged model's covers every type)."""
    if not pipe.export.gguf:
        return row
    from llmtune.export.gguf_export import GGUF_DIR, export_gguf

    report_path = pipe.dir / GGUF_DIR / "verification.json"
    merged_report = pipe.dir / MERGED / "verification.json"
    if report_path.is_file() and report_path.stat().st_mtime > merged_report.stat().st_mtime:
        old = json.loads(report_path.read_text())
        if old.get("passed") and set(pipe.export.gguf) <= set(old.get("types", {})):
            console.print(f"  skip: {report_path.parent} already holds verified GGUF files of {MERGED}")
            return {**row, "gguf": sorted(old["types"])}
    console.print(f"  GGUF {', '.join(pipe.export.gguf)} -> {report_path.parent}")
    report = export_gguf(pipe.dir, pipe.export.gguf, modelfile=pipe.export.modelfile)
    if not report["passed"]:
        failed = [t for t, e in report["types"].items() if not e["passed"]] or ["Modelfile"]
        raise PipelineError(f"GGUF export failed verification for {', '.join(failed)} ({report_path})")
    return {**row, "gguf": list(report["types"]), "detail": row.get("detail", "") + ", GGUF verified"}


def _export_metric(report: dict) -> dict:
    diff = report.get("max_abs_diff")
    verdict = "PASSED" if report.get("passed") else "FAILED"
    return {"metric": "max_abs_diff", "metric_value": diff,
            "detail": f"max |diff| {diff:.3g} {verdict}" if isinstance(diff, float) else verdict}


def _pairs_identity(step: Step, policy_dir: Path) -> dict:
    return {"config": step.pairs.model_dump(mode="json", by_alias=True, exclude={"overwrite"}),
            "policy_run": str(policy_dir)}


def _run_pairs(step: Step, pipe: Pipeline, console) -> dict:
    """Skip, continue or (re)build a pairs step (same rules as training steps, see the module docstring).

    Raises:
        PipelineError: the directory holds complete pairs of another config or policy and ``overwrite`` is off.
    """
    policy_dir = pipe.step(step.pairs.from_).dir
    identity = _pairs_identity(step, policy_dir)
    stale = _stale_inputs(step, pipe)
    report_path, state_path = step.dir / PAIRS_REPORT, step.dir / PAIRS_STATE
    if report_path.is_file() and not stale:
        report = json.loads(report_path.read_text())
        if report.get("identity") == identity:
            console.print(f"  skip: complete ({report['pairs']} pairs)")
            return {"action": "skipped", "report": report}
        if not step.overwrite:
            raise PipelineError(f"step {step.name!r}: {step.dir} holds pairs built with another config or policy; "
                                f"remove it, or rerun with {step.name}.overwrite=true")
    state = json.loads(state_path.read_text()) if state_path.is_file() else None
    if state == identity and not stale and not report_path.is_file():
        console.print("  resume: continuing after the last complete batch of prompts")
        action = "resumed"
    else:
        why = (f"{', '.join(stale)} finished after these pairs were started" if stale
               else "new" if state is None else "another config")
        console.print(f"  build: {why}")
        for name in (SAMPLES, PAIRS_FILE, PAIRS_REPORT, PAIRS_STATE, rd.DATA_REPORT):
            (step.dir / name).unlink(missing_ok=True)
        step.dir.mkdir(parents=True, exist_ok=True)
        write_json(state_path, identity)
        action = "built"
    report = build_pairs(step.pairs, step.dir, policy_dir, base_dir=pipe.base_dir, source_dir=pipe.source.parent,
                         report_extra={"identity": identity, "policy_run": str(policy_dir)},
                         progress=lambda done, n: console.print(f"  sampled {done}/{n} prompts x {step.pairs.k}"))
    return {"action": action, "report": report}


# ---------------------------------------------------------------------------------------------------------------
# Command


def pipeline_command(recipe_path: str, overrides: list[str], dry_run: bool = False) -> int:
    """``llmtune pipeline``: validate everything, show the plan, run it (unless ``dry_run``); the exit code.

    Raises:
        RecipeError: the pipeline recipe has problems (printed by the CLI).
        LaunchError: started as one of several processes (a task of a multi-task ``srun`` step, or by torchrun):
            every process would run every step and the export.
    """
    import sys

    from llmtune.core import launch as launcher
    from llmtune.utils import make_console

    step = launcher.slurm_step()
    if step is not None or launcher.under_launcher():
        how = (f"a task of an srun step of {step.ntasks} tasks" if step is not None
               else f"rank {os.environ.get('RANK')} of {os.environ.get('WORLD_SIZE')} processes of a launcher")
        raise launcher.LaunchError(
            f"llmtune pipeline was started as {how}: each process would run every step and the export. Start it as "
            "ONE process on one node (srun --ntasks 1, or no launcher): it starts torchrun itself for a step with "
            "distributed.nproc_per_node > 1 or DeepSpeed. A stage across several nodes: its own command under srun "
            "(srun --ntasks-per-node 1 llmtune sft RECIPE, as scripts/slurm_zero3.sbatch does)")
    console = make_console(stderr=True)
    pipe = load_pipeline(recipe_path, overrides, base_dir=Path("."))
    if dry_run:
        _print_plan(pipe, console)
        console.print("recipe OK (dry run: nothing trained)")
        return 0
    try:
        run_pipeline(pipe, console)
    except (PipelineError, PairsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\ninterrupted. Checkpoints and finished steps in {pipe.dir} are kept: run the same command again "
              "to continue where it stopped.", file=sys.stderr)
        return 130
    return 0
