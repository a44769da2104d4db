"""Command line: ``llmtune {sft,validate,export,chat} RECIPE [section.key=value ...]``.

Stage commands are the schema's ``stage:`` values (the registry ``llmtune.stages.STAGES`` is imported only to run one,
so ``--help`` does not load the trainer); each takes a recipe and
``section.key=value`` overrides. Every recipe option is listed in ``llmtune <stage> --help``, generated
from the schema's field descriptions (one source of that text).
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

from llmtune.config.options import recipe_options, stage_names

EXIT_USAGE = 2


def options_help(stage: str | None = None) -> str:
    """Recipe options as ``section.key  (type; default)  help`` lines, from the schema: the common sections plus
    ``stage``'s own (every section when ``stage`` is None). The walk is :func:`llmtune.config.options.recipe_options`
    (shared with the documentation's recipe reference)."""
    lines = ["recipe options (set in the YAML or as section.key=value overrides; list items by index, "
             "e.g. data.datasets.0.path):"]
    for section in recipe_options(stage):
        lines.append(f"\n  {section.name}:  {section.summary}")
        for opt in section.options:
            indent = " " * (4 + 2 * opt.depth)
            if opt.subsection:
                lines.append(f"{indent}{opt.key}:  {opt.description}")
            else:
                given = "required" if opt.required else f"default {opt.default!r}"
                lines.append(f"{indent}{opt.key}  ({opt.type}; {given})\n{indent}    {opt.description}")
    lines.append(f"\n  stage: {' | '.join(stage_names())} (optional; must match the command)")
    lines.append("  base: path of a recipe to inherit from (relative to this recipe)")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    from llmtune import __version__

    stages = stage_names()
    parser = argparse.ArgumentParser(
        prog="llmtune",
        description=f"Staged fine-tuning of causal language models from YAML recipes: {', '.join(s.upper() for s in stages)} "
        "on one trainer core, chained by `pipeline`. Every stage writes a PEFT adapter into its run directory; "
        "`export` merges the chain into the base (or writes it as one adapter) and verifies the result.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  llmtune validate recipes/quickstart_sft.yaml\n  llmtune sft recipes/quickstart_sft.yaml "
        "train.max_steps=20\n  llmtune export runs/quickstart_sft\n\n`llmtune sft --help` lists every recipe option.",
    )
    parser.add_argument("--version", action="version", version=f"llmtune {__version__}")
    from llmtune.core.launch import add_local_rank_arg

    add_local_rank_arg(parser)  # `deepspeed --module llmtune ...` passes --local_rank=I first
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in stages:
        p = sub.add_parser(
            name,
            help=f"train the {name.upper()} stage from a recipe",
            description=f"{_stage_summary(name)}\n\nRuns the {name} stage and writes the run directory "
            "(recipe.resolved.yaml, data_report.json, metrics.jsonl, plots/, checkpoints/, adapter/, lineage.json).",
            epilog=options_help(name),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _recipe_args(p)
        from llmtune.core.launch import add_launch_args

        add_launch_args(p)
    v = sub.add_parser(
        "validate",
        help="dry run: check a recipe and its data without training",
        description="Resolve and validate the recipe, load and tokenize the data, print the data report and one "
        "rendered example with the trained tokens marked. Loads the tokenizer only, never model weights. "
        "Exits 1 on any problem.",
        epilog=options_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _recipe_args(v)
    v.add_argument("--stage", default=None, choices=sorted(stages), help="stage to validate for (default: the "
                   "recipe's stage:, else sft)")
    v.add_argument("--example", type=int, default=0, help="index of the training row to render (default 0)")
    from llmtune.core.launch import add_launch_args

    add_launch_args(v)  # the training command's launch flags, so that a command line validates as it will train
    e = sub.add_parser(
        "export",
        help="merge a run's adapter chain into its base model (or write it as one adapter), save, verify",
        description="Merge the adapter chain of RUN_DIR (earlier stages' adapters, then its own) into the base "
        "model in fp32 (a QLoRA run: into its dequantized 4-bit base) and cast once to --dtype; save sharded "
        "safetensors + config + generation config (stopping at the chat template's EOS) + tokenizer with the "
        "training chat template + a model card with the lineage (README.md) into RUN_DIR/merged (or --out). "
        "Reload it with AutoModelForCausalLM (reward models: AutoModelForSequenceClassification) and compare its "
        "logits and greedy generations with the adapter model; writes verification.json and exits 1 if the logits "
        "differ beyond tolerance (or, for fp32, a greedy generation differs).",
    )
    e.add_argument("run_dir", help="a finished run directory (holds lineage.json and adapter/)")
    e.add_argument("--dtype", choices=["auto", "fp32", "fp16", "bf16"], default="auto",
                   help="dtype of the saved weights (auto: the training precision)")
    e.add_argument("--out", default=None, help="output directory (default RUN_DIR/merged)")
    e.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard (default 2GB)")
    e.add_argument("--adapter", action="store_true",
                   help="instead of a merged model, write ONE peft adapter equal to the whole adapter chain on the "
                   "original base (LoRA updates concatenated along the rank; exact) into RUN_DIR/exported_adapter "
                   "(or --out), verified with plain PeftModel.from_pretrained against llmtune's chain model")
    e.add_argument("--gguf", default=None, metavar="TYPE[,TYPE]",
                   help="also write GGUF files for llama.cpp / Ollama / LM Studio from the verified merged model "
                   "(RUN_DIR/merged, exported first if missing; RUN_DIR may also be a pipeline or merged directory): "
                   "model-TYPE.gguf for each of f16, bf16, f32, q8_0, q6_k, q5_k_m, q4_k_m, q4_0, plus an Ollama "
                   "Modelfile and verification.json (llama.cpp vs the merged model: tokenization, chat prompt ids, "
                   "f16 logits and greedy generations, quantized top-1 agreement and perplexity vs f16) into "
                   "RUN_DIR/gguf (or --out); exits 1 if a check fails")
    e.add_argument("--no-modelfile", action="store_true",
                   help="with --gguf: write no Ollama Modelfile (for a chat template Ollama cannot express)")
    pl = sub.add_parser(
        "pipeline",
        help="run a list of steps (any stage, on-policy pairs) into one directory, then export",
        description="Validate every step of a pipeline recipe, then run the steps in order: a complete step is "
        "skipped, an interrupted one resumes from its latest checkpoint, so the same command continues after "
        "Ctrl-C. Each stage continues the previous policy stage (model.from_run); the last one is exported into "
        "PIPELINE_DIR/merged. Ends with a summary table (also PIPELINE_DIR/pipeline_summary.json).",
        epilog="overrides name the step: sft.train.max_steps=10 pairs.k=2 pipeline.dir=runs/p2\n"
        "example: llmtune pipeline recipes/quickstart_pipeline.yaml",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pl.add_argument("recipe", help="pipeline YAML (pipeline: {dir, stages, export})")
    pl.add_argument("overrides", nargs="*", metavar="STEP.section.key=value",
                    help="step overrides (STEP = a step name, or pipeline), applied in order")
    pl.add_argument("--dry-run", action="store_true", help="validate and show the plan; train nothing")
    rs = sub.add_parser(
        "rollout-server",
        help="serve a recipe's rollout base with vLLM for online RL (rollout.vllm.mode: server)",
        description="Build the recipe's rollout base (the model below the trained adapter: the base model, or the "
        "model.from_run chain merged in fp32 into OUTPUT_DIR.rollout_base), print the plain command line that serves "
        "it (run that line with the vLLM venv's python on another GPU/node: it needs vLLM and "
        "llmtune/rl/engines/vllm_server.py only; its memory fraction is rollout.vllm.gpu_memory_utilization, null = 0.9) and run it here. The trainer (rollout.vllm.mode: server, rollout.vllm.url: "
        "http://HOST:PORT) waits for it, pushes its LoRA adapter before every rollout batch and samples through it. "
        "Stop it with Ctrl-C or SIGTERM.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _recipe_args(rs)
    rs.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface; any address "
                    "but loopback needs a shared secret: rollout.vllm.secret_file or $LLMTUNE_ROLLOUT_SECRET)")
    rs.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    rs.add_argument("--print-only", action="store_true", help="build the rollout base, print the command, exit")
    c = sub.add_parser(
        "chat",
        help="talk to a run's result with its training chat template",
        description="Greedy chat with a merged model directory, a run directory (its merged/ model if exported, "
        "else base + adapter) or a pipeline directory (its merged/ model). Prompts are formatted with the saved "
        "chat template; generation stops at its EOS.",
    )
    c.add_argument("model", help="run, pipeline or model directory")
    c.add_argument("--prompt", default=None, help="ask one question, print the answer and exit")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--max-new-tokens", type=int, default=256, help="longest reply in tokens (default 256)")
    return parser


def _stage_summary(name: str) -> str:
    """First paragraph of the stage module's docstring, for ``llmtune <stage> --help``; read from the source file
    (``llmtune/stages/<name>.py`` or ``<name>/__init__.py``) without importing the stage (and the trainer)."""
    import ast

    root = Path(__file__).resolve().parent.parent / "stages"
    for path in (root / f"{name}.py", root / name / "__init__.py"):
        if path.is_file():
            doc = ast.get_docstring(ast.parse(path.read_text())) or ""
            return doc.strip().split("\n\n")[0].replace("``", "")
    return f"The {name} stage."


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe (may inherit with base: other.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides, applied in order")


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``llmtune ...``; overrides may also come after the flags (``llmtune sft R.yaml --nproc-per-node 8
    train.max_steps=10``): argparse stops filling a ``nargs="*"`` positional at the first flag, so the overrides left
    after it are appended in order. Anything else unknown is the usual usage error (exit 2)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if hasattr(args, "overrides") and not any(e.startswith("-") for e in extra):
            args.overrides = [*args.overrides, *extra]
        else:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from llmtune.utils import limit_heap_retention

    limit_heap_retention()  # freed CPU tensors go back to the system (glibc would keep them: docs/performance.md)
    # transformers 5 renamed gradient checkpointing; peft still calls the old names on every step.
    warnings.filterwarnings("ignore", message=".*is deprecated and will be removed in v6.*", category=FutureWarning)
    args = parse_command_line(argv)
    from llmtune.errors import EXIT_ERROR, EXIT_INTERRUPTED, LlmtuneError

    try:
        if args.command == "validate":
            from llmtune.commands.validate import validate_command

            from llmtune.core.launch import launch_overrides

            return validate_command(args.recipe, [*args.overrides, *launch_overrides(args)], stage=args.stage,
                                    example=args.example)
        if args.command == "export" and args.gguf and args.adapter:
            print("error: --gguf and --adapter are different exports (GGUF files of the merged model, or one peft "
                  "adapter); run them as two commands", file=sys.stderr)
            return EXIT_ERROR
        if args.command == "export" and args.gguf:
            from llmtune.export.gguf_export import export_gguf

            report = export_gguf(args.run_dir, args.gguf, out_dir=args.out, modelfile=not args.no_modelfile)
            return 0 if report["passed"] else 1
        if args.command == "export" and args.adapter:
            from llmtune.export.adapter import export_adapter

            return 0 if export_adapter(args.run_dir, out_dir=args.out)["passed"] else 1
        if args.command == "export":
            from llmtune.export.merge import export_run

            report = export_run(args.run_dir, dtype=args.dtype, out_dir=args.out, max_shard_size=args.max_shard_size)
            return 0 if report["passed"] else 1
        if args.command == "pipeline":
            from llmtune.pipeline.run import pipeline_command

            return pipeline_command(args.recipe, args.overrides, dry_run=args.dry_run)
        if args.command == "chat":
            from llmtune.commands.chat import chat_command

            return chat_command(args.model, args.prompt, args.max_new_tokens, args.system)
        if args.command == "rollout-server":
            from llmtune.commands.rollout_server import rollout_server_command

            return rollout_server_command(args.recipe, args.overrides, args.host, args.port, args.print_only)
        from llmtune.core.launch import launch_overrides

        return run_stage_command(args.command, args.recipe, args.overrides, launch=launch_overrides(args))
    except KeyboardInterrupt:
        if args.command in (*stage_names(), "pipeline"):  # commands that train and checkpoint
            print("\ninterrupted. Complete checkpoints written so far are kept: the same command continues from the "
                  "newest one (train.resume_from: auto).", file=sys.stderr)
        else:
            print("\ninterrupted.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except LlmtuneError as exc:  # user-facing errors carry their own message (and exit code, llmtune.errors)
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except FileNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except RuntimeError as exc:  # out of GPU memory outside a stage (export, pairs, chat): figures and advice
        import torch

        if not isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        from llmtune.core.guard import OutOfMemoryError, oom_message

        print(f"error: {oom_message(exc)}", file=sys.stderr)
        return OutOfMemoryError.exit_code
    except OSError as exc:  # disk full / quota while writing anything else (metrics, reports): no traceback
        import errno

        from llmtune.errors import EXIT_DISK

        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        print(f"error: the disk is full ({exc}); free some space and rerun the same command (it continues from the "
              "newest complete checkpoint)", file=sys.stderr)
        return EXIT_DISK


def run_stage_command(command: str, recipe_path: str, overrides: list[str], launch: list[str] = ()) -> int:
    """Train one stage; ``launch`` = the launch flags as ``distributed.*`` overrides. Re-runs itself through torchrun
    when more processes or DeepSpeed are asked for and no launcher started it; a task of an ``srun`` step is one rank,
    or its node's launcher (:func:`llmtune.core.launch.slurm_launch`).

    Raises:
        RecipeError: the recipe (with the overrides and, for one srun task per node, SLURM's node rank and count).
        LaunchError: an srun layout that cannot work (see :func:`llmtune.core.launch.slurm_launch`).
    """
    from llmtune.core import launch as launcher
    from llmtune.config import load_recipe
    from llmtune.utils import is_main_process

    recipe = load_recipe(recipe_path, [*overrides, *launch], stage=command)  # a recipe error: before torch is imported
    rank_env, node_overrides = launcher.slurm_launch(recipe.distributed)  # a task of an srun step
    if node_overrides:  # one srun task per node: this node's launcher, node rank and count from SLURM
        recipe = load_recipe(recipe_path, [*overrides, *launch, *node_overrides], stage=command)
    os.environ.update(rank_env)  # several srun tasks per node: each task is one rank, nothing is re-launched
    if rank_env and rank_env["RANK"] == "0":
        launcher.log.info("srun: each of the %s tasks is one rank (%s on this node; no torchrun); rendezvous %s:%s",
                          rank_env["WORLD_SIZE"], rank_env["LOCAL_WORLD_SIZE"], rank_env["MASTER_ADDR"],
                          rank_env["MASTER_PORT"])
    if launcher.needs_launch(recipe):
        return launcher.relaunch(command, recipe_path, list(overrides), recipe)
    from llmtune.core.runner import run_stage
    from llmtune.stages import STAGES

    summary = run_stage(STAGES[command](recipe, recipe_dir=Path(recipe_path).parent), base_dir=Path.cwd())
    if is_main_process():
        print_summary(command, summary)
    if launcher.under_launcher():
        launcher.finish(0)  # every rank leaves together, after rank 0 has written the run directory
    return 0


def print_summary(command: str, summary: dict) -> None:
    """The end-of-run table of one stage (stderr)."""
    from rich.table import Table

    from llmtune.stages import STAGES
    from llmtune.utils import make_console

    table = Table(title=f"llmtune {command}: done")
    trained = next(k for k in summary if k.startswith("trained_"))  # trained_tokens (SFT), trained_pairs (RM, DPO)
    for key in ("run_dir", "steps", "train_loss", trained, "wall_s", "adapter"):
        table.add_row(key, f"{summary[key]:.4f}" if isinstance(summary[key], float) else str(summary[key]))
    key_metric = STAGES[command].key_metric  # eval_loss (SFT), eval_accuracy (RM), ..., eval_score (PPO)
    for when in ("eval_before", "eval_after"):
        if summary.get(when):
            table.add_row(f"{when} {key_metric.removeprefix('eval_')}",
                          f"{summary[when].get(key_metric, float('nan')):.4f}")
    make_console(stderr=True).print(table)


if __name__ == "__main__":
    from llmtune.core.launch import exit_process

    exit_process(main())
