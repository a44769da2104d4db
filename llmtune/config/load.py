"""Read a recipe: YAML file -> ``base:`` inheritance -> ``a.b=value`` overrides -> validated Recipe.

Errors of every kind (unknown keys, types, ranges, cross-field conflicts) are collected and raised
together as one :class:`~llmtune.config.validate.RecipeError`.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import yaml

from llmtune.config.schema import Recipe
from llmtune.config.validate import RecipeError, validate_recipe

MAX_INHERITANCE_DEPTH = 16


class DuplicateKeyError(yaml.YAMLError):
    """A key appears twice in one YAML mapping (PyYAML would silently keep the last)."""


class RecipeLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` for recipes and overrides: a key given twice in one mapping is an error (with both
    line numbers), and exponent floats without a dot (``3e-4``, ``1e5``) are numbers as in YAML 1.2 (PyYAML's YAML
    1.1 rules read them as strings, which strict number fields would then refuse)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):  # explicit keys only: a key overriding a `<<:` merge is fine
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                    seen.setdefault(key, line)
                except TypeError:  # unhashable key: PyYAML reports it below
                    continue
                if first is not None:
                    raise DuplicateKeyError(
                        f"duplicate key {key!r} at line {line} (first at line {first}) of {key_node.start_mark.name}: "
                        "a key may appear once per mapping (YAML would silently keep the last); delete one"
                    )
        return super().construct_mapping(node, deep=deep)


RecipeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml_text(stream) -> Any:
    """Parse YAML text or a file object with :class:`RecipeLoader`.

    Raises:
        yaml.YAMLError: syntax errors and :class:`DuplicateKeyError`.
    """
    return yaml.load(stream, Loader=RecipeLoader)  # noqa: S506 - a SafeLoader subclass


def deep_merge(base: dict, override: dict) -> dict:
    """Return ``base`` updated by ``override``; nested dicts merge, everything else (lists too) replaces."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def read_yaml(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """Read a recipe file and resolve its ``base:`` chain (paths relative to the including file).

    Raises:
        RecipeError: missing file, YAML syntax error, a non-mapping document, or an inheritance cycle.
    """
    path = Path(path).expanduser().resolve()
    if path in _chain:
        cycle = " -> ".join(str(p) for p in (*_chain, path))
        raise RecipeError([("base", f"inheritance cycle: {cycle}")], source=str(_chain[0]))
    if len(_chain) > MAX_INHERITANCE_DEPTH:
        raise RecipeError([("base", f"more than {MAX_INHERITANCE_DEPTH} levels of base: inheritance")], source=str(path))
    if path.is_dir():
        raise RecipeError([("", f"{path} is a directory; give the recipe's .yaml file")], source=str(path))
    if not path.is_file():
        where = f" (named by base: in {_chain[-1]})" if _chain else ""
        raise RecipeError([("", f"recipe file not found: {path}{where}")], source=str(path))
    try:
        with open(path, encoding="utf-8") as fh:  # a file object: YAML errors name the file, not "<unicode string>"
            doc = load_yaml_text(fh)
    except DuplicateKeyError as exc:
        raise RecipeError([("", str(exc))], source=str(path)) from None
    except yaml.YAMLError as exc:
        raise RecipeError([("", f"YAML syntax error: {exc}")], source=str(path)) from None
    except UnicodeDecodeError as exc:
        raise RecipeError([("", f"not UTF-8 text ({exc.reason} at byte {exc.start}); save the recipe as UTF-8")],
                          source=str(path)) from None
    if doc is None:
        raise RecipeError([("", "the recipe file is empty (nothing but blank lines or comments); write at least "
                           "`stage:` and the values that differ from the defaults (see recipes/quickstart_sft.yaml)")],
                          source=str(path))
    if not isinstance(doc, dict):
        raise RecipeError([("", f"a recipe must be a mapping of sections, got {type(doc).__name__}")], source=str(path))
    parent = doc.pop("base", None)
    if parent is None:
        return doc
    if not isinstance(parent, str):
        raise RecipeError([("base", f"must be a path to another recipe, got {parent!r}")], source=str(path))
    parent_path = (path.parent / parent) if not Path(parent).is_absolute() else Path(parent)
    return deep_merge(read_yaml(parent_path, (*_chain, path)), doc)


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split ``section.key=value`` into a key path and a YAML-typed value (``lr=1e-4`` gives a float).

    Raises:
        RecipeError: no ``=`` or an empty key.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise RecipeError([(text, "override must look like section.key=value, e.g. train.max_steps=10")])
    if not raw.strip():
        raise RecipeError([(key.strip(), "override has no value; write null explicitly to unset it (e.g. "
                            f"{key.strip()}=null)")])
    key = re.sub(r"\[(\d+)\]", r".\1", key)  # data.datasets[0].path == data.datasets.0.path
    try:
        value = load_yaml_text(raw)
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_override(doc: dict, keys: list[str], value: Any) -> None:
    """Set ``doc[k1][k2]... = value`` in place; numeric keys index into lists (``data.datasets.0.path``)."""
    node: Any = doc
    for i, key in enumerate(keys):
        last = i == len(keys) - 1
        if isinstance(node, list):
            if not key.isdigit() or int(key) >= len(node):
                raise RecipeError([(".".join(keys), f"list index {key} out of range: the list has {len(node)} entr{'y' if len(node) == 1 else 'ies'} "
                                    "(overrides can change entries, not add them: add sources in the recipe file)")])
            if last:
                node[int(key)] = value
            else:
                node = node[int(key)]
            continue
        if last:
            node[key] = value
        else:
            if not isinstance(node.get(key), (dict, list)):
                node[key] = {}
            node = node[key]


def load_recipe(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    *,
    stage: str | None = None,
    raw: dict | None = None,
) -> Recipe:
    """Load, inherit, override and validate a recipe.

    Args:
        path: YAML recipe file (may name ``base: other.yaml``). ``None`` starts from the defaults.
        overrides: ``section.key=value`` strings applied after inheritance, in order.
        stage: the CLI command; checked against ``stage:`` in the recipe and filled in when absent.
        raw: a dict used instead of reading ``path`` (inline recipes, tests).

    Raises:
        RecipeError: every problem found, each with its dotted path, in one error.
    """
    doc = copy.deepcopy(raw) if raw is not None else (read_yaml(path) if path is not None else {})
    doc.pop("base", None)
    if overrides:  # start from the defaults so that overrides can index default lists (data.datasets.0.path)
        doc = deep_merge(Recipe().model_dump(mode="json"), doc)
    problems: list[tuple[str, str]] = []
    for text in overrides:  # collect every bad override, then report them with the schema's problems
        try:
            keys, value = parse_override(text)
            apply_override(doc, keys, value)
        except RecipeError as exc:
            problems += exc.problems
    if stage is not None:
        declared = doc.get("stage")
        if declared is not None and declared != stage:
            raise RecipeError(
                [("stage", f"this recipe is for stage {declared!r} but was run with `llmtune {stage}`; "
                  f"run `llmtune {declared} ...` or change stage:")],
                source=str(path) if path else None,
            )
        doc["stage"] = stage
    try:
        recipe = validate_recipe(doc, source=str(path) if path else None)
    except RecipeError as exc:
        raise RecipeError(problems + exc.problems, source=exc.source) from None
    if problems:
        raise RecipeError(problems, source=str(path) if path else None)
    return recipe


def dump_recipe(recipe: Recipe, path: str | Path) -> None:
    """Write every resolved value (defaults included) as YAML."""
    Path(path).write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))
