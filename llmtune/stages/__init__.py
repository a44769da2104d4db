"""Stages: thin classes over the core. ``STAGES`` maps a CLI command to its stage class."""

from llmtune.core.stage import PairwiseStage, Stage
from llmtune.stages.dpo import DPOStage
from llmtune.stages.grpo import GRPOStage
from llmtune.stages.ppo import PPOStage
from llmtune.stages.rm import RMStage
from llmtune.stages.sft import SFTStage

STAGES: dict[str, type[Stage]] = {cls.name: cls for cls in (SFTStage, RMStage, DPOStage, PPOStage, GRPOStage)}

__all__ = ["STAGES", "DPOStage", "GRPOStage", "PPOStage", "PairwiseStage", "RMStage", "SFTStage", "Stage"]
