"""``llmtune pipeline RECIPE``: run a list of stages into one directory, resumably, and export the result.

A pipeline recipe has one section::

    pipeline:
      dir: runs/my_pipeline            # every step writes <dir>/<name>; the export goes to <dir>/merged
      stages:
        - {name: sft, recipe: sft.yaml, overrides: {train.max_steps: 30}}      # a recipe file (relative to
        - name: pairs                                                          #   this file) or a mapping
          kind: pairs                  # on-policy preference pairs (see PairsStep)
          from: sft
          data: {datasets: [{path: builtin:gsm8k, max_samples: 64}]}
          reward: {function: llmtune.rewards:gsm8k_reward}
        - {name: dpo, stage: dpo, recipe: {data: {datasets: [{path: "{pairs}"}]}}}
      export: {dtype: fp32}

Wiring: ``output.dir`` = ``<dir>/<name>``; ``model.from_run`` = the latest earlier policy step (sft/dpo/ppo/grpo:
stages with a causal-LM head), for ``rm`` too (InstructGPT initialises the reward model from the SFT model);
``ppo``'s and ``grpo``'s ``reward.from_run`` = the latest earlier ``rm`` step unless it sets a reward function. A run
directory the step sets in its inline recipe or ``overrides`` wins; one named inside a recipe FILE (e.g. ``from_run:
runs/quickstart_sft`` of a standalone recipe) is rewired. A string ``"{NAME}"`` (or ``"{NAME}/sub/path"``)
anywhere in a step names an earlier step's artifact: its run directory, or for a pairs step its ``pairs.jsonl``.
A data source may carry ``when_missing: {path: ..., format: ...}``, the source used instead when its ``path`` does
not exist (e.g. HH-RLHF pairs if the file is there, else on-policy pairs); a pairs step no later step reads is
not run.

State on disk decides what runs, so the same command continues after Ctrl-C or a kill:

* a complete step (``lineage.json``; ``pairs_report.json`` for pairs) trained with the recipe that would run now
  is skipped and left untouched; with another recipe the pipeline stops and says to remove the directory or set
  ``NAME.output.overwrite=true`` (pairs: ``NAME.overwrite=true``);
* a step with checkpoints but no ``lineage.json`` resumes from the latest one (``train.resume_from=latest``);
  a pairs step continues after its last complete batch of prompts (``samples.jsonl``);
* a partial step without a checkpoint restarts; a step whose input (an earlier step) was finished after it
  started is stale and is trained again.

Stages run in this process, one after another, through :func:`llmtune.core.runner.run_stage` (the code of
``llmtune sft|rm|dpo|ppo``): no Python start and torch import per stage, and Ctrl-C reaches the trainer directly
(its checkpoints stay). Each stage's objects are dropped and garbage-collected before the next one. A stage that
asks for several processes or DeepSpeed is started through torchrun like ``llmtune <stage>`` does
(:mod:`llmtune.launch`, with its resolved recipe in ``<dir>/<name>.launch.yaml``); run the pipeline command itself
without a launcher.

Overrides on the command line name the step: ``sft.train.max_steps=10``, ``pairs.k=2``,
``pipeline.export.dtype=bf16``.
"""

from __future__ import annotations

import copy
import difflib
import gc
import json
import logging
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmtune.config import Recipe, RecipeError, load_recipe
from llmtune.config.load import apply_override, deep_merge, parse_override, read_yaml
from llmtune.core import rundir as rd
from llmtune.core.callbacks import read_metrics
from llmtune.pairs import PAIRS_FILE, PAIRS_REPORT, SAMPLES, PairsConfig, PairsError, build_pairs, read_samples
from llmtune.utils import get_logger, setup_logging, write_json
from llmtune.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, LlmtuneError

log = get_logger("pipeline")

PAIRS_STATE, SUMMARY_FILE, MERGED = "pairs_state.json", "pipeline_summary.json", "merged"
_REF = re.compile(r"^\{([A-Za-z_][\w-]*)\}(/.*)?$")  # "{name}" or "{name}/sub/path"; never matches Jinja "{{ x }}"
_NAME = re.compile(r"^[A-Za-z_][\w-]*$")
RESERVED = {"pipeline", MERGED}


class PipelineError(LlmtuneError, RuntimeError):
    """A step's directory conflicts with what would run (changed recipe), or a step produced nothing usable."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=(), strict=True,
                              allow_inf_nan=False)


class StageStep(_Spec):
    """A training step: one ``llmtune sft|rm|dpo|ppo|grpo`` run."""

    name: str = Field(..., description="Step name: its directory under pipeline.dir and its {name} reference.")
    stage: Literal["sft", "rm", "dpo", "ppo", "grpo", "orpo", "simpo", "kto"] | None = Field(
        None, description="Stage to run (default: the recipe's stage:, else the step name if it is a stage).")
    recipe: str | dict[str, Any] | None = Field(
        None, description="A recipe file (relative to the pipeline file) or an inline recipe mapping (may use base:).")
    overrides: dict[str, Any] = Field(
        default_factory=dict, description="Dotted recipe keys set after loading, e.g. {train.max_steps: 20}.")


class PairsStep(PairsConfig):
    """A pairs step: on-policy preference pairs from an earlier policy step (see :class:`PairsConfig`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True, protected_namespaces=(), strict=True,
                              allow_inf_nan=False)

    name: str = Field(..., description="Step name; {name} refers to its pairs.jsonl.")
    kind: Literal["pairs"] = Field("pairs", description="pairs: build on-policy preference pairs.")
    from_: str | None = Field(None, alias="from", description="Policy step sampled from (default: the latest "
                              "earlier sft/dpo/ppo step).")
    overwrite: bool = Field(False, description="Rebuild when the step's directory holds pairs from another config.")


class ExportSpec(_Spec):
    """The final ``llmtune export`` of a policy step's adapter chain into ``<pipeline.dir>/merged``."""

    enabled: bool = Field(True, description="Export at the end.")
    step: str | None = Field(None, description="Step to export (default: the last policy step).")
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = Field("auto", description="dtype of the saved weights.")


@dataclass
class Step:
    """A resolved pipeline step.

    Attributes:
        kind: ``sft``/``rm``/``dpo``/``ppo``/``grpo`` or ``pairs``.
        recipe: the validated stage recipe (training steps), with output.dir and from_run wired.
        pairs: the pairs config (pairs steps).
        inputs: names of the earlier steps it reads (from_run, reward.from_run, {name} references).
        overwrite: the step explicitly allows replacing a directory trained with another recipe.
        used: False for a pairs step whose pairs.jsonl no later step reads (it is skipped).
    """

    index: int
    name: str
    kind: str
    dir: Path
    recipe: Recipe | None = None
    pairs: PairsStep | None = None
    inputs: list[str] = field(default_factory=list)
    overwrite: bool = False
    used: bool = True

    @property
    def artifact(self) -> Path:
        """What ``{name}`` refers to: ``pairs.jsonl`` of a pairs step, else the run directory."""
        return self.dir / PAIRS_FILE if self.kind == "pairs" else self.dir

    @property
    def done_marker(self) -> Path:
        """Written last when the step completes."""
        return self.dir / (PAIRS_REPORT if self.kind == "pairs" else rd.LINEAGE)

    @property
    def start_marker(self) -> Path:
        """Written when the step's current attempt started."""
        return self.dir / (PAIRS_STATE if self.kind == "pairs" else rd.RECIPE)


@dataclass
class Pipeline:
    """A validated pipeline: its steps in order, the export, and where relative paths resolve."""

    source: Path
    dir: Path
    steps: list[Step]
    export: ExportSpec
    base_dir: Path
    notes: list[str] = field(default_factory=list)

    def step(self, name: str) -> Step:
        return next(s for s in self.steps if s.name == name)


def _is_policy(kind: str) -> bool:
    from llmtune.stages import STAGES

    return kind != "pairs" and getattr(STAGES.get(kind), "model_head", "causal_lm") == "causal_lm"


def _fields_at(cls: type[BaseModel], loc: tuple) -> list[str]:
    """Field names (aliases where set) of the (nested) model that ``loc`` without its last element points into."""
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        f = next((f for n, f in cls.model_fields.items() if part in (n, f.alias)), None)
        ann = f.annotation if f is not None else None
        cls = next((c for c in (ann, *getattr(ann, "__args__", ())) if isinstance(c, type) and issubclass(c, BaseModel)),
                   None)
        if cls is None:
            return []
    return [f.alias or n for n, f in cls.model_fields.items()]


def _spec_problems(err: ValidationError, cls: type[BaseModel], where: str) -> list[tuple[str, str]]:
    """Pydantic errors of a pipeline section as ``(where + dotted path, message)``, unknown keys with a hint."""
    out = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            names = _fields_at(cls, tuple(e["loc"]))
            close = difflib.get_close_matches(str(e["loc"][-1]), names, n=1, cutoff=0.6)
            msg = f"unknown key; did you mean {close[0]!r}?" if close else f"unknown key; valid keys: {', '.join(names)}"
        else:
            msg = e["msg"] + (f" (got {e['input']!r})" if "input" in e and e["type"] != "missing" else "")
        out.append((f"{where}{path}", msg))
    return out


_MISSING = object()


def _has(doc: dict, dotted: str) -> bool:
    from llmtune.config.validate import _get

    return _get(doc, dotted, _MISSING) is not _MISSING


def _set(doc: dict, dotted: str, value: Any) -> None:
    apply_override(doc, dotted.split("."), value)


def _substitute(obj: Any, known: dict[str, Path], deps: set[str], later: set[str], problems: list, where: str,
                path: str = "") -> Any:
    """Replace ``"{name}"``/``"{name}/x"`` strings by earlier steps' artifacts; collect the names used."""
    if isinstance(obj, dict):
        return {k: _substitute(v, known, deps, later, problems, where, f"{path}.{k}" if path else str(k))
                for k, v in obj.items()}
    if isinstance(obj, list):
        return [_substitute(v, known, deps, later, problems, where, f"{path}.{i}") for i, v in enumerate(obj)]
    match = _REF.match(obj) if isinstance(obj, str) else None
    if not match:
        return obj
    name, rest = match.group(1), match.group(2) or ""
    if name in known:
        deps.add(name)
        return str(known[name]) + rest
    if name in later:
        problems.append((f"{where}{path}", f"{obj!r} refers to step {name!r}, which runs later; reorder the stages"))
    else:
        problems.append((f"{where}{path}", f"{obj!r} names no earlier step (steps so far: "
                         f"{', '.join(known) or 'none'})"))
    return obj


def _apply_when_missing(doc: dict, base_dir: Path, where: str, notes: list[str], problems: list) -> None:
    """Replace each data source whose ``path`` does not exist by its ``when_missing`` source (in place)."""
    datasets = (doc.get("data") or {}).get("datasets")
    for i, ds in enumerate(datasets if isinstance(datasets, list) else []):
        if not isinstance(ds, dict) or "when_missing" not in ds:
            continue
        fallback = ds.pop("when_missing")
        if not isinstance(fallback, dict) or "path" not in fallback:
            problems.append((f"{where}data.datasets.{i}.when_missing", "must be a data source mapping with a path, "
                             "e.g. {path: \"{pairs}\", format: preference_messages}"))
            continue
        path = str(ds.get("path", ""))
        if path.startswith("builtin:") or (base_dir / path).exists():
            notes.append(f"{where}data.datasets.{i}: {path} exists: using it")
        else:
            datasets[i] = fallback
            notes.append(f"{where}data.datasets.{i}: {path} not found: using {fallback['path']} instead")


def _local_path_problems(datasets: list, base_dir: Path, produced: set[str], where: str) -> list[tuple[str, str]]:
    """Local data files that do not exist (and are not produced by an earlier step)."""
    from llmtune.data.sources import LOCAL_SUFFIXES

    out = []
    for i, ds in enumerate(datasets):
        path = ds.path
        if path in produced or path.startswith("builtin:") or not path.endswith(LOCAL_SUFFIXES):
            continue
        if not (base_dir / path).exists():
            out.append((f"{where}data.datasets.{i}.path", f"file not found: {base_dir / path} (relative data paths "
                        "are resolved against the current directory)"))
    return out


def _split_overrides(overrides: list[str] | tuple[str, ...], names: list[str], problems: list) -> tuple[list, dict]:
    """``pipeline.x=v`` -> pipeline-level ``(keys, value)``; ``NAME.a.b=v`` -> per step ``{dotted: value}``."""
    top, per_step = [], {}
    for text in overrides:
        try:
            keys, value = parse_override(text)
        except RecipeError as exc:
            problems += exc.problems
            continue
        if keys[0] == "pipeline" and len(keys) > 1:
            top.append((keys[1:], value))
        elif keys[0] in names and len(keys) > 1:
            per_step.setdefault(keys[0], {})[".".join(keys[1:])] = value
        else:
            close = difflib.get_close_matches(keys[0], [*names, "pipeline"], n=1, cutoff=0.5)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append((text, f"pipeline overrides start with a step name ({', '.join(names)}) or 'pipeline', "
                             f"e.g. {names[0] if names else 'sft'}.train.max_steps=10{hint}"))
    return top, per_step


def load_pipeline(path: str | Path, overrides: list[str] | tuple[str, ...] = (), base_dir: str | Path = ".") -> Pipeline:
    """Read, wire and validate a whole pipeline recipe before anything is trained.

    Every training step's recipe is resolved (file or inline, ``base:``, the step's ``overrides``, then the
    command-line ``NAME.key=value`` overrides), wired (see the module docstring) and validated with
    :func:`llmtune.config.load_recipe`; pairs steps are validated against :class:`PairsStep` and their reward
    function is imported. All problems of all steps are reported together.

    Args:
        path: the pipeline YAML file.
        overrides: ``NAME.section.key=value`` (a step) or ``pipeline.key=value`` strings.
        base_dir: directory relative data paths, ``pipeline.dir`` and run directories resolve against.

    Raises:
        RecipeError: every problem, each prefixed with the step (``stage 2 'rm': train.lerning_rate: ...``).
    """
    from llmtune.stages import STAGES

    path, base_dir = Path(path), Path(base_dir)
    doc = read_yaml(path)
    problems: list[tuple[str, str]] = []
    spec = doc.pop("pipeline", None)
    if not isinstance(spec, dict):
        raise RecipeError([("pipeline", "a pipeline recipe is a mapping with one key pipeline: {dir, stages, export}")],
                          source=str(path))
    problems += [(k, "unknown top-level key; a pipeline recipe has only pipeline:") for k in doc]
    entries = spec.get("stages")
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise RecipeError([("pipeline.stages", "a non-empty list of steps, each {name, stage, recipe, overrides} or "
                            "{name, kind: pairs, ...}")], source=str(path))
    names = [str(e.get("name", "")) for e in entries]
    top, per_step = _split_overrides(overrides, names, problems)
    for keys, value in top:
        try:
            apply_override(spec, keys, value)
        except RecipeError as exc:
            problems += [(f"pipeline.{p}", m) for p, m in exc.problems]
    extra = set(spec) - {"dir", "stages", "export"}
    problems += [(f"pipeline.{k}", "unknown key; valid keys: dir, stages, export") for k in sorted(extra)]
    try:
        export = ExportSpec.model_validate(spec.get("export") or {})
    except ValidationError as err:
        export, problems = ExportSpec(), problems + _spec_problems(err, ExportSpec, "pipeline.export.")
    out_dir = base_dir / str(spec.get("dir", "runs/pipeline"))
    pipe = Pipeline(source=path, dir=out_dir, steps=[], export=export, base_dir=base_dir)
    counts = Counter(names)
    for i, (entry, name) in enumerate(zip(entries, names)):
        where = f"stage {i + 1} '{name}': "
        if not _NAME.match(name) or name in RESERVED or counts[name] > 1:
            problems.append((f"pipeline.stages.{i}.name", f"{name!r}: each step needs a unique name (letters, digits, "
                             f"_ and -; not {' or '.join(sorted(RESERVED))})"))
            continue
        known = {s.name: s.artifact for s in pipe.steps}
        later = set(names[i + 1:])
        entry = copy.deepcopy(entry)
        if entry.get("kind") == "pairs":
            for dotted, value in per_step.get(name, {}).items():
                _set(entry, dotted, value)
            step = _pairs_step(entry, i, name, pipe, known, later, problems, where)
        else:
            step = _stage_step(entry, i, name, pipe, known, later, per_step.get(name, {}), problems, where, STAGES)
        if step is not None:
            pipe.steps.append(step)
    for step in pipe.steps:  # a pairs step nobody reads (e.g. the when_missing file exists) is not run
        if step.kind == "pairs":
            step.used = any(step.name in s.inputs for s in pipe.steps if s.kind != "pairs")
    if export.enabled and not problems:
        target = export.step or next((s.name for s in reversed(pipe.steps) if _is_policy(s.kind)), None)
        if target is None or target not in names or not _is_policy(pipe.step(target).kind):
            problems.append(("pipeline.export.step", f"{target!r} is not a policy step (sft, dpo, ppo or grpo) of this "
                             "pipeline; name one, or set pipeline.export.enabled: false"))
        else:
            export.step = target
    if problems:
        raise RecipeError(problems, source=str(path))
    return pipe


def _stage_step(entry, i, name, pipe, known, later, cli, problems, where, stages) -> Step | None:
    """Resolve, wire and validate one training step (see :func:`load_pipeline`)."""
    try:
        spec = StageStep.model_validate(entry)
    except ValidationError as err:
        problems += _spec_problems(err, StageStep, where)
        return None
    here = pipe.source.parent
    try:
        if isinstance(spec.recipe, str):
            doc = read_yaml(here / spec.recipe)
        else:
            doc = copy.deepcopy(spec.recipe or {})
            parent = doc.pop("base", None)
            if parent is not None:
                doc = deep_merge(read_yaml(here / str(parent)), doc)
    except RecipeError as exc:
        problems += [(f"{where}{p}", m) for p, m in exc.problems]
        return None
    overrides = {**spec.overrides, **cli}
    kind = spec.stage or doc.get("stage") or (name if name in stages else None)
    if kind is None:
        problems.append((f"pipeline.stages.{i}.stage", f"which stage? set stage: {' | '.join(stages)} (or kind: "
                         "pairs)"))
        return None
    if doc.get("stage") not in (None, kind):
        problems.append((f"{where}stage", f"the recipe is for stage {doc['stage']!r} but the step runs {kind!r}"))
    if kind not in stages:
        problems.append((f"{where}stage", f"stage {kind!r} is not available in this llmtune (available: "
                         f"{', '.join(stages)})"))
        return None

    inline = doc if not isinstance(spec.recipe, str) else {}

    def explicit(key: str, in_file: bool = True) -> bool:
        """Set by the step (its overrides, an inline recipe, or with ``in_file`` a recipe file it names)?"""
        return _has(doc if in_file else inline, key) or any(key == o or key.startswith(o + ".") for o in overrides)

    full = deep_merge(Recipe().model_dump(mode="json"), doc)
    for dotted, value in overrides.items():
        try:
            _set(full, dotted, value)
        except RecipeError as exc:
            problems += [(f"{where}overrides.{p}", m) for p, m in exc.problems]
    full["stage"] = kind
    _apply_when_missing(full, pipe.base_dir, where, pipe.notes, problems)
    deps: set[str] = set()
    full = _substitute(full, known, deps, later, problems, where)
    step_dir = pipe.dir / name
    if explicit("output.dir") and str(full["output"]["dir"]) != str(step_dir):
        pipe.notes.append(f"{where}output.dir {full['output']['dir']} replaced by {step_dir}")
    full["output"]["dir"] = str(step_dir)
    policies = [s for s in pipe.steps if _is_policy(s.kind)]
    # Run directories named by a recipe FILE are its standalone chain (runs/quickstart_sft): the pipeline rewires
    # them; the step's inline recipe or overrides choose explicitly.
    if not explicit("model.from_run", in_file=False) and (policies or full["model"].get("from_run")):
        wired = str(policies[-1].dir) if policies else None
        if full["model"].get("from_run") not in (None, wired):
            pipe.notes.append(f"{where}model.from_run {full['model']['from_run']} replaced by {wired}")
        full["model"]["from_run"] = wired
    rms = [s for s in pipe.steps if s.kind == "rm"]
    has_function = full["reward"].get("function") or full["reward"].get("functions")
    if kind in ("ppo", "grpo") and not has_function and not explicit("reward.from_run", in_file=False) and rms:
        full["reward"]["from_run"] = str(rms[-1].dir)
    by_dir = {str(s.dir): s.name for s in pipe.steps}
    deps |= {by_dir[v] for v in (full["model"].get("from_run"), full["reward"].get("from_run")) if v in by_dir}
    try:
        recipe = load_recipe(raw=full, stage=kind)
    except RecipeError as exc:
        problems += [(f"{where}{p}", m) for p, m in exc.problems]
        return None
    produced = {str(s.artifact) for s in pipe.steps}
    problems += _local_path_problems(recipe.data.datasets, pipe.base_dir, produced, where)
    return Step(i, name, kind, step_dir, recipe=recipe, inputs=sorted(deps, key=list(known).index),
                overwrite=bool(full["output"].get("overwrite")))


def _pairs_step(entry, i, name, pipe, known, later, problems, where) -> Step | None:
    """Validate one pairs step: its config, its policy step, its reward source (the function is imported)."""
    from llmtune.rewards import RewardFunctionError, load_reward_function

    deps: set[str] = set()
    _apply_when_missing(entry, pipe.base_dir, where, pipe.notes, problems)
    entry = _substitute(entry, known, deps, later, problems, where)
    function = (entry.get("reward") or {}).get("function") if isinstance(entry.get("reward"), dict) else None
    if isinstance(function, str):  # imported now: a typo fails before any training
        try:
            load_reward_function(function, pipe.source.parent)
        except RewardFunctionError as err:
            problems.append((f"{where}reward.function", str(err).removeprefix("reward.function: ")))
    try:
        cfg = PairsStep.model_validate(entry)
    except ValidationError as err:
        problems += _spec_problems(err, PairsStep, where)
        return None
    policies = [s.name for s in pipe.steps if _is_policy(s.kind)]
    cfg.from_ = cfg.from_ or (policies[-1] if policies else None)
    if cfg.from_ not in policies:
        problems.append((f"{where}from", f"{cfg.from_!r} is not an earlier policy step (sft, dpo, ppo or grpo); "
                         f"earlier policy steps: {', '.join(policies) or 'none'}"))
    else:
        deps.add(cfg.from_)
    if bool(cfg.reward.function) == bool(cfg.reward.from_run):
        problems.append((f"{where}reward", "set exactly one of reward.function (module:function, e.g. "
                         "llmtune.rewards:gsm8k_reward) or reward.from_run (an rm run, e.g. \"{rm}\")"))
    produced = {str(s.artifact) for s in pipe.steps}
    problems += _local_path_problems(cfg.data.datasets, pipe.base_dir, produced, where)
    return Step(i, name, "pairs", pipe.dir / name, pairs=cfg, inputs=sorted(deps, key=list(known).index),
                overwrite=cfg.overwrite)


# ---------------------------------------------------------------------------------------------------------------
# Running


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
    from llmtune import launch as launcher
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
        run_stage(STAGES[step.kind](recipe), base_dir=pipe.base_dir)
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
    from llmtune.export import export_run

    run_dir, out = pipe.step(pipe.export.step).dir, pipe.dir / MERGED
    verification = out / "verification.json"
    row = {"name": "export", "kind": "export", "artifact": str(out)}
    if verification.is_file():
        old = json.loads(verification.read_text())
        dtype_ok = pipe.export.dtype in ("auto", old.get("dtype"))
        newer = verification.stat().st_mtime > (run_dir / rd.LINEAGE).stat().st_mtime
        if old.get("passed") and old.get("run_dir") == str(run_dir) and dtype_ok and newer:
            console.print(f"  skip: {out} already holds a verified export of {run_dir}")
            return {**row, "action": "skipped", **_export_metric(old)}
    console.print(f"  merging the adapter chain of {run_dir}")
    report = export_run(run_dir, dtype=pipe.export.dtype, out_dir=out)
    row.update(action="exported", wall_s=round(time.perf_counter() - t0, 1), **_export_metric(report))
    if not report.get("passed"):
        raise PipelineError(f"export of {run_dir} failed verification ({out / 'verification.json'}): "
                            f"max |diff| {report.get('max_abs_diff')} > tolerance {report.get('tolerance')}")
    return row


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
    """
    import sys

    from llmtune.utils import make_console

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
