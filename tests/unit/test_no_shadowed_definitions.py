"""No module defines the same top-level function or class twice (nor a method twice in one class body): the second
definition silently replaces the first, so a refactor that leaves the old copy below the new one runs the old code
while the tests of the new one pass against it (it happened: rl/model.shared_prompt_batch, 2026-12-02)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted([*(ROOT / "llmtune").rglob("*.py"), *(ROOT / "scripts").glob("*.py")])


def shadowed(body: list[ast.stmt], where: str) -> list[str]:
    """Names defined twice in one statement list (functions, async functions, classes), and inside each class."""
    seen: dict[str, int] = {}
    found = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            decorators = {getattr(d, "attr", getattr(d, "id", "")) for d in node.decorator_list}
            if node.name in seen and not decorators & {"overload", "setter", "getter", "deleter", "register"}:
                found.append(f"{where}: {node.name} (lines {seen[node.name]} and {node.lineno})")
            seen[node.name] = node.lineno
            if isinstance(node, ast.ClassDef):
                found += shadowed(node.body, f"{where}:{node.name}")
    return found


def test_the_check_finds_a_shadowed_definition():
    tree = ast.parse("def f():\n    return 1\n\n\ndef g():\n    pass\n\n\ndef f():\n    return 2\n")
    assert shadowed(tree.body, "m.py") == ["m.py: f (lines 1 and 9)"]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_definition_is_shadowed(path):
    assert shadowed(ast.parse(path.read_text()).body, str(path.relative_to(ROOT))) == []
