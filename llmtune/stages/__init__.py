"""Stages: thin classes over the core. ``STAGES`` maps a CLI command to its stage class.

The registry is lazy: a stage's module (and what it needs: torch, the trainer, the online-RL machinery of PPO/GRPO)
is imported when that stage is looked up (``STAGES["sft"]``), never by ``import llmtune.stages``, listing the
names (``list(STAGES)``, ``"dpo" in STAGES``) or another stage. So ``llmtune validate`` of an SFT recipe does not import
the PPO/GRPO trainers, and ``llmtune --help`` imports no stage at all. ``from llmtune.stages import SFTStage``
works too (module ``__getattr__``, PEP 562) and imports that stage only.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what the lazy names below resolve to (for type checkers and tests/unit/test_layers.py)
    from llmtune.core.stage import PairwiseStage, Stage
    from llmtune.stages.dpo import DPOStage
    from llmtune.stages.grpo import GRPOStage
    from llmtune.stages.kto import KTOStage
    from llmtune.stages.orpo import ORPOStage
    from llmtune.stages.ppo import PPOStage
    from llmtune.stages.rm import RMStage
    from llmtune.stages.sft import SFTStage
    from llmtune.stages.simpo import SimPOStage

# stage command -> (module, class), in the order the CLI lists them; each class's ``name`` is its command
_STAGE_CLASSES: dict[str, tuple[str, str]] = {
    "sft": ("llmtune.stages.sft", "SFTStage"),
    "rm": ("llmtune.stages.rm", "RMStage"),
    "dpo": ("llmtune.stages.dpo", "DPOStage"),
    "ppo": ("llmtune.stages.ppo", "PPOStage"),
    "grpo": ("llmtune.stages.grpo", "GRPOStage"),
    "orpo": ("llmtune.stages.orpo", "ORPOStage"),  # preference stages beside DPO
    "simpo": ("llmtune.stages.simpo", "SimPOStage"),
    "kto": ("llmtune.stages.kto", "KTOStage"),
}
_OTHER_CLASSES = {"Stage": "llmtune.core.stage", "PairwiseStage": "llmtune.core.stage"}


class StageRegistry(Mapping):
    """Read-only ``{command: stage class}`` that imports a stage's module on its first lookup.

    Raises:
        KeyError: ``registry[name]`` for a name that is not a stage (``name in registry`` / ``.get`` to test).
    """

    def __init__(self, classes: dict[str, tuple[str, str]]):
        self._classes = dict(classes)
        self._loaded: dict[str, type[Stage]] = {}

    def __getitem__(self, name: str) -> type[Stage]:
        if name not in self._loaded:
            module, cls = self._classes[name]
            self._loaded[name] = getattr(importlib.import_module(module), cls)
        return self._loaded[name]

    def __contains__(self, name: object) -> bool:  # Mapping's default would look the stage up (an import)
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)

    def __len__(self) -> int:
        return len(self._classes)

    def __repr__(self) -> str:
        return f"StageRegistry({list(self._classes)})"


STAGES = StageRegistry(_STAGE_CLASSES)


def __getattr__(name: str):
    """``from llmtune.stages import DPOStage``: the class, its module imported now (PEP 562)."""
    for module, cls in _STAGE_CLASSES.values():
        if cls == name:
            return getattr(importlib.import_module(module), cls)
    if name in _OTHER_CLASSES:
        return getattr(importlib.import_module(_OTHER_CLASSES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["STAGES", "DPOStage", "GRPOStage", "KTOStage", "ORPOStage", "PPOStage", "PairwiseStage", "RMStage",
           "SFTStage", "SimPOStage", "Stage", "StageRegistry"]
