"""The package layering (docs/contributing.md): imports point down, and no two modules import each other.

Every ``llmtune`` module's imports are read with :mod:`ast` (none is executed), at module level AND inside
functions, so an import moved into a function to dodge a circle or to reach a higher layer is still seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "llmtune"

# Layer of each top-level module/package of llmtune; a module may import its own layer and the ones below.
# rewards (the built-in reward functions, loading user functions, and the reward sources of online RL and of the
# pairs step) sits beside rl: rl imports rewards.sources, which reads rl.types; nothing below imports it.
# pipeline runs the export step (pipeline.run -> export.merge), so export sits below it.
LAYERS = {
    "errors": 0, "utils": 0, "tools": 0,
    "config": 1,
    "data": 2,
    "models": 3,
    "core": 4,
    "rl": 5, "rewards": 5,
    "stages": 6,
    "export": 7,
    "pipeline": 8,
    "commands": 9,
    "__main__": 10,  # python -m llmtune
    "__init__": 0,  # llmtune/__init__.py: __version__ and a logging filter, imports nothing from llmtune
}

# Upward imports that are allowed, all inside functions (never at module level), each for a documented reason,
# as (importing module, imported module or package). None is needed today: the stage registry (llmtune.stages.STAGES)
# is looked up only by pipeline and commands, which sit above the stages.
ALLOWED_UP: set[tuple[str, str]] = set()

# Function-level imports that close a circle and are allowed, each for a documented reason. Every other circle,
# through function-level imports too, fails test_no_import_circle_through_function_level_imports: move the shared
# piece down into a module both use instead of hiding the circle inside a function.
ALLOWED_LAZY: set[tuple[str, str]] = set()


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:]) if "." in name else Path()
    return (PACKAGE / rel).with_suffix(".py").is_file() or (PACKAGE / rel / "__init__.py").is_file()


def _targets(node: ast.AST, current: str, is_package: bool) -> list[str]:
    """The llmtune modules an import statement names (``from pkg import sub`` names ``pkg.sub`` when sub is a
    module, else ``pkg``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "llmtune"]
    base = node.module or ""
    if node.level:  # relative import
        anchor = current.split(".") if is_package else current.split(".")[:-1]
        anchor = anchor[: len(anchor) - node.level + 1]
        base = ".".join([*anchor, base] if base else anchor)
    if base.split(".")[0] != "llmtune":
        return []
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if _is_module(sub) else base)
    return out


def _under_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def collect_imports() -> dict[str, list[tuple[str, int, bool]]]:
    """module -> [(imported llmtune module, line, at module level)] for every module of the package.

    "Module level" = run when the module is imported (not inside a function or an ``if TYPE_CHECKING:`` block)."""
    result: dict[str, list[tuple[str, int, bool]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        tree = ast.parse(path.read_text(), filename=str(path))
        found: list[tuple[str, int, bool]] = []

        def visit(node: ast.AST, top: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for target in _targets(child, name, path.name == "__init__.py"):
                        found.append((target, child.lineno, top))
                elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                    visit(child, False)
                elif isinstance(child, ast.If) and _under_type_checking(child):
                    visit(child, False)
                else:
                    visit(child, top)

        visit(tree, True)
        result[name] = found
    return result


def layer(module: str) -> tuple[str, int]:
    """(top-level part, layer) of an llmtune module name."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    if top not in LAYERS:
        raise AssertionError(f"{module}: not in LAYERS of tests/unit/test_layers.py; give its package a layer")
    return top, LAYERS[top]


def upward_imports(imports: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    """Imports of a higher layer not in ALLOWED_UP (and every upward import at module level)."""
    bad = []
    for module, found in imports.items():
        top, mine = layer(module)
        for target, line, at_top in found:
            their_top, theirs = layer(target)
            if theirs <= mine:
                continue
            if not at_top and (module, target) in ALLOWED_UP:
                continue
            where = "module level" if at_top else "in a function"
            bad.append(f"{module}:{line} ({top}, layer {mine}) imports {target} ({their_top}, layer {theirs}) "
                       f"{where}")
    return bad


def module_cycles(imports: dict[str, list[tuple[str, int, bool]]]) -> list[list[str]]:
    """Strongly connected components (> 1 module, or a module importing itself) of the module-level import graph
    (Tarjan's algorithm)."""
    graph = {m: sorted({t for t, _, top in found if top and t in imports}) for m, found in imports.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strongconnect(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strongconnect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strongconnect(v)
    return cycles


def test_every_package_has_a_layer():
    tops = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
            if (p.suffix == ".py") or (p / "__init__.py").is_file()}
    assert tops <= set(LAYERS), f"give these a layer in LAYERS: {sorted(tops - set(LAYERS))}"


def test_no_package_imports_a_higher_layer():
    bad = upward_imports(collect_imports())
    assert not bad, "imports that point up (move the shared code down, or add a commented ALLOWED_UP entry):\n" + \
        "\n".join(bad)


def test_no_import_cycle_between_modules():
    cycles = module_cycles(collect_imports())
    assert not cycles, "modules that import each other at module level:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_no_import_circle_through_function_level_imports():
    imports = collect_imports()
    every = {m: [(t, line, True) for t, line, _ in found if (m, t) not in ALLOWED_LAZY | ALLOWED_UP]
             for m, found in imports.items()}
    cycles = module_cycles(every)
    assert not cycles, "modules that import each other (counting imports inside functions):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_allow_list_entries_still_exist_and_are_function_level():
    imports = collect_imports()
    for (module, target) in ALLOWED_UP | ALLOWED_LAZY:
        found = [top for t, _, top in imports.get(module, []) if t == target]
        assert found, f"ALLOWED_UP entry ({module}, {target}) no longer exists: remove it"
        assert not any(found), f"{module} imports {target} at module level: an upward import must not"


def private_imports() -> list[str]:
    """``from llmtune.<package>... import _name`` across top-level packages: a module reaching into another package's
    private names (rewards into rl's, rl into core's ...). Make the name public where two packages need it."""
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llmtune.") and not node.level:
                if node.module.split(".")[1] != layer(name)[0]:
                    bad += [f"{name}:{node.lineno} imports {node.module}.{a.name}" for a in node.names
                            if a.name.startswith("_") and not a.name.startswith("__")]
    return bad


def test_no_module_imports_another_packages_private_names():
    bad = private_imports()
    assert not bad, "private names used across packages (make them public):\n" + "\n".join(bad)


# The checker itself, on small hand-made graphs: a cycle and an upward import are found, a clean graph passes.

def test_checker_finds_a_cycle_and_an_upward_import():
    imports = {
        "llmtune.data.a": [("llmtune.data.b", 1, True)],
        "llmtune.data.b": [("llmtune.data.a", 1, True), ("llmtune.core.x", 2, False)],
        "llmtune.core.x": [("llmtune.data.a", 1, True)],
    }
    assert module_cycles(imports) == [["llmtune.data.a", "llmtune.data.b"]]
    assert upward_imports(imports) == ["llmtune.data.b:2 (data, layer 2) imports llmtune.core.x (core, layer 4) "
                                       "in a function"]
    imports["llmtune.data.b"] = [("llmtune.data.a", 1, False)]  # function level: no cycle at import time
    assert module_cycles(imports) == [] and upward_imports(imports) == []


@pytest.mark.parametrize(("source", "expected"), [
    ("from llmtune.data import cache\n", [("llmtune.data.cache", 1, True)]),
    ("from llmtune.data import DataError\n", [("llmtune.data", 1, True)]),
    ("def f():\n    import llmtune.core.trainer\n", [("llmtune.core.trainer", 2, False)]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from llmtune.core import stage\n",
     [("llmtune.core.stage", 3, False)]),
])
def test_imports_are_read_at_module_and_function_level(source, expected, tmp_path, monkeypatch):
    pkg = tmp_path / "llmtune"
    (pkg / "data").mkdir(parents=True)
    (pkg / "core").mkdir()
    for f in ("__init__.py", "data/__init__.py", "data/cache.py", "core/__init__.py", "core/stage.py",
              "core/trainer.py"):
        (pkg / f).write_text("")
    (pkg / "data" / "probe.py").write_text(source)
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    assert collect_imports()["llmtune.data.probe"] == expected
