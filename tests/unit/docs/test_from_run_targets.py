"""Every `from_run` that a shipped recipe, doc page or script names is a run directory that a shipped recipe writes
(its `output.dir`, or an `output.dir=` the same text sets), so following the docs step by step chains the stages
(issue 38: the SLURM DPO example read runs/llama7b_sft while the SLURM SFT example wrote runs/llama7b_zero3)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from llmtune.config import load_recipe
from llmtune.config.load import read_yaml

ROOT = Path(__file__).resolve().parents[3]
RECIPES = sorted(p for p in (ROOT / "recipes").rglob("*.yaml") if "pipeline" not in read_yaml(p))
TEXTS = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", *(ROOT / "scripts").glob("*.sh"),
                *(ROOT / "scripts").glob("*.sbatch"), *RECIPES])
RUN = re.compile(r"(?:model|reward)\.from_run=(runs/[\w.-]+)|from_run: (runs/[\w.-]+)")
SETS = re.compile(r"output\.dir=(runs/[\w.-]+)|\bdir: (runs/[\w.-]+)")


def written_by_recipes() -> set[str]:
    return {load_recipe(p, stage=read_yaml(p).get("stage", "sft")).output.dir for p in RECIPES}


def test_every_from_run_in_recipes_docs_and_scripts_is_a_run_a_recipe_writes():
    written = written_by_recipes()
    wrong = []
    for path in TEXTS:
        text = path.read_text()
        here = written | {a or b for a, b in SETS.findall(text)}
        for a, b in RUN.findall(text):
            if (a or b) not in here:
                wrong.append(f"{path.relative_to(ROOT)}: from_run {a or b}")
    assert not wrong, "no shipped recipe writes these run directories:\n" + "\n".join(wrong)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_a_recipes_from_run_is_written_by_another_recipe(path):
    doc = yaml.safe_load(path.read_text())
    for key in ("model", "reward"):
        run = (doc.get(key) or {}).get("from_run")
        if run:
            assert run in written_by_recipes(), f"{key}.from_run {run}"


COMMAND = re.compile(r"(?:llmtune\s+(sft|rm|dpo|orpo|simpo|kto|ppo|grpo)|(?:STAGE=(\w+)\s+)?sbatch\s+\S+)\s+"
                     r"(recipes/[\w.-]+\.yaml)((?:\s+[\w.]+=\S+)*)")


def _blocks(path: Path) -> list[str]:
    """The places where commands follow one another: a page's fenced code blocks; a script's or recipe's whole text."""
    text = path.read_text()
    if path.suffix == ".md":
        return re.findall(r"```(?:bash|sh|shell|console)?\n(.*?)```", text, flags=re.S)
    return [text]


def _runs(block: str) -> list[tuple[str, str | None, str]]:
    """``(output.dir, from_run, command)`` of each stage command in the block, with its overrides applied."""
    found = []
    for stage, sbatch_stage, recipe, overrides in COMMAND.findall(block):
        path = ROOT / recipe
        if not path.is_file() or "pipeline" in read_yaml(path):
            continue
        pairs = dict(o.split("=", 1) for o in overrides.split())
        recipe_obj = load_recipe(path, stage=stage or sbatch_stage or read_yaml(path).get("stage", "sft"))
        from_run = pairs.get("model.from_run", recipe_obj.model.from_run)
        found.append((pairs.get("output.dir", recipe_obj.output.dir), None if from_run == "null" else from_run,
                      f"{recipe} {overrides.strip()}"))
    return found


def test_a_chain_of_commands_reads_the_run_its_earlier_command_wrote():
    """Where a page or script runs a stage and then the next one, the next one's from_run is the run directory an
    earlier command of the same block wrote."""
    wrong = []
    for path in TEXTS:
        for block in _blocks(path):
            runs = _runs(block)
            for i, (_, from_run, command) in enumerate(runs):
                earlier = [out for out, _, _ in runs[:i]]
                if from_run and earlier and from_run not in earlier:
                    wrong.append(f"{path.relative_to(ROOT)}: {command} reads {from_run}, but the commands before it "
                                 f"write {', '.join(earlier)}")
    assert not wrong, "\n".join(wrong)
