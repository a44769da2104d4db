"""The stage contract: what a stage (SFT, RM, DPO, PPO) declares; the core does the rest.

A stage gives its data kind, a loss as a function of (model, batch) normalised by the item count of
the whole optimizer step, its evaluation statistics and its metrics. Everything else — model loading,
adapters, precision, accumulation, DeepSpeed, checkpoints, logging, the run directory — is the core's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from llmtune.config import Recipe


@dataclass
class StageData:
    """Tokenized data of a stage.

    Attributes:
        train: rows the trainer iterates over (a ``datasets.Dataset`` or any sized sequence of dicts).
        eval: held-out rows, or ``None``.
        report: the data report (``to_dict()``, ``save(path)``, ``summary()``).
        collator: callable turning a list of rows into a batch of tensors.
        sources: ``[{path, sha256}]`` for the lineage.
    """

    train: Any
    eval: Any
    report: Any
    collator: Callable[[list[dict]], dict[str, torch.Tensor]]
    sources: list[dict] = field(default_factory=list)


class Stage:
    """Base class of every stage. Subclasses set ``name``/``data_kind`` and implement the hooks.

    Units: ``count_items`` returns what the step loss is averaged over (SFT: trained tokens; pairwise
    stages: pairs); the core sums it over all micro-batches of an optimizer step and over all ranks,
    and passes that total to ``loss``, so the gradient of a step does not depend on how it is split
    into micro-batches (transformers #34191).
    """

    name: ClassVar[str] = ""
    data_kind: ClassVar[str] = ""

    def __init__(self, recipe: Recipe):
        self.recipe = recipe

    @staticmethod
    def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, T, V) logits of a batch. ``use_cache=False`` is required: with a cache, transformers does not
        isolate packed rows (it detects them from ``position_ids`` only without mask and cache)."""
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
        return model(**inputs, use_cache=False).logits

    def build_data(self, tokenizer, base_dir: str) -> StageData:
        """Read, validate and tokenize the recipe's data. Raises ``DataError`` on bad input."""
        raise NotImplementedError

    def prepare_model(self, model: torch.nn.Module, tokenizer) -> torch.nn.Module:
        """Add what the stage needs on the base before the adapter (heads); default: nothing."""
        return model

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Items in this micro-batch that the loss averages over (scalar tensor)."""
        raise NotImplementedError

    def loss(
        self, model: torch.nn.Module, batch: dict[str, torch.Tensor], num_items: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of the micro-batch divided by ``num_items`` (the step's total), plus metrics to log."""
        raise NotImplementedError

    def eval_stats(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Per-sample statistics, each (B,), that :meth:`eval_metrics` reduces over the whole eval set."""
        raise NotImplementedError

    def eval_metrics(self, stats: dict[str, np.ndarray]) -> dict[str, float]:
        """Reduce concatenated per-sample statistics (all ranks) to metrics (keys without ``eval_``)."""
        raise NotImplementedError

    # Keys of eval_stats in a fixed order (the Trainer moves tuples, not dicts, between ranks).
    eval_keys: ClassVar[tuple[str, ...]] = ()
