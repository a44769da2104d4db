"""The recipe options a command reads, walked once from the schema: every key with its type, default and help.

Two readers format this walk: ``llmtune <stage> --help`` (plain text, :func:`llmtune.commands.cli.options_help`) and the
documentation site's generated recipe reference (``scripts/gen_docs.py`` -> ``docs/reference/recipe.md``).
Nothing here imports a stage module, so ``--help`` stays fast.
"""

from __future__ import annotations

import types
import typing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

# recipe sections a stage reads (llmtune <stage> --help lists these); validate lists them all.
# a stage reads the common sections, its own (named like the stage, when the schema has one) and these:
STAGE_SECTIONS = {"ppo": ("rollout", "agent", "reward"), "grpo": ("rollout", "agent", "reward")}
COMMON_SECTIONS = ("model", "data", "adapter", "train", "precision", "distributed", "output")


@dataclass(frozen=True)
class Option:
    """One row of the walk: a recipe key, or the heading of a sub-section (``rollout.vllm``).

    Attributes:
        key: dotted path as written in overrides; list entries use ``N`` (``data.datasets.N.path``).
        depth: 0 = a key of the section, 1 = a key of a sub-section or of a list entry.
        type: readable type (:func:`type_name`); ``""`` for a sub-section heading.
        required: no default: the recipe must set it.
        default: the default as plain data (nested models dumped, ``exclude_defaults``); None when required.
        description: the field's help text (``Field(description=...)``), or the sub-section's first doc line.
        subsection: True for a sub-section heading row (its keys follow at depth 1).
    """

    key: str
    depth: int
    type: str
    required: bool
    default: Any
    description: str
    subsection: bool = False


@dataclass(frozen=True)
class SectionOptions:
    """A recipe section (``train:``): its docstring and its rows in schema order."""

    name: str
    doc: str
    options: list[Option]

    @property
    def summary(self) -> str:
        """First line of the section's docstring."""
        return self.doc.splitlines()[0] if self.doc else ""


def stage_names() -> list[str]:
    """Stage commands, from the schema's ``stage:`` values (no stage module is imported: ``--help`` stays fast)."""
    from llmtune.config.schema import Recipe

    literal = next(a for a in typing.get_args(Recipe.model_fields["stage"].annotation)
                   if typing.get_origin(a) is typing.Literal)
    return list(typing.get_args(literal))


def stage_sections(stage: str | None = None) -> list[str]:
    """Names of the recipe sections ``stage`` reads, in schema order: the common ones, its own, and
    :data:`STAGE_SECTIONS`; every section when ``stage`` is None (``llmtune validate``)."""
    from llmtune.config.schema import SECTIONS

    if stage is None:
        return list(SECTIONS)
    return [s for s in SECTIONS if s in COMMON_SECTIONS or s == stage or s in STAGE_SECTIONS.get(stage, ())]


def type_name(ann) -> str:
    """Readable type of a schema annotation: ``int or null``, ``list of str``, ``a | b`` for choices."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping" + (f" of {type_name(args[1])}" if len(args) == 2 and args[1] is not object else "")
    if ann is object:
        return "any"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "mapping"
    return getattr(ann, "__name__", None) or str(ann).replace("typing.", "")


def _option(key: str, field, depth: int) -> Option:
    if field.is_required():
        return Option(key, depth, type_name(field.annotation), True, None, field.description or "")
    default = field.get_default(call_default_factory=True)
    if isinstance(default, BaseModel):
        default = default.model_dump(exclude_defaults=True)
    elif isinstance(default, list) and default and isinstance(default[0], BaseModel):
        default = [d.model_dump(exclude_defaults=True) for d in default]
    return Option(key, depth, type_name(field.annotation), False, default, field.description or "")


def _first_line(cls: type) -> str:
    return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""


def recipe_options(stage: str | None = None) -> list[SectionOptions]:
    """Every recipe key ``stage`` reads (every section when None), section by section in schema order.

    A nested section (``rollout.vllm``) gives a heading row, then its keys at depth 1; the list ``data.datasets``
    gives its own row, then the keys of one entry as ``data.datasets.N.<key>`` at depth 1.
    """
    from llmtune.config.schema import SECTIONS, DatasetConfig

    out = []
    for section in stage_sections(stage):
        cls = SECTIONS[section]
        rows: list[Option] = []
        for name, field in cls.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):  # a sub-section: its doc line, then its keys
                rows.append(Option(f"{section}.{name}", 0, "", False, None, _first_line(ann), subsection=True))
                rows += [_option(f"{section}.{name}.{sub}", f, 1) for sub, f in ann.model_fields.items()]
                continue
            rows.append(_option(f"{section}.{name}", field, 0))
            if section == "data" and name == "datasets":
                rows += [_option(f"data.datasets.N.{sub}", f, 1) for sub, f in DatasetConfig.model_fields.items()]
        out.append(SectionOptions(section, (cls.__doc__ or "").strip(), rows))
    return out
