"""Data layer: sources -> format adapters -> canonical rows -> tokenized rows with loss masks -> splits.

Shapes: B = rows (samples, or preference pairs) in a batch, T = tokens per row; labels are -100 where not
trained; (2B, T) = chosen sequences stacked over rejected ones.

Pipeline of :func:`build_sft_data`, :func:`build_preference_data` and :func:`build_prompt_data` (deterministic
for a given recipe, ``data.seed`` and input files; the shared steps live in :mod:`llmtune.data.pipeline`):

1. read each source batch by batch (at most its ``max_samples`` rows) and convert/validate rows into canonical
   rows, kept on disk (bad rows raise under ``bad_rows: error`` or are counted under ``skip``);
2. mix: a source contributes ``weight`` x its valid rows (``0.5`` = a seeded random half, ``2`` = every
   row twice, ``1.5`` = every row once plus a random half), then all rows are shuffled with ``seed``;
3. tokenize in that order, chunk by chunk, results to disk (lazily: with ``data.max_samples`` only until that
   many rows are kept);
4. hold out ``val_size`` distinct rows for eval (repeats of a held-out row never stay in train);
5. SFT only: pack when ``packing: true``;
6. write the splits to memory-mapped Arrow files as they are produced (:mod:`llmtune.data.pipeline`: memory
   does not grow with the data).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmtune.config.schema import DataConfig
from llmtune.data.cache import cached_build
from llmtune.data.collators import PreferenceCollator, SFTCollator
from llmtune.data.errors import DataError
from llmtune.data.formats import row_kind
from llmtune.data.packing import pack_plan, pack_sequence
from llmtune.data.pipeline import read_sources, to_dataset, tokenize_and_split
from llmtune.data.preference import PreferenceData, build_preference_data, render_pair
from llmtune.data.prompts import PromptCollator, PromptData, build_prompt_data, prompt_ids
from llmtune.data.report import DataReport
from llmtune.data.spill import SpillView
from llmtune.data.templates import BUILTIN_TEMPLATES, apply_chat_template_config, check_tool_rendering
from llmtune.data.tokenize import IGNORE_INDEX, SFTTokenizer, Tokenized, render_labels

if TYPE_CHECKING:
    import datasets

__all__ = [
    "BUILTIN_TEMPLATES", "DataError", "DataReport", "IGNORE_INDEX", "PreferenceCollator", "PreferenceData",
    "PromptCollator", "PromptData", "SFTCollator", "SFTData", "apply_chat_template_config", "build_preference_data",
    "build_prompt_data", "build_sft_data", "prompt_ids", "render_labels", "render_pair",
]

PACK_READ_TOKENS = 1 << 18  # tokens of packed sequences whose rows are read from the build's row files at once


@dataclass
class SFTData:
    """Tokenized SFT data.

    Attributes:
        train: ``datasets.Dataset`` with ``input_ids`` and ``labels`` (lists of ints, equal length per row,
            labels -100 = not trained), plus ``position_ids`` when packing.
        eval: the same for the held-out rows, or None when ``val_size == 0``.
        report: what was read, kept, dropped and truncated.
    """

    train: datasets.Dataset
    eval: datasets.Dataset | None
    report: DataReport


def build_sft_data(cfg: DataConfig, tokenizer, *, base_dir: str | Path = ".") -> SFTData:
    """Read, validate, mix, tokenize, split and (optionally) pack the SFT data of a recipe.

    Sets ``tokenizer.chat_template`` from ``cfg.chat_template`` when there are chat rows (see
    :func:`apply_chat_template_config`). Tool conversations (tool calls, tool results, a ``tools`` column) need a
    template that renders them (:func:`~llmtune.data.templates.check_tool_rendering`, checked once before tokenizing).

    Args:
        cfg: the recipe's ``data`` section.
        tokenizer: a Hugging Face fast tokenizer.
        base_dir: directory that relative local paths are resolved against (usually the recipe's).

    Returns:
        :class:`SFTData` with train/eval ``datasets.Dataset`` and the :class:`DataReport`.

    Raises:
        DataError: a source cannot be read, a format cannot be detected, no valid rows in a source,
            bad rows under ``bad_rows: error`` (first 10 listed with file, row index and reason), no chat
            template, a template that cannot render the data's tool conversations, ``max_prompt_length >=
            max_length``, ``val_size`` too large, or no rows left at all.
    """
    return cached_build("sft", cfg, tokenizer, base_dir, lambda: _build_sft_data(cfg, tokenizer, base_dir=base_dir))


def _build_sft_data(cfg: DataConfig, tokenizer, *, base_dir: str | Path = ".") -> SFTData:
    report = DataReport(max_length=cfg.max_length, packing=cfg.packing, seed=cfg.seed)
    pools = read_sources(cfg, base_dir, report)
    if any(row_kind(row) == "chat" for pool in pools for row in pool.rows):
        apply_chat_template_config(cfg, tokenizer)
    tool_sources = [f"{s.tool_rows} rows of data.datasets[{i}] ({s.path})" for i, s in enumerate(report.sources)
                    if s.tool_rows]
    if tool_sources:  # one configuration error, not a bad row per conversation
        where = "data.chat_template" if cfg.chat_template else "the tokenizer's chat template (data.chat_template: null)"
        check_tool_rendering(tokenizer, where, " and ".join(tool_sources))
    fn = SFTTokenizer(tokenizer, cfg.max_length, cfg.truncation, cfg.train_on, cfg.max_prompt_length,
                      cfg.truncation_mode, cfg.truncation_keep_system)
    train_rows, eval_rows = tokenize_and_split(cfg, pools, fn, report)
    train, report.train_sequences, report.tokens, report.trained_tokens = _write_sequences(cfg, train_rows)
    evals = None
    if len(eval_rows):
        evals, report.eval_sequences, report.eval_tokens, report.eval_trained_tokens = _write_sequences(cfg, eval_rows)
    return SFTData(train=train, eval=evals, report=report)


def _write_sequences(cfg: DataConfig, rows: SpillView) -> tuple[datasets.Dataset, int, int, int]:
    """The training sequences of ``rows`` (packed when ``data.packing``) as a dataset, streamed from the build's row
    files; returns ``(dataset, sequences, tokens, trained tokens)`` (trained = label != -100)."""
    counts = [0, 0, 0]

    def sequences() -> Iterator[dict[str, list[int]]]:
        if cfg.packing:
            plan = pack_plan([len(r.input_ids) for r in rows], cfg.max_length)
            bins = max(1, PACK_READ_TOKENS // cfg.max_length)
            for a in range(0, len(plan), bins):  # read the members of a group of bins at once
                group = plan[a : a + bins]
                members = iter(rows.take(np.concatenate(group).tolist()))
                for bin_ in group:
                    yield pack_sequence((r.input_ids, r.labels) for r in islice(members, len(bin_)))
        else:
            for r in rows:
                yield {"input_ids": r.input_ids, "labels": r.labels}

    def counted() -> Iterator[dict[str, list[int]]]:
        for seq in sequences():
            counts[0] += 1
            counts[1] += len(seq["input_ids"])
            counts[2] += sum(x != IGNORE_INDEX for x in seq["labels"])
            yield seq

    columns = ["input_ids", "labels", "position_ids"] if cfg.packing else ["input_ids", "labels"]
    dataset = to_dataset(counted(), columns)
    return dataset, counts[0], counts[1], counts[2]
