"""The stage contract: what a stage (SFT, RM, DPO, PPO) declares; the core does the rest.

A stage gives its data kind, a loss as a function of (model, batch) normalised by the item count of
the whole optimizer step, its evaluation statistics and its metrics. Everything else — model loading,
adapters, precision, accumulation, DeepSpeed, checkpoints, logging, the run directory — is the core's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar

import numpy as np
import torch

from llmtune.config import Recipe


HIGHER, LOWER = "higher", "lower"


@dataclass(frozen=True)
class HeldOutMetric:
    """A held-out (eval) metric that says whether a stage learned, with the direction that means "learned".

    Attributes:
        name: the metric's key in ``metrics.jsonl`` (``eval_loss``, ``eval_accuracy``, ``eval_score`` ...).
        better: ``"higher"`` / ``"lower"``, or ``None`` for a metric shown but not judged (KL, truncation).
        chance: for a pair accuracy, the chance level (0.5) the after-training value must also exceed.
    """

    name: str
    better: str | None
    chance: float | None = None


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
    # Head the core loads the base with (llmtune.models.HEADS): causal_lm, or score (one scalar: reward/value).
    model_head: ClassVar[str] = "causal_lm"
    # What count_items counts; the training logs report the running total as trained_<item_unit>.
    item_unit: ClassVar[str] = "tokens"
    # Trainer class the runner builds (a CoreTrainer subclass; PPO brings its own rollout loop). None = CoreTrainer.
    trainer_class: ClassVar[Any] = None
    # The held-out metrics that say whether the stage learned, the first one the stage's key metric: read by the
    # end-of-run table, the pipeline summary, the model card and scripts/quickstart_report.py (before -> after).
    held_out_metrics: ClassVar[tuple[HeldOutMetric, ...]] = (HeldOutMetric("eval_loss", LOWER),)
    # held_out_metrics[0].name, set for every subclass (summary tables, pipeline, model card).
    key_metric: ClassVar[str] = "eval_loss"
    # The curves of plots/summary.png, those that say whether the stage works (llmtune.core.plots.summary_panels):
    # training metric names, each drawn with its eval twin; a tuple shares one panel; a name not logged is skipped.
    plot_metrics: ClassVar[tuple[str | tuple[str, ...], ...]] = ("loss",)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.key_metric = cls.held_out_metrics[0].name

    def __init__(self, recipe: Recipe, recipe_dir: str | Path | None = None):
        """Args: recipe: the validated recipe. recipe_dir: the directory of the recipe file (None: a recipe
        without a file): reward modules are looked for there after the working directory
        (:func:`llmtune.rewards.functions.reward_search_dirs`)."""
        self.recipe = recipe
        self.recipe_dir = Path(recipe_dir) if recipe_dir is not None else None

    @staticmethod
    def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, T, V) logits of a batch. ``use_cache=False`` is required: with a cache, transformers does not
        isolate packed rows (it detects them from ``position_ids`` only without mask and cache)."""
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
        return model(**inputs, use_cache=False).logits

    def build_data(self, tokenizer, base_dir: str) -> StageData:
        """Read, validate and tokenize the recipe's data. Raises ``DataError`` on bad input."""
        raise NotImplementedError

    def preflight(self, base_dir: str) -> list[tuple[str, str]]:
        """Problems found before any data or weights are loaded, as ``(recipe key, message)``: here, a
        ``model.from_run`` whose model does not fit this stage (:func:`llmtune.models.lineage.from_run_problems`);
        stages add their own. The runner raises them as one ``RecipeError``; ``llmtune validate`` reports them."""
        from llmtune.models.lineage import from_run_problems

        return from_run_problems(self.recipe, self.name, self.model_head, base_dir)

    def prepare_model(self, model: torch.nn.Module, tokenizer) -> torch.nn.Module:
        """Add what the stage needs on the base before the adapter (heads); default: nothing."""
        return model

    def prepare_data(self, trainer: Any, data: StageData) -> StageData:
        """Last changes to the data that need the model, once before training (DPO: reference log-probs).

        Called with the constructed trainer (model on its device, ``trainer.accelerator`` for autocast);
        default: nothing.
        """
        return data

    def render_example(self, row: dict, tokenizer) -> str:
        """One tokenized row as text with its trained tokens marked (for ``llmtune validate``)."""
        from llmtune.data import render_labels

        return render_labels(row["input_ids"], row["labels"], tokenizer)

    def count_items(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Items in this micro-batch that the loss averages over (scalar tensor)."""
        raise NotImplementedError

    def prepare_step(self, trainer: Any, batches: list[dict[str, torch.Tensor]]) -> None:
        """Called once per optimizer step with all its micro-batches (this rank's, not yet on the device), before
        their losses; on every rank (collectives are allowed). For statistics of a whole step (KTO's KL reference
        point), so that they do not depend on how the step is split into micro-batches. Default: nothing."""

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


class PairwiseStage(Stage):
    """Base of the stages trained on preference pairs (RM, DPO): their data, batches and item count.

    Rows hold ``chosen_input_ids``/``chosen_labels``/``rejected_input_ids``/``rejected_labels`` with an identical
    prompt prefix (labels -100 on the prompt), plus ``length`` = the longer side (for length grouping). A batch
    of B pairs is ``input_ids``/``attention_mask``/``labels`` of shape (2B, T): rows 0..B-1 chosen, B..2B-1
    rejected, right-padded; float columns of the rows (``ref_chosen_logps`` ...) come along as (B,) tensors.
    The loss is averaged over pairs: ``count_items`` = B.
    """

    data_kind = "pairwise"
    item_unit = "pairs"

    def build_data(self, tokenizer, base_dir: str) -> StageData:
        from llmtune.data import PreferenceCollator, build_preference_data

        data = build_preference_data(self.recipe.data, tokenizer, base_dir=base_dir)
        train, evals = with_pair_length(data.train), with_pair_length(data.eval)
        return StageData(train, evals, data.report, PairCollator(PreferenceCollator(tokenizer)),
                         data.report.sources_lineage())

    def count_items(self, batch):
        return torch.tensor(batch["input_ids"].shape[0] // 2)

    def render_example(self, row: dict, tokenizer) -> str:
        from llmtune.data import render_pair

        return render_pair(row, tokenizer)

    @staticmethod
    def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Split a (2B, ...) tensor into its chosen and rejected halves, each (B, ...)."""
        n = x.shape[0] // 2
        return x[:n], x[n:]


PAIR_FLOATS = ("ref_chosen_logps", "ref_rejected_logps")  # per-pair values some stages store with the rows


class PairCollator:
    """A preference collator (``llmtune.data.PreferenceCollator``: ignores other row keys) plus the rows'
    per-pair floats (``ref_chosen_logps``, ``ref_rejected_logps``) as (B,) fp32 tensors."""

    def __init__(self, collator: Callable[[list[dict]], dict[str, torch.Tensor]]):
        self.collator = collator

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.collator(rows)
        for key in PAIR_FLOATS:
            if key in rows[0]:
                batch[key] = torch.tensor([float(r[key]) for r in rows], dtype=torch.float32)
        return batch


def with_pair_length(rows):
    """Add ``length`` = max(chosen, rejected) tokens to pair rows (a ``datasets.Dataset``) for length grouping."""
    if rows is None or not hasattr(rows, "add_column") or "length" in rows.column_names:
        return rows
    lengths = [max(len(c), len(r)) for c, r in zip(rows["chosen_input_ids"], rows["rejected_input_ids"])]
    return rows.add_column("length", lengths)


def prepare_tokenizer(recipe: Recipe, *, convert: bool = True):
    """Tokenizer of the recipe's model with the recipe's chat template applied (the data of every stage and
    ``llmtune validate`` are tokenized with it).

    Args:
        recipe: the recipe.
        convert: ``False`` (``llmtune validate``): a GGUF model is not converted, its tokenizer is read from the
            GGUF file (see :func:`llmtune.models.load.load_tokenizer`).

    Raises:
        ModelLoadError: the tokenizer cannot be found or loaded.
        RecipeError: a bad ``data.chat_template``.
    """
    from llmtune.data import apply_chat_template_config
    from llmtune.models.load import load_tokenizer

    tokenizer = load_tokenizer(recipe.model, convert=convert)
    if recipe.data.chat_template is not None:  # else the tokenizer's own (build_sft_data checks chat rows need one)
        apply_chat_template_config(recipe.data, tokenizer)
    return tokenizer
