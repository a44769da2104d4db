"""Run one stage end to end: recipe -> data -> model + adapter -> train -> adapter + lineage.

Every stage goes through :func:`run_stage`; a stage only supplies its data, loss and metrics.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import time
from pathlib import Path

import torch
from transformers import set_seed

from llmtune import __version__
from llmtune.config import Recipe, dump_recipe
from llmtune.core import rundir as rd
from llmtune.core import checkpoint as ck
from llmtune.core.callbacks import MetricsJsonlCallback, truncate_metrics
from llmtune.core.plots import plot_run
from llmtune.core.distributed import batch_layout, no_zero3_init, zero_stage
from llmtune.config.validate import data_size_problems
from llmtune.core.guard import check_precision, check_trainable_weights
from llmtune.core.memory import reset_peak_memory
from llmtune.core.preempt import PreemptedError, StopOnSignalCallback, StopRequest, exit_code, signal_name
from llmtune.core.stage import Stage, prepare_tokenizer
from llmtune.core.trainer import (
    CoreTrainer,
    build_training_args,
    early_stopping,
)
from llmtune.models import (
    attach_adapter,
    count_parameters,
    inherit_from_run,
    load_model_with_chain,
    resolve_model_source,
)
from llmtune.models.checks import model_fit_problems, position_problems
from llmtune.models.lineage import chain_segment, load_stacked_base
from llmtune.utils import get_logger, is_main_process, setup_logging, write_json

log = get_logger("runner")


def run_stage(stage: Stage, base_dir: str | Path = ".") -> dict:
    """Train ``stage`` as its recipe says and write the run directory.

    Args:
        stage: a stage built from a validated recipe.
        base_dir: directory relative data paths are resolved against (the recipe's directory's parent
            for CLI runs is the current directory).

    Returns:
        Summary: ``{run_dir, steps, train_loss, eval_before, eval_after, wall_s, adapter}``.

    Raises:
        RecipeError: run-dir conflicts or a bad ``resume_from``.
        PreemptedError: stopped by SIGTERM/SIGUSR1 (exit code 75) or Ctrl-C (130) after writing a checkpoint.
        CheckpointSaveError: not enough disk space for a checkpoint, or a save failed (exit code 5).
        OutOfMemoryError: the GPU ran out of memory anywhere in loading, training or evaluation (exit code 4;
            the message has the memory figures and what to change in the recipe).
        NonFiniteError: too many non-finite optimizer steps in a row, or non-finite trained weights (exit code 3).
        DataError: bad input rows (policy ``error``) or no usable rows.
        ModelLoadError: the base model cannot be loaded; ``model.from_run`` names an unfinished run.
    """
    from llmtune.core.guard import oom_guard

    setup_logging()
    # cleanup: what a trainer holds outside this process's memory (the online-RL rollout engine), freed on the way out
    with oom_guard(stage.recipe), StopRequest() as stop, contextlib.ExitStack() as cleanup:
        return _run_stage(stage, base_dir, stop, cleanup)


def _run_stage(stage: Stage, base_dir: str | Path, stop: StopRequest, cleanup: contextlib.ExitStack) -> dict:
    reset_peak_memory()  # this stage's peak_mem_gb, not an earlier stage's of the same process (the pipeline)
    recipe, chain = inherit_from_run(stage.recipe, base_dir)  # model.from_run: base, chat template, adapter chain
    stage.recipe = recipe
    t0 = time.perf_counter()
    check_precision(recipe)
    problems = stage.preflight(str(base_dir))
    if problems:
        from llmtune.config import RecipeError

        raise RecipeError(problems)
    run = rd.RunDir(Path(recipe.output.dir))
    resume_ckpt = run.plan(recipe.train.resume_from, recipe.output.overwrite, report=is_main_process())
    resume = resume_ckpt is not None
    if resume:
        log.info("resuming from %s", resume_ckpt)
        run.check_resume_recipe(recipe.model_dump(mode="json"))
    if is_main_process():
        run.prepare(resume=resume, overwrite=recipe.output.overwrite, resume_from=recipe.train.resume_from)
        if resume:  # the steps after the checkpoint are trained again: their old records go
            truncate_metrics(run / rd.METRICS, _checkpoint_step(resume_ckpt))
            truncate_metrics(run / rd.SAMPLES, _checkpoint_step(resume_ckpt), including_step=True)
    set_seed(recipe.train.seed)
    if is_main_process():
        dump_recipe(recipe, run / rd.RECIPE)

    tokenizer = prepare_tokenizer(recipe)
    fit = model_fit_problems(recipe, tokenizer, stage.model_head, stage.name, check_vocab=not chain)
    if fit:  # max_length vs positions, tokenizer vs embedding rows, adapter module names (config only)
        from llmtune.config import RecipeError

        raise RecipeError(fit)
    data = stage.build_data(tokenizer, str(base_dir))
    if is_main_process():
        data.report.save(run / rd.DATA_REPORT)
    log.info("data:\n%s", data.report.summary())
    sizes = data_size_problems(recipe, len(data.train))
    if sizes:
        from llmtune.config import RecipeError

        raise RecipeError(sizes)

    has_eval = data.eval is not None and len(data.eval) > 0
    # Before the model: a ZeRO-3 TrainingArguments makes from_pretrained load each rank's partition only, and it
    # sets this process's device. An adapter chain is merged into whole weights; DeepSpeed partitions them later.
    args = build_training_args(recipe, run.root, has_eval, resuming=resume)
    quantized = recipe.model.load_in_4bit or recipe.model.load_in_8bit
    # A chain on a quantized base is not merged: its adapters are stacked frozen under the new one (attach_adapter)
    frozen = chain_segment(chain)[1] if chain and quantized else []
    if chain and quantized:
        model = load_stacked_base(recipe.model, recipe.precision, chain, head=stage.model_head)
    else:
        with no_zero3_init() if chain else contextlib.nullcontext():
            model = load_model_with_chain(recipe.model, recipe.precision, chain, head=stage.model_head)
    # again on the loaded config: the one before loading may not have been readable (a hub id not cached yet)
    late = position_problems(recipe, model.config, stage.name)
    if late:
        from llmtune.config import RecipeError

        raise RecipeError(late)
    model = stage.prepare_model(model, tokenizer)
    model = attach_adapter(model, recipe.adapter, gradient_checkpointing=recipe.train.gradient_checkpointing is True,
                           quantized=quantized, frozen_chain=frozen)
    memory_plan = plan_checkpointing(model, recipe, stage, args.world_size)
    trainable, total = count_parameters(model)
    batch = batch_layout(recipe, args.world_size)
    log.info(
        "parameters: %s trainable / %s total (%.3f%%); effective global batch: %d samples/step = %d micro x %d "
        "accumulation x %d ranks%s",
        f"{trainable:,}", f"{total:,}", 100 * trainable / max(total, 1), batch["global_batch_size"],
        batch["micro_batch_size"], batch["accumulation_steps"], batch["world_size"],
        f"; DeepSpeed ZeRO-{zero_stage(recipe)}" if args.deepspeed else "",
    )

    eval_rows = by_length(data.eval) if has_eval else None
    trainer = (stage.trainer_class or CoreTrainer)(
        model=model,
        args=args,
        train_dataset=data.train,
        eval_dataset=eval_rows,
        data_collator=data.collator,
        processing_class=tokenizer,
        callbacks=[MetricsJsonlCallback(run / rd.METRICS), *(early_stopping(recipe) if has_eval else [])],
        stage=stage,
    )
    if hasattr(trainer, "close"):  # online RL: the rollout engine, also when training fails
        cleanup.callback(trainer.close)
    prepared = stage.prepare_data(trainer, data)
    if prepared is not data:
        data, trainer.train_dataset = prepared, prepared.train
        trainer.eval_dataset = by_length(prepared.eval) if has_eval else None
    if resume_ckpt:
        trainer.load_counters(resume_ckpt)
    stopper = StopOnSignalCallback(stop, trainer.can_stop_here)
    trainer.add_callback(stopper)
    trainer.checkpoint_estimate = ck.estimate_checkpoint_bytes(trainer.model, master_weights=bool(args.deepspeed),
                                                               world_size=args.world_size)
    ck.check_free_space(run.root, trainer.checkpoint_estimate)
    # Under DeepSpeed the first evaluation must run inside train(), once the engine exists (args.eval_on_start).
    eval_before = trainer.evaluate() if has_eval and recipe.train.eval_at_start and not resume \
        and not args.eval_on_start else None
    stop.phase = "training"
    result = trainer.train(resume_from_checkpoint=str(resume_ckpt) if resume_ckpt else None)
    stop.phase = "finishing"
    if stopper.stopped:
        signum, step = stopper.stopped
        raise PreemptedError(
            f"stopped by {signal_name(signum)} after optimizer step {step}: checkpoint "
            f"{run / rd.CHECKPOINTS / f'checkpoint-{step}'} written. Continue with the same command (it resumes from "
            "the newest complete checkpoint; train.resume_from: auto)", exit_code(signum))
    if args.eval_on_start:
        eval_before = next((r for r in trainer.state.log_history if any(k.startswith("eval_") for k in r)), None)
    eval_after = trainer.evaluate() if has_eval else None

    check_trainable_weights(trainer)  # a run never ends "done" with NaN/inf weights (no adapter, no lineage)
    adapter_dir = run / rd.ADAPTER
    try:
        trainer.save_model(str(adapter_dir))
    except OSError as exc:
        raise ck.CheckpointSaveError(ck.save_failed_message(
            "the adapter", exc, run.root, trainer.checkpoint_estimate, run.latest_checkpoint())) from None
    summary = {
        "run_dir": str(run.root),
        "stage": stage.name,
        "steps": trainer.state.global_step,
        "train_loss": result.training_loss,
        f"trained_{stage.item_unit}": trainer.trained_tokens,
        "nonfinite_steps": trainer.nonfinite_steps,  # optimizer steps skipped for a NaN/inf loss or gradient norm
        "eval_before": eval_before,
        "eval_after": eval_after,
        "wall_s": round(time.perf_counter() - t0, 1),
        "adapter": str(adapter_dir),
        "batch": batch,  # effective global batch = micro x accumulation x ranks
        "zero_stage": zero_stage(recipe),
        **memory_plan,  # memory_estimate_gb (for the checkpointing chosen), gradient_checkpointing, memory_estimate
    }
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(str(adapter_dir))
        if recipe.adapter.type == "lora":
            from llmtune.models.verify import verify_saved_adapter

            verify_saved_adapter(adapter_dir, model)
        if recipe.output.plot:
            plot_run(run / rd.METRICS, run / rd.PLOTS, stage.plot_metrics, title=f"llmtune {stage.name}: {run.root}")
        record = lineage(recipe, stage, data.sources, summary, chain)
        from llmtune.core.artifacts import finalize_adapter_dir

        finalize_adapter_dir(adapter_dir, record)  # portable base in adapter_config.json, model card, tokenizer
        write_json(run / rd.LINEAGE, record)
        if recipe.output.push_to_hub:  # after the lineage: a failed upload leaves a complete run
            from llmtune.core.artifacts import push_to_hub

            push_to_hub(adapter_dir, recipe.output.hub_model_id, private=recipe.output.hub_private,
                        message=f"llmtune {stage.name} adapter ({trainer.state.global_step} steps)")
    return summary


def plan_checkpointing(model, recipe: Recipe, stage: Stage, world_size: int) -> dict:
    """Estimate this run's peak memory per device (:mod:`llmtune.core.memory`), log it in one line with the device
    memory and the gradient-checkpointing choice (``train.gradient_checkpointing``: true / false / auto), switch
    checkpointing on when chosen, and return what the lineage summary records."""
    from llmtune.core import memory
    from llmtune.models import enable_gradient_checkpointing
    from llmtune.models.adapters import checkpointing_enabled

    passes = 2 if getattr(getattr(stage, "trainer_class", None), "value_forward", False) else 1  # PPO: + value
    estimate = memory.estimate_training_memory(model, recipe, stage.data_kind, zero=zero_stage(recipe) or 0,
                                               world_size=world_size, passes=passes)
    device = memory.device_memory_bytes()
    on, reason = memory.choose_checkpointing(recipe.train.gradient_checkpointing, estimate, device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():  # every rank makes the same choice
        flag = torch.tensor([int(on)], device="cuda" if torch.cuda.is_available() else "cpu")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        on = bool(flag.item())
    if checkpointing_enabled(model):  # asked for, or already on in the given model (attach_adapter kept it)
        on = True
    elif on:
        enable_gradient_checkpointing(model.get_base_model() if hasattr(model, "get_base_model") else model)
    if is_main_process():
        log.info("%s", memory.describe(estimate, device, on, reason))
    return {"memory_estimate_gb": round(estimate.total(on) / memory.GB, 3), "gradient_checkpointing": on,
            "memory_estimate": {**estimate.summary(), "device_memory_gb": round(device / memory.GB, 1),
                                "reason": reason}}


def _checkpoint_step(checkpoint: Path) -> int:
    """Optimizer step of a checkpoint (its trainer_state.json, else its name)."""
    import json

    try:
        return int(json.loads((Path(checkpoint) / ck.TRAINER_STATE).read_text())["global_step"])
    except (OSError, ValueError, KeyError):
        return ck.step_of(checkpoint) or 0


def by_length(rows):
    """Eval rows longest first: batches of similar length waste less compute on padding, and an
    out-of-memory error shows at the first batch. Eval metrics are sums, so the order does not matter."""
    columns = getattr(rows, "column_names", [])
    if not hasattr(rows, "select") or not {"length", "input_ids"} & set(columns):
        return rows
    lengths = rows["length"] if "length" in columns else [len(ids) for ids in rows["input_ids"]]
    return rows.select(sorted(range(len(lengths)), key=lambda i: -lengths[i]))


def lineage(recipe: Recipe, stage: Stage, sources: list[dict], summary: dict, chain: list[dict] = ()) -> dict:
    """What this run was made from: base model, earlier adapters (``chain``, oldest first, merged into the base
    before this run's adapter), the model head, data with hashes, final metrics."""
    from llmtune.core.artifacts import llmtune_commit, package_versions
    from llmtune.models.load import quantization_kwargs
    from llmtune.models.portable import model_max_length, portable_base

    source = resolve_model_source(recipe.model)
    return {
        "llmtune_version": __version__,
        "llmtune_commit": llmtune_commit(),
        "versions": package_versions(),
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "stage": stage.name,
        "base_model": {"name_or_path": recipe.model.name_or_path, "kind": source.kind, "path": str(source.path),
                       "revision": source.revision, "fingerprint": source.fingerprint,
                       "model_max_length": model_max_length(source.path),
                       "portable": portable_base(recipe.model.name_or_path, source.kind, str(source.path),
                                                 source.revision),
                       "quantization": quantization_kwargs(recipe.model, recipe.precision)},
        "from_run": recipe.model.from_run,
        "previous_adapters": list(chain),
        "model_head": stage.model_head,
        "adapter": rd.ADAPTER,
        "adapter_type": recipe.adapter.type,
        "data": sources,
        "torch": torch.__version__,
        "summary": summary,
    }
