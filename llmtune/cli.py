"""Command line: ``llmtune {sft,validate,export,chat} RECIPE [section.key=value ...]``.

Stage commands come from the stage registry (``llmtune.stages.STAGES``); each takes a recipe and
``section.key=value`` overrides. Every recipe option is listed in ``llmtune <stage> --help``, generated
from the schema's field descriptions (one source of that text).
"""

from __future__ import annotations

import argparse
import os
import sys
import typing
import warnings
from pathlib import Path

from pydantic import BaseModel

EXIT_USAGE = 2


def options_help() -> str:
    """Every recipe option as ``section.key  (type, default)  help`` lines, from the schema."""
    from llmtune.config.schema import SECTIONS, DatasetConfig

    lines = ["recipe options (set in the YAML or as section.key=value overrides):"]
    for section, cls in SECTIONS.items():
        lines.append(f"\n  {section}:  {(cls.__doc__ or '').strip().splitlines()[0]}")
        for name, field in cls.model_fields.items():
            lines.append(_field_line(f"{section}.{name}", field))
            if section == "data" and name == "datasets":
                for sub, sub_field in DatasetConfig.model_fields.items():
                    lines.append(_field_line(f"data.datasets[i].{sub}", sub_field, indent=6))
    lines.append("\n  stage: sft | rm | dpo | ppo (optional; must match the command)")
    lines.append("  base: path of a recipe to inherit from (relative to this recipe)")
    return "\n".join(lines)


def _field_line(path: str, field, indent: int = 4) -> str:
    ann = field.annotation
    type_name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
    if typing.get_origin(ann) is typing.Literal:
        type_name = " | ".join(str(a) for a in typing.get_args(ann))
    if field.is_required():
        return f"{' ' * indent}{path}  ({type_name}; required)\n{' ' * (indent + 4)}{field.description}"
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel) or (isinstance(default, list) and default and isinstance(default[0], BaseModel)):
        default = "..."
    return f"{' ' * indent}{path}  ({type_name}; default {default!r})\n{' ' * (indent + 4)}{field.description}"


def build_parser() -> argparse.ArgumentParser:
    from llmtune import __version__
    from llmtune.stages import STAGES

    parser = argparse.ArgumentParser(
        prog="llmtune",
        description="Staged fine-tuning of causal language models (SFT now; RM, DPO, PPO on the same core) "
        "from YAML recipes. Every stage writes a PEFT adapter into its run directory; `export` merges it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  llmtune validate recipes/quickstart_sft.yaml\n  llmtune sft recipes/quickstart_sft.yaml "
        "train.max_steps=20\n  llmtune export runs/quickstart_sft\n\n`llmtune sft --help` lists every recipe option.",
    )
    parser.add_argument("--version", action="version", version=f"llmtune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cls in STAGES.items():
        p = sub.add_parser(
            name,
            help=f"train the {name.upper()} stage from a recipe",
            description=f"{_stage_summary(cls)}\n\nRuns the {name} stage and writes the run directory "
            "(recipe.resolved.yaml, data_report.json, metrics.jsonl, loss.png, checkpoints/, adapter/, lineage.json).",
            epilog=options_help(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        _recipe_args(p)
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
    v.add_argument("--stage", default=None, choices=sorted(STAGES), help="stage to validate for (default: the "
                   "recipe's stage:, else sft)")
    v.add_argument("--example", type=int, default=0, help="index of the training row to render (default 0)")
    e = sub.add_parser(
        "export",
        help="merge a run's adapter into its base model and save it",
        description="Merge the adapter of RUN_DIR into its base model in fp32, cast once to --dtype, save "
        "safetensors + tokenizer (with the training chat template) + generation config into RUN_DIR/merged "
        "(or --out), reload it with AutoModelForCausalLM and compare its logits with the adapter model. "
        "Writes verification.json; exits 1 if the logits differ beyond tolerance.",
    )
    e.add_argument("run_dir", help="a finished run directory (holds lineage.json and adapter/)")
    e.add_argument("--dtype", choices=["auto", "fp32", "fp16", "bf16"], default="auto",
                   help="dtype of the saved weights (auto: the training precision)")
    e.add_argument("--out", default=None, help="output directory (default RUN_DIR/merged)")
    e.add_argument("--max-shard-size", default="2GB", help="largest safetensors shard (default 2GB)")
    c = sub.add_parser(
        "chat",
        help="talk to a run's result with its training chat template",
        description="Greedy chat with a merged model directory or a run directory (its merged/ model if exported, "
        "else base + adapter). Prompts are formatted with the saved chat template; generation stops at its EOS.",
    )
    c.add_argument("model", help="run directory or model directory")
    c.add_argument("--prompt", default=None, help="ask one question, print the answer and exit")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--max-new-tokens", type=int, default=256, help="longest reply in tokens (default 256)")
    return parser


def _stage_summary(cls) -> str:
    """First paragraph of the stage module's docstring, for ``llmtune <stage> --help``."""
    doc = (sys.modules[cls.__module__].__doc__ or cls.__doc__ or "").strip()
    return doc.split("\n\n")[0].replace("``", "")


def _recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe (may inherit with base: other.yaml)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="recipe overrides, applied in order")


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers 5 renamed gradient checkpointing; peft still calls the old names on every step.
    warnings.filterwarnings("ignore", message=".*is deprecated and will be removed in v6.*", category=FutureWarning)
    args = build_parser().parse_args(argv)
    from llmtune.config import RecipeError

    try:
        if args.command == "validate":
            from llmtune.validate import validate_command

            return validate_command(args.recipe, args.overrides, stage=args.stage, example=args.example)
        if args.command == "export":
            from llmtune.export import export_run

            report = export_run(args.run_dir, dtype=args.dtype, out_dir=args.out, max_shard_size=args.max_shard_size)
            return 0 if report["passed"] else 1
        if args.command == "chat":
            from llmtune.chat import chat_command

            return chat_command(args.model, args.prompt, args.max_new_tokens, args.system)
        return run_stage_command(args.command, args.recipe, args.overrides)
    except KeyboardInterrupt:
        print("\ninterrupted. Checkpoints written so far are kept: continue with the same command plus "
              "train.resume_from=latest (needs train.save_steps).", file=sys.stderr)
        return 130
    except (RecipeError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # known user-facing errors carry their own message
        if type(exc).__name__ in ("DataError", "ModelLoadError", "AdapterSaveError", "ExportError"):
            print(f"error: {exc}", file=sys.stderr)
            return 1
        raise


def run_stage_command(command: str, recipe_path: str, overrides: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from llmtune.config import load_recipe
    from llmtune.core.runner import run_stage
    from llmtune.stages import STAGES

    recipe = load_recipe(recipe_path, overrides, stage=command)
    summary = run_stage(STAGES[command](recipe), base_dir=Path.cwd())
    table = Table(title=f"llmtune {command}: done")
    trained = next(k for k in summary if k.startswith("trained_"))  # trained_tokens (SFT), trained_pairs (RM, DPO)
    for key in ("run_dir", "steps", "train_loss", trained, "wall_s", "adapter"):
        table.add_row(key, f"{summary[key]:.4f}" if isinstance(summary[key], float) else str(summary[key]))
    for when in ("eval_before", "eval_after"):
        if summary.get(when):
            table.add_row(f"{when} loss", f"{summary[when].get('eval_loss', float('nan')):.4f}")
    Console(stderr=True).print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
