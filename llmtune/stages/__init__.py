"""Stages: thin classes over the core. ``STAGES`` maps a CLI command to its stage class."""

from llmtune.core.stage import PairwiseStage, Stage
from llmtune.stages.dpo import DPOStage
from llmtune.stages.grpo import GRPOStage
from llmtune.stages.kto import KTOStage
from llmtune.stages.orpo import ORPOStage
from llmtune.stages.ppo import PPOStage
from llmtune.stages.rm import RMStage
from llmtune.stages.sft import SFTStage
from llmtune.stages.simpo import SimPOStage

STAGES: dict[str, type[Stage]] = {cls.name: cls for cls in (SFTStage, RMStage, DPOStage, PPOStage, GRPOStage)}
STAGES.update({cls.name: cls for cls in (ORPOStage, SimPOStage, KTOStage)})  # preference stages beside DPO

__all__ = ["STAGES", "DPOStage", "GRPOStage", "KTOStage", "ORPOStage", "PPOStage", "PairwiseStage", "RMStage",
           "SFTStage", "SimPOStage", "Stage"]
