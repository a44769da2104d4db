"""A pipeline recipe: its schema (steps, export), loading with overrides and ``{name}`` references, and its
validation into :class:`Pipeline` (every step's recipe checked before anything runs). See :mod:`llmtune.pipeline`."""

from __future__ import annotations

import copy
import difflib
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmtune.config import Recipe, RecipeError, load_recipe
from llmtune.config.load import apply_override, deep_merge, parse_override, read_yaml
from llmtune.core import rundir as rd
from llmtune.errors import LlmtuneError
from llmtune.pipeline.pairs import PAIRS_FILE, PAIRS_REPORT, PairsConfig
from llmtune.utils import dotted_get, get_logger

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
    gguf: list[Literal["f32", "f16", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0"]] = Field(
        default_factory=list, description="GGUF types also written into <pipeline.dir>/gguf (llmtune export --gguf), "
        "e.g. [q4_k_m]; empty: none.")
    modelfile: bool = Field(True, description="With gguf: also write the Ollama Modelfile.")


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
    return dotted_get(doc, dotted, _MISSING) is not _MISSING


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
    from llmtune.config.paths import missing_local_file

    return [(f"{where}data.datasets.{i}.path", problem) for i, ds in enumerate(datasets)
            if ds.path not in produced and (problem := missing_local_file(ds.path, base_dir))]


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
    problems += _chain_problems(recipe, pipe, where)
    if recipe.distributed.nnodes > 1:  # torchrun would start this node's ranks and wait for nodes never started
        problems.append((f"{where}distributed.nnodes", f"{recipe.distributed.nnodes} nodes: a pipeline runs on one "
                         "node (it starts torchrun there for a step with distributed.nproc_per_node > 1 or DeepSpeed). "
                         "Train a multi-node stage with its own command under srun (srun --ntasks-per-node 1 llmtune "
                         f"{kind} RECIPE, as scripts/slurm_zero3.sbatch does), then name its run directory in the "
                         "next step's model.from_run"))
    return Step(i, name, kind, step_dir, recipe=recipe, inputs=sorted(deps, key=list(known).index),
                overwrite=bool(full["output"].get("overwrite")))


def _chain_problems(recipe: Recipe, pipe: Pipeline, where: str) -> list[tuple[str, str]]:
    """What training would refuse about a step's ``model.from_run`` chain of earlier steps of this pipeline
    (:func:`llmtune.models.lineage.link_problems`: one quantization per chain, whole tensors to stack on a quantized
    base), before any of them ran. The 4-bit settings a step leaves at their defaults are inherited from the chain,
    as training does. A chain reaching outside the pipeline is checked there when that run is finished."""
    from llmtune.models.lineage import INHERITED, link_problems, quantization_of

    steps = {str(s.dir): s for s in pipe.steps if s.recipe is not None}
    links, models, run = [], [], recipe.model.from_run
    while run in steps:
        step = steps.pop(run)
        r = step.recipe
        models.append(r.model.model_dump(mode="json"))  # nearest first
        links.insert(0, {"label": f"{step.kind} step {step.name!r}", "adapter_type": r.adapter.type,
                         "quantization": quantization_of(models[-1], r.precision.model_dump(mode="json")),
                         "full": list(r.adapter.modules_to_save) + (["score"] if step.kind == "rm" else [])})
        run = r.model.from_run
    if not links:
        return []
    model, defaults = recipe.model.model_dump(mode="json"), Recipe().model.model_dump(mode="json")
    for section, key in INHERITED:  # as inherit_from_run does at each step: the nearest value that is not a default
        if section == "model" and model[key] == defaults[key]:
            model[key] = next((m[key] for m in models if m[key] != defaults[key]), model[key])
    mine = quantization_of(model, recipe.precision.model_dump(mode="json"))
    return [(f"{where}{key}", message) for key, message in
            link_problems(links, mine, f"model.from_run ({links[-1]['label']})")]


def _pairs_step(entry, i, name, pipe, known, later, problems, where) -> Step | None:
    """Validate one pairs step: its config, its policy step, its reward source (the function is imported)."""
    from llmtune.rewards.functions import RewardFunctionError, load_reward_function

    deps: set[str] = set()
    _apply_when_missing(entry, pipe.base_dir, where, pipe.notes, problems)
    entry = _substitute(entry, known, deps, later, problems, where)
    function = (entry.get("reward") or {}).get("function") if isinstance(entry.get("reward"), dict) else None
    if isinstance(function, str):  # imported now: a typo fails before any training
        try:
            load_reward_function(function, recipe_dir=pipe.source.parent)
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
