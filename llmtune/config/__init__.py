"""Recipes: schema (sections), loading (YAML, ``base:`` inheritance, overrides) and validation."""

from llmtune.config.load import dump_recipe, load_recipe
from llmtune.config.schema import (
    AdapterConfig,
    DataConfig,
    DatasetConfig,
    DistributedConfig,
    ModelConfig,
    OutputConfig,
    PrecisionConfig,
    Recipe,
    TrainConfig,
)
from llmtune.config.validate import RecipeError

__all__ = [
    "AdapterConfig", "DataConfig", "DatasetConfig", "DistributedConfig", "ModelConfig", "OutputConfig",
    "PrecisionConfig", "Recipe", "RecipeError", "TrainConfig", "dump_recipe", "load_recipe",
]
