"""Stages: thin classes over the core. ``STAGES`` maps a CLI command to its stage class."""

from llmtune.core.stage import PairwiseStage, Stage
from llmtune.stages.dpo import DPOStage
from llmtune.stages.ppo import PPOStage
from llmtune.stages.rm import RMStage
from llmtune.stages.sft import SFTStage

STAGES: dict[str, type[Stage]] = {cls.name: cls for cls in (SFTStage, RMStage, DPOStage, PPOStage)}

__all__ = ["STAGES", "DPOStage", "PPOStage", "PairwiseStage", "RMStage", "SFTStage", "Stage"]
