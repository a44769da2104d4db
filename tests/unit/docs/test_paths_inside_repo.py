"""No shipped recipe (recipes/**/*.yaml) or doc (docs/**/*.md, README.md) names a path outside the repository
(issue 32): on another clone such a path does not exist, so a recipe that reads it fails and a page that shows it
misleads. Data the recipes need ships with the project (``builtin:`` sources).

What counts as outside:
- a path that climbs out with ``../``: a Markdown link target resolved against its page, anything else (a command,
  a recipe value, a comment) against the repository root, where the commands run;
- an absolute path, except system paths (``/usr/bin/time``, ``/dev/shm``, ``/tmp/...``) and the placeholders the
  pages use for the reader's own files (``/path/to/...``; ``/shared/...``: a file system every node of a cluster
  sees; ``/models/...``: an export destination); in a recipe's YAML values no absolute path at all;
- ``~/`` outside llmtune's own cache (``~/.cache/llmtune``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
PAGES = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])
RECIPES = sorted((ROOT / "recipes").rglob("*.yaml"))

LINK = re.compile(r"\]\(([^)\s]+)\)")  # a Markdown link's target
UP = re.compile(r"(?<![\w.~/-])((?:\./)?(?:[\w.-]+/)*\.\./[^\s`'\")\]>,;]*)")  # a relative path with a ../ in it
ABSOLUTE = re.compile(r"(?<![\w.)\]/~}$>*:-])(/[\w.-]+(?:/[\w.-]+)+/?)")  # /a/b... (not a/b, $X/b, {x}/b, URLs)
HOME = re.compile(r"(?<![\w.~/-])(~/[^\s`'\")\]>,;]*)")
ALLOWED_ABSOLUTE = ("/usr/", "/bin/", "/dev/", "/proc/", "/tmp/", "/path/to/", "/shared/", "/models/")
ALLOWED_HOME = ("~/.cache/llmtune",)


def _inside(path: str, base: Path) -> bool:
    return Path(os.path.normpath(base / path)).is_relative_to(ROOT)


def outside_paths(text: str, page_dir: Path | None = None) -> list[str]:
    """The paths outside the repository that a page's or recipe's text names.

    Args:
        text: the file's text.
        page_dir: the directory of a Markdown page (its link targets are relative to it); None for a recipe.

    Returns:
        The offending path tokens, in order of appearance.
    """
    found = []
    if page_dir is not None:
        for target in LINK.findall(text):
            path = target.split("#", 1)[0]
            if path and not re.match(r"[a-z][a-z0-9+.-]*:", path) and not _inside(path, page_dir):
                found.append(target)
        text = LINK.sub("](#)", text)
    found += [p for p in UP.findall(text) if not _inside(p, ROOT)]
    found += [p for p in ABSOLUTE.findall(text) if not p.startswith(ALLOWED_ABSOLUTE)]
    found += [p for p in HOME.findall(text) if not p.startswith(ALLOWED_HOME)]
    return found


def _strings(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings(value)
    elif isinstance(node, str):
        yield node


def test_checker_finds_paths_outside_and_passes_paths_inside():
    stages = ROOT / "docs" / "stages"
    bad = ("path: ../shared/data/hh-rlhf-harmless-base-1800.jsonl.gz\n"
           "see [data](../../../outside.md), `cat /work/shared/data/x.gz`, recipes/../../x.yaml, ~/data/pairs.jsonl")
    assert outside_paths(bad, stages) == ["../../../outside.md", "../shared/data/hh-rlhf-harmless-base-1800.jsonl.gz",
                                          "recipes/../../x.yaml", "/work/shared/data/x.gz", "~/data/pairs.jsonl"]
    good = ("[beta](../reference/recipe.md#dpo.beta) [x](https://a.b/c/d) `runs/sft/merged` `{pairs}/sub/path`\n"
            "`$VENV/bin/python` `/usr/bin/time -v` `/path/to/Llama-2-7b-hf` `~/.cache/llmtune/data` "
            "`model.name_or_path=/shared/Llama-2-7b-hf` `recipes/../recipes/x.yaml` http://127.0.0.1:8000/health")
    assert outside_paths(good, stages) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_doc_names_no_path_outside_the_repository(page):
    found = outside_paths(page.read_text(), page.parent)
    assert not found, f"{page.relative_to(ROOT)} names paths outside the repository: {found}"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(ROOT)))
def test_recipe_names_no_path_outside_the_repository(recipe):
    text = recipe.read_text()
    found = outside_paths(text)  # values and comments
    values = [s for s in _strings(yaml.safe_load(text)) if s.startswith(("/", "~")) or ".." in s.split("/")]
    assert not found and not values, f"{recipe.relative_to(ROOT)} names paths outside the repository: {found + values}"
