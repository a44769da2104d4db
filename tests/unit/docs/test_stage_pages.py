"""Every stage has its page in the site's navigation, shows the shipped quickstart recipe of that stage (included
from recipes/, so it is the tested file), and names only metrics the code logs."""

import re
from pathlib import Path

import pytest
import yaml

from llmtune.config.options import stage_names

ROOT = Path(__file__).resolve().parents[3]
STAGES = stage_names()
SOURCE = "\n".join(p.read_text() for p in (ROOT / "llmtune").rglob("*.py"))
# prefixes the trainer adds to a stage's own metric names: eval_ (evaluation), trained_<item unit> (running count)
PREFIXES = ("eval_", "trained_")


def _nav_files(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [f for item in nav for f in _nav_files(item)]
    if isinstance(nav, dict):
        return [f for value in nav.values() for f in _nav_files(value)]
    return []


def test_every_stage_has_a_page_in_the_nav():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)
    nav = _nav_files(config["nav"])
    for stage in STAGES:
        assert (ROOT / "docs" / "stages" / f"{stage}.md").is_file(), f"docs/stages/{stage}.md is missing"
        assert f"stages/{stage}.md" in nav, f"mkdocs.yml nav lacks stages/{stage}.md"
    assert {"reference/recipe.md", "reference/cli.md"} <= set(nav)


@pytest.mark.parametrize("stage", STAGES)
def test_stage_page_includes_its_quickstart_recipe(stage):
    text = (ROOT / "docs" / "stages" / f"{stage}.md").read_text()
    assert f'--8<-- "recipes/quickstart_{stage}.yaml"' in text
    assert (ROOT / "recipes" / f"quickstart_{stage}.yaml").is_file()


def metric_names(text: str) -> list[str]:
    """Code spans in the first column of the tables under the page's "## Metrics" heading (up to the next ##)."""
    section = ("\n" + text).split("\n## Metrics", 1)[1].split("\n## ", 1)[0]
    names = []
    for line in section.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            names += re.findall(r"`([^`]+)`", line.split(" | ")[0])
    return names


def _logged(name: str) -> bool:
    """The name (or what is left after a prefix the trainer adds) is a string literal in llmtune's code."""
    candidates = [name] + [name[len(p):] for p in PREFIXES if name.startswith(p)]
    return any(re.search(rf"[\"']{re.escape(c)}[\"']", SOURCE) for c in candidates)


def test_metric_finder_reads_the_first_column():
    page = "## Metrics\n\n| metric | meaning |\n| --- | --- |\n| `a`, `b/c` | uses `x` |\n\n## Next\n| `z` | |\n"
    assert metric_names(page) == ["a", "b/c"]
    assert _logged("eval_rewards/accuracies") and not _logged("eval_rewards/accuracy")


@pytest.mark.parametrize("stage", STAGES)
def test_stage_page_metrics_are_logged_by_the_code(stage):
    names = metric_names((ROOT / "docs" / "stages" / f"{stage}.md").read_text())
    assert names, f"docs/stages/{stage}.md has no metrics table"
    unknown = [n for n in names if "<" not in n and "..." not in n and not _logged(n)]
    assert not unknown, f"docs/stages/{stage}.md names metrics no code logs: {unknown}"


def test_sft_page_quotes_the_quickstart_pipeline_as_shipped():
    """docs/stages/sft.md's pipeline numbers are the shipped pipeline's SFT steps and README's measured SFT row (it
    quoted an old 32-step run after the pipeline moved to 24 steps, issue 32)."""
    pipeline = yaml.safe_load((ROOT / "recipes" / "quickstart_pipeline.yaml").read_text())["pipeline"]
    steps = next(s for s in pipeline["stages"] if s["name"] == "sft")["overrides"]["train.max_steps"]
    before, after = re.search(r"^\| SFT \|[^|]+\| ([\d.]+) \| ([\d.]+) \|", (ROOT / "README.md").read_text(),
                              re.M).groups()
    text = " ".join((ROOT / "docs" / "stages" / "sft.md").read_text().split())
    quoted = re.findall(r"(\d+)-step", text)
    assert quoted and set(quoted) == {str(steps)}, f"sft.md quotes {quoted}-step runs; the pipeline's SFT has {steps}"
    assert f"{steps}-step SFT goes from {before} to {after}" in text
