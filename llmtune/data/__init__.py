"""Data layer: sources -> format adapters -> canonical rows -> tokenized rows with loss masks -> splits.

Shapes: B = rows (samples) in a batch, T = tokens per row; labels are -100 where not trained.

Pipeline of :func:`build_sft_data` (deterministic for a given recipe, ``data.seed`` and input files):

1. read each source (at most its ``max_samples`` rows) and convert/validate rows into canonical rows
   (bad rows raise under ``bad_rows: error`` or are counted under ``skip``);
2. mix: a source contributes ``weight`` x its valid rows (``0.5`` = a seeded random half, ``2`` = every
   row twice, ``1.5`` = every row once plus a random half), then all rows are shuffled with ``seed``;
3. tokenize in that order (lazily: with ``data.max_samples`` only until that many rows are kept);
4. hold out ``val_size`` distinct rows for eval (repeats of a held-out row never stay in train);
5. pack when ``packing: true``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmtune.config.schema import DataConfig
from llmtune.data.collators import SFTCollator
from llmtune.data.errors import DataError, RowError
from llmtune.data.formats import row_kind, to_canonical
from llmtune.data.packing import pack_rows
from llmtune.data.report import DataReport, SourceReport
from llmtune.data.sources import read_source
from llmtune.data.templates import BUILTIN_TEMPLATES, apply_chat_template_config
from llmtune.data.tokenize import IGNORE_INDEX, SFTTokenizer, Tokenized, render_labels, tokenize_rows

if TYPE_CHECKING:
    import datasets

__all__ = [
    "BUILTIN_TEMPLATES", "DataError", "DataReport", "IGNORE_INDEX", "SFTCollator", "SFTData",
    "apply_chat_template_config", "build_sft_data", "render_labels",
]

MAX_LISTED_BAD_ROWS = 10


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


def _raise_bad_rows(bad: list[tuple[str, int, RowError]]) -> None:
    lines = [f"  {path} row {row}: {err.reason}" for path, row, err in bad[:MAX_LISTED_BAD_ROWS]]
    if len(bad) > MAX_LISTED_BAD_ROWS:
        lines.append(f"  ... and {len(bad) - MAX_LISTED_BAD_ROWS} more")
    raise DataError(
        f"{len(bad)} bad row(s) (data.bad_rows: error); row = 0-based index in the file:\n" + "\n".join(lines) + "\n"
        "Fix these rows, map columns with data.datasets[i].columns, or set data.bad_rows: skip to drop them "
        "(they are counted with reasons in data_report.json)."
    )


def _mix(cfg: DataConfig, sizes: list[int]) -> list[tuple[int, int]]:
    """``(source, index)`` entries: ``weight`` x each source's rows, shuffled with ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    entries: list[tuple[int, int]] = []
    for s, (ds, n) in enumerate(zip(cfg.datasets, sizes)):
        copies = int(ds.weight)
        rest = round((ds.weight - copies) * n)
        entries += [(s, j) for _ in range(copies) for j in range(n)]
        entries += [(s, j) for j in sorted(rng.sample(range(n), rest))]
    rng.shuffle(entries)
    return entries


def _val_count(val_size: float, n: int) -> int:
    if val_size <= 0:
        return 0
    if val_size < 1:
        return max(1, round(val_size * n))
    if val_size != int(val_size):
        raise DataError(f"data.val_size: {val_size} is neither a fraction in (0, 1) nor a whole number of rows.")
    return int(val_size)


def _to_dataset(rows: list[dict]):
    import datasets

    columns = list(rows[0]) if rows else ["input_ids", "labels"]
    features = datasets.Features({c: datasets.Sequence(datasets.Value("int64")) for c in columns})
    return datasets.Dataset.from_dict({c: [r[c] for r in rows] for c in columns}, features=features)


def build_sft_data(cfg: DataConfig, tokenizer, *, base_dir: str | Path = ".") -> SFTData:
    """Read, validate, mix, tokenize, split and (optionally) pack the SFT data of a recipe.

    Sets ``tokenizer.chat_template`` from ``cfg.chat_template`` when there are chat rows (see
    :func:`apply_chat_template_config`).

    Args:
        cfg: the recipe's ``data`` section.
        tokenizer: a Hugging Face fast tokenizer.
        base_dir: directory that relative local paths are resolved against (usually the recipe's).

    Returns:
        :class:`SFTData` with train/eval ``datasets.Dataset`` and the :class:`DataReport`.

    Raises:
        DataError: a source cannot be read, a format cannot be detected, no valid rows in a source,
            bad rows under ``bad_rows: error`` (first 10 listed with file, row index and reason), no chat
            template, ``val_size`` too large, or no rows left at all.
    """
    report = DataReport(max_length=cfg.max_length, packing=cfg.packing, seed=cfg.seed)
    pools = _read_sources(cfg, base_dir, report)
    if any(row_kind(row) == "chat" for pool in pools for _, row in pool):
        apply_chat_template_config(cfg, tokenizer)
    fn = SFTTokenizer(tokenizer, cfg.max_length, cfg.truncation, cfg.train_on)
    accepted, results = _tokenize_mixed(cfg, pools, fn, report)

    # Validation split: the first n_val distinct rows of the shuffled order; their repeats leave train too.
    distinct = list(dict.fromkeys(accepted))
    n_val = _val_count(cfg.val_size, len(accepted))
    if n_val and n_val >= len(distinct):
        raise DataError(
            f"data.val_size={cfg.val_size} asks for {n_val} eval rows but only {len(distinct)} distinct rows are "
            "kept; lower val_size so that training rows remain."
        )
    held_out = set(distinct[:n_val])
    train_entries = [e for e in accepted if e not in held_out]
    eval_entries = distinct[:n_val]

    for s, src in enumerate(report.sources):
        src.train_rows = sum(1 for e in train_entries if e[0] == s)
        src.eval_rows = sum(1 for e in eval_entries if e[0] == s)
        src.rows_kept = len({e for e in distinct if e[0] == s})
    report.truncated_rows = [
        {"source": cfg.datasets[s].path, "row": pools[s][j][0]}
        for s, j in sorted(distinct)
        if results[(s, j)].truncated
    ]
    report.train_rows, report.eval_rows = len(train_entries), len(eval_entries)
    train = _sequences(cfg, [results[e] for e in train_entries])
    evals = _sequences(cfg, [results[e] for e in eval_entries])
    report.train_sequences, report.eval_sequences = len(train), len(evals)
    report.tokens, report.trained_tokens = _count_tokens(train)
    report.eval_tokens, report.eval_trained_tokens = _count_tokens(evals)
    return SFTData(train=_to_dataset(train), eval=_to_dataset(evals) if n_val else None, report=report)


def _read_sources(cfg: DataConfig, base_dir: str | Path, report: DataReport) -> list[list[tuple[int, dict]]]:
    """Canonical rows ``[(row_id, row)]`` per source; bad rows raise or are recorded in ``report``."""
    pools: list[list[tuple[int, dict]]] = []
    bad: list[tuple[str, int, RowError]] = []
    for i, ds in enumerate(cfg.datasets):
        raw = read_source(ds, i, base_dir)
        fmt, valid, source_bad = to_canonical(raw, ds)
        report.sources.append(SourceReport(
            path=ds.path, location=raw.location, format=fmt, rows_read=len(raw.rows) + len(raw.bad),
            rows_valid=len(valid), weight=ds.weight, stopped_early=raw.stopped_early,
            truncated_json=raw.truncated_json,
        ))
        pools.append(valid)
        bad += [(ds.path, row, err) for row, err in source_bad]
    _record_bad(cfg, report, bad)
    return pools


def _record_bad(cfg: DataConfig, report: DataReport, dropped: list[tuple[str, int, RowError]]) -> None:
    """Raise for malformed rows under ``bad_rows: error``; otherwise add every drop to the report."""
    bad = [item for item in dropped if item[2].bad]
    if bad and cfg.bad_rows == "error":
        _raise_bad_rows(bad)
    report.dropped += [{"source": p, "row": r, "kind": e.kind, "reason": e.reason} for p, r, e in dropped]


def _tokenize_mixed(cfg: DataConfig, pools, fn: SFTTokenizer, report: DataReport):
    """Mix, then tokenize in mixed order, only as far as ``data.max_samples`` needs.

    Returns:
        ``(accepted, results)``: the kept ``(source, index)`` entries in order (with repeats), and the
        tokenization result of every distinct entry tried.
    """
    entries = _mix(cfg, [len(p) for p in pools])
    target = cfg.max_samples or len(entries)
    results: dict[tuple[int, int], Tokenized | RowError] = {}
    accepted: list[tuple[int, int]] = []
    pos = 0
    while pos < len(entries) and len(accepted) < target:
        need = target - len(accepted)
        chunk = entries[pos : pos + (len(entries) if cfg.max_samples is None else max(64, need + need // 4))]
        todo = list(dict.fromkeys(e for e in chunk if e not in results))
        results.update(zip(todo, tokenize_rows([pools[s][j][1] for s, j in todo], fn, cfg.num_proc)))
        for entry in chunk:
            pos += 1
            if isinstance(results[entry], Tokenized):
                accepted.append(entry)
                if len(accepted) == target:
                    break
    failed = sorted((e, r) for e, r in results.items() if isinstance(r, RowError))
    _record_bad(cfg, report, [(cfg.datasets[s].path, pools[s][j][0], r) for (s, j), r in failed])
    if not accepted:
        counts = "; ".join(f"{k}: {n}" for k, n in report.drop_counts().items()) or "no rows"
        raise DataError(
            f"no training rows left after tokenization ({counts}). Raise data.max_length or check the chat template."
        )
    return accepted, results


def _sequences(cfg: DataConfig, rows: list[Tokenized]) -> list[dict[str, list[int]]]:
    pairs = [(r.input_ids, r.labels) for r in rows]
    return pack_rows(pairs, cfg.max_length) if cfg.packing else [{"input_ids": i, "labels": la} for i, la in pairs]


def _count_tokens(seqs: list[dict[str, list[int]]]) -> tuple[int, int]:
    """(all tokens, tokens with a label != -100)."""
    return sum(len(r["input_ids"]) for r in seqs), sum(sum(x != IGNORE_INDEX for x in r["labels"]) for r in seqs)
