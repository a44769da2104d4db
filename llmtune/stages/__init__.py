"""Stages: thin classes over the core. ``STAGES`` maps a CLI command to its stage class."""

from llmtune.core.stage import Stage
from llmtune.stages.sft import SFTStage

STAGES: dict[str, type[Stage]] = {cls.name: cls for cls in (SFTStage,)}

__all__ = ["STAGES", "SFTStage", "Stage"]
