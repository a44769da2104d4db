"""Every recipe the documentation shows is valid: each ```yaml block of docs/**/*.md and README.md with a top-level
`stage:` (a stage recipe) or `pipeline:` (a pipeline recipe) passes llmtune's own loader (the config-only path: no
model, no data loaded); every other yaml block at least parses. Files the pages include with pymdownx.snippets
(--8<-- "recipes/...") are shipped recipes, validated by tests/unit/config/test_recipes.py and the pipeline tests."""

import re
from pathlib import Path

import pytest
import yaml

from llmtune.config import RecipeError, load_recipe
from llmtune.config.load import read_yaml

ROOT = Path(__file__).resolve().parents[3]
PAGES = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md"])
FENCE = re.compile(r"^(?P<indent>[ \t]*)```ya?ml[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)
SNIPPET = re.compile(r'^[ \t]*-{1,}8<-{1,}[ \t]+"([^"]+)"', re.M)


def yaml_blocks(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each fenced yaml block of a Markdown file (indented blocks dedented)."""
    text = path.read_text()
    blocks = []
    for m in FENCE.finditer(text):
        indent = len(m.group("indent"))
        body = "\n".join(line[indent:] for line in m.group("body").splitlines())
        blocks.append((text.count("\n", 0, m.start()) + 1, body))
    return blocks


BLOCKS = [(p, line, body) for p in PAGES if p.is_file() for line, body in yaml_blocks(p)]


def _shipped(name: str) -> str | None:
    """Absolute path of a recipe file a block names, relative to the repository or to recipes/; None if neither."""
    for path in (ROOT / name, ROOT / "recipes" / name):
        if path.is_file():
            return str(path)
    return None


def _id(block) -> str:
    return f"{block[0].relative_to(ROOT)}:{block[1]}"


def test_block_finder_sees_fenced_and_indented_blocks(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n```yaml\nstage: sft\n```\n\n1. step\n\n    ```yaml\n    a: 1\n    ```\n```bash\nls\n```\n")
    assert yaml_blocks(page) == [(2, "stage: sft"), (8, "a: 1")]


@pytest.mark.parametrize("block", BLOCKS, ids=[_id(b) for b in BLOCKS])
def test_doc_yaml_block_is_valid(block, tmp_path):
    path, line, body = block
    where = f"{path.relative_to(ROOT)} line {line}"
    if SNIPPET.search(body):  # the block is an included recipes/ file (checked by the recipe tests)
        return
    try:
        doc = yaml.safe_load(body)
    except yaml.YAMLError as exc:
        pytest.fail(f"{where}: the yaml block does not parse: {exc}")
    if not isinstance(doc, dict) or not ({"stage", "pipeline"} & set(doc)):
        return
    recipe = tmp_path / "recipe.yaml"
    if isinstance(doc.get("base"), str):
        # a shipped base (recipes/quickstart_sft.yaml, or quickstart_sft.yaml as if the block lay in recipes/) is
        # used; a placeholder (base: other.yaml, the reader's own file) is left out: the keys are checked over the
        # defaults
        base = _shipped(doc["base"])
        if base is None:
            del doc["base"]
        else:
            doc["base"] = base
    for step in (doc.get("pipeline") or {}).get("stages") or []:  # step recipe files, as if the block lay in recipes/
        if isinstance(step, dict) and isinstance(step.get("recipe"), str):
            step["recipe"] = _shipped(step["recipe"]) or step["recipe"]
    recipe.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        if "pipeline" in doc:
            from llmtune.pipeline.spec import load_pipeline

            load_pipeline(recipe, base_dir=ROOT)
        else:
            load_recipe(recipe, stage=doc["stage"])
    except RecipeError as exc:
        pytest.fail(f"{where}: the recipe shown is not valid:\n{exc}")


def test_snippets_are_shipped_recipes():
    """Included files exist and are recipes/*.yaml (so the recipe tests validate what the pages show), or a program
    shipped beside them (recipes/*.py: an agent program) that a test runs by its path."""
    included = [(p, name) for p in PAGES if p.is_file() for name in SNIPPET.findall(p.read_text())]
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for page, name in included:
        assert (ROOT / name).is_file(), f"{page.relative_to(ROOT)} includes {name}, which does not exist"
        assert name.startswith("recipes/") and name.endswith((".yaml", ".py")), f"{page.relative_to(ROOT)} includes {name}"
        if name.endswith(".py"):
            assert name in tests, f"{page.relative_to(ROOT)} includes {name}, which no test runs"


def test_every_shipped_recipe_is_validated_by_a_test():
    """Stage recipes: tests/unit/config/test_recipes.py globs recipes/ (every non-pipeline file); pipeline recipes
    each need a test that loads them by name."""
    tests = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for path in sorted((ROOT / "recipes").rglob("*.yaml")):
        if "pipeline" in read_yaml(path):
            assert path.name in tests, f"no test loads the pipeline recipe {path.relative_to(ROOT)}"
    assert 'rglob("*.yaml")' in (ROOT / "tests" / "unit" / "config" / "test_recipes.py").read_text()
