"""``llmtune validate``: the dry run. Recipe + tokenizer + data, never model weights.

Prints the resolved settings that matter before GPU time is spent (batch arithmetic, steps), the
data report, and one rendered training example with its trained tokens marked.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from llmtune.config import load_recipe


def validate_command(recipe_path: str, overrides: list[str], *, stage: str | None = None, example: int = 0) -> int:
    """Validate a recipe and its data; return the process exit code (0 ok, 1 problem).

    Raises:
        RecipeError, DataError, ModelLoadError: reported by the CLI as one error message each.
    """
    from llmtune.config import RecipeError
    from llmtune.config.load import read_yaml
    from llmtune.utils import make_console

    console = make_console(stderr=False, highlight=False)
    doc = read_yaml(recipe_path)
    if "pipeline" in doc:  # a pipeline recipe: its dry run validates every step
        from llmtune.pipeline.run import pipeline_command

        return pipeline_command(recipe_path, overrides, dry_run=True)
    declared = doc.get("stage")
    stage_name = stage or declared or "sft"
    # the recipe first, with the config package only: a recipe error costs no torch/transformers/peft import
    recipe = load_recipe(recipe_path, overrides, stage=stage_name)
    # a missing data file, before any tokenizer or torch import (the reader applies the same rule)
    from llmtune.config.paths import missing_local_file

    missing = [(f"data.datasets.{i}.path", problem) for i, ds in enumerate(recipe.data.datasets)
               if (problem := missing_local_file(ds.path))]
    if missing:
        raise RecipeError(missing, source=recipe_path)
    # then only what a dry run needs: the one stage's module (imported by the lazy registry), the tokenizer and the
    # data layer; never the trainer (transformers.Trainer, peft, bitsandbytes), trl, deepspeed or matplotlib
    from llmtune.core.distributed import batch_layout, recipe_world_size
    from llmtune.core.guard import check_precision
    from llmtune.core.rundir import RunDir
    from llmtune.core.stage import prepare_tokenizer
    from llmtune.models.load import resolve_model_source
    from llmtune.stages import STAGES

    if stage_name not in STAGES:
        raise RecipeError([("stage", f"stage {stage_name!r} is not implemented yet; available: {', '.join(STAGES)}")],
                          source=recipe_path)
    check_precision(recipe)
    late: list[tuple[str, str]] = []  # problems that do not stop the data check; reported at the end
    if recipe.model.load_in_4bit or recipe.model.load_in_8bit:
        import importlib.util

        if importlib.util.find_spec("bitsandbytes") is None:  # loading the base would stop here (load_model)
            key = "model.load_in_4bit" if recipe.model.load_in_4bit else "model.load_in_8bit"
            late.append((key, "needs bitsandbytes, which is not installed: `pip install bitsandbytes` (or turn "
                         "quantization off)"))
    try:
        RunDir(recipe.output.dir).plan(recipe.train.resume_from, recipe.output.overwrite)
    except RecipeError as exc:
        late += exc.problems
    recipe, chain_late = _inherit(recipe, console)
    late += chain_late
    recipe_dir = Path(recipe_path).parent
    late += STAGES[stage_name](recipe, recipe_dir=recipe_dir).preflight(".")
    source = resolve_model_source(recipe.model, convert=False)
    console.print(f"model: {recipe.model.name_or_path} ({source.kind})")
    if stage_name in ("ppo", "grpo"):
        from llmtune.rl.engines import select_engine

        engine, reason = select_engine(recipe)
        console.print(f"rollout engine: {engine} ({reason})")
    from llmtune.models.weight_files import check_weight_files

    from llmtune.models.weight_files import has_model_weights

    # a hub model's weights come with training's download: a cached snapshot of its config and tokenizer is enough
    tokenizer_only = source.kind == "hub" and Path(source.path).is_dir() and not has_model_weights(source.path)
    check_weight_files(source.path, source.original, model_dir=not tokenizer_only)  # truncated / corrupt safetensors
    if tokenizer_only:
        console.print(f"[yellow]note[/yellow]: the cached {source.original} has its config and tokenizer but no "
                      "weights yet: enough for validate; training downloads them (network, and a token for a "
                      "gated model)")
    tokenizer = prepare_tokenizer(recipe, convert=False)  # a GGUF model: its tokenizer, no conversion
    stage_obj = STAGES[stage_name](recipe, recipe_dir=recipe_dir)
    from llmtune.models.checks import model_fit_problems

    late += model_fit_problems(recipe, tokenizer, stage_obj.model_head, stage_name,
                               check_vocab=not recipe.model.from_run)
    data = stage_obj.build_data(tokenizer, ".")
    console.print(data.report.summary())

    n_train = len(data.train)
    if n_train == 0:
        console.print("[red]no training rows left[/red]")
        return 1
    from llmtune.config.validate import data_size_problems

    late += data_size_problems(recipe, n_train)
    layout = batch_layout(recipe, world=recipe_world_size(recipe))  # the launch the recipe describes, not this process
    steps_per_epoch = math.ceil(n_train / recipe.train.global_batch_size)
    steps = recipe.train.max_steps or math.ceil(steps_per_epoch * recipe.train.num_epochs)
    dist = recipe.distributed
    console.print(
        f"batch: {recipe.train.global_batch_size} samples/optimizer step = {recipe.train.micro_batch_size} micro x "
        f"{layout['accumulation_steps']} accumulation x {layout['world_size']} ranks ({dist.nproc_per_node or 1} per "
        f"node x {dist.nnodes} node{'s' if dist.nnodes > 1 else ''}: distributed.nproc_per_node x nnodes); "
        f"{n_train} training rows -> {steps} optimizer steps"
        + (f"; {len(data.eval)} eval rows" if data.eval is not None else "")
    )
    if not 0 <= example < n_train:
        raise RecipeError([("--example", f"row {example} does not exist: there are {n_train} training rows "
                            f"(0..{n_train - 1})")])
    index = example
    row = data.train[index]
    console.print(f"\n[bold]training row {index}[/bold] (trained tokens between «»):")
    console.print(stage_obj.render_example(row, tokenizer), markup=False)
    if late:
        raise RecipeError(late, source=recipe_path)
    console.print(f"\n[bold green]valid[/bold green]: {recipe_path} ({stage_name}) — recipe, model source and data checked")
    sys.stdout.flush()
    return 0


def _inherit(recipe, console) -> tuple[object, list[tuple[str, str]]]:
    """Apply ``model.from_run`` when that run is finished (printing what is inherited and how the chain is used);
    else say that it must be. Returns ``(recipe, problems)``: what training would refuse about the chain
    (:func:`llmtune.models.lineage.chain_problems`), reported with the other problems at the end."""
    from pathlib import Path

    from llmtune.config import RecipeError
    from llmtune.models import inherit_from_run

    run = recipe.model.from_run
    if not run:
        return recipe, []
    if not (Path(run) / "lineage.json").is_file():
        if recipe.model.name_or_path is None:
            raise RecipeError([("model.name_or_path", f"null (the base that model.from_run records), but {run} is not "
                                "a finished run yet, so there is no base to check the tokenizer and data with: add "
                                "model.name_or_path=<that run's base> to this command (the base of the recipe that "
                                "will write it), or validate after that run has finished")])
        console.print(f"[yellow]model.from_run: {run} is not a finished run yet[/yellow]; it must be before training "
                      f"(checking the data with model.name_or_path {recipe.model.name_or_path})")
        return recipe, []
    try:
        inherited, chain = inherit_from_run(recipe, ".")
    except RecipeError as exc:
        return recipe, exc.problems
    before, after = recipe.model_dump(), inherited.model_dump()
    for section in ("model", "data"):
        for key, value in after[section].items():
            if value != before[section][key]:
                console.print(f"from_run {run}: {section}.{key} = {value!r} (inherited)")
    stacked = inherited.model.load_in_4bit or inherited.model.load_in_8bit
    for entry in chain:
        how = "stacks (frozen, unmerged) the" if stacked else "merges the"
        console.print(f"from_run {run}: {how} {entry['stage']} adapter {entry['path']} "
                      f"{'on the quantized base' if stacked else 'into the base before training'}")
    return inherited, []
