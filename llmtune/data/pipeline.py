"""Steps shared by every data kind (SFT rows, preference pairs, prompts, KTO rows): read, mix, tokenize, split.

1. :func:`read_sources`: read each source batch by batch (at most its ``max_samples`` rows) and convert/validate
   rows into canonical rows of one kind, stored on disk (:class:`~llmtune.data.spill.RowPool`; bad rows raise under
   ``bad_rows: error`` or are counted under ``skip``);
2. :func:`mix`: a source contributes ``weight`` x its valid rows (``0.5`` = a seeded random half, ``2`` =
   every row twice, ``1.5`` = every row once plus a random half), then all rows are shuffled with ``seed``
   (an int array of global row numbers);
3. :func:`tokenize_and_split`: tokenize in that order, chunk by chunk (lazily: with ``data.max_samples`` only until
   that many rows are kept), each result stored on disk as it comes, then hold out ``val_size`` distinct rows for
   eval (repeats of a held-out row never stay in train), and fill the per-source counts and truncated rows of the
   report.

Memory: a chunk of rows plus ~20 bytes per row (row ids, offsets, the mixed order, result slots) and the dropped or
cut rows the report lists; the rows themselves are on disk (:mod:`llmtune.data.spill`), so a source larger than
memory builds. The result is the same whatever the chunk sizes (tested).

The row tokenizer is any picklable callable returning a result with a ``truncated`` flag or raising
:class:`~llmtune.data.errors.RowError`; the caller turns results into dataset rows (:func:`to_dataset`).
"""

from __future__ import annotations

import itertools
import random
from array import array
from collections.abc import Iterable, Iterator
from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmtune.config.schema import DataConfig
from llmtune.data.cache import ARROW_CHUNK_ROWS, write_dataset
from llmtune.data.errors import DataError, RowError
from llmtune.data import sources
from llmtune.data.formats import check_column_mapping, convert_rows, row_columns, schema_message, source_format
from llmtune.data.toolchat import is_tool_row
from llmtune.data.report import DataReport, SourceReport
from llmtune.data.spill import RowPool, SpillList, SpillView, current_spill_dir
from llmtune.data.tokenize import RowTokenizer

MAX_LISTED_BAD_ROWS = 10
ARROW_CHUNK_VALUES = 1 << 18  # list elements (token ids) per Arrow batch written
TOKENIZE_CHUNK_ROWS = 1024  # entries of the mixed order per step: their canonical rows are in memory at once


def _raise_bad_rows(bad: list[tuple[str, int, RowError]]) -> None:
    lines = [f"  {path} row {row}: {err.reason}" for path, row, err in bad[:MAX_LISTED_BAD_ROWS]]
    if len(bad) > MAX_LISTED_BAD_ROWS:
        lines.append(f"  ... and {len(bad) - MAX_LISTED_BAD_ROWS} more")
    raise DataError(
        f"{len(bad)} bad row(s) (data.bad_rows: error); row = 0-based index in the file:\n" + "\n".join(lines) + "\n"
        "Fix these rows, map columns with data.datasets.N.columns (N = the source's index), or set data.bad_rows: skip to drop them "
        "(they are counted with reasons in data_report.json)."
    )


def record_bad(cfg: DataConfig, report: DataReport, dropped: list[tuple[str, int, RowError]]) -> None:
    """Raise for malformed rows under ``bad_rows: error``; otherwise add every drop to the report."""
    bad = [item for item in dropped if item[2].bad]
    if bad and cfg.bad_rows == "error":
        _raise_bad_rows(bad)
    report.dropped += [{"source": p, "row": r, "kind": e.kind, "reason": e.reason} for p, r, e in dropped]


def read_sources(cfg: DataConfig, base_dir: str | Path, report: DataReport, kind: str = "sft",
                 keep_columns: bool = False) -> list[RowPool]:
    """Canonical rows per source, as :class:`~llmtune.data.spill.RowPool` s (``pool[j] = (row_id, row)``, the rows
    on disk), read batch by batch (:func:`~llmtune.data.sources.iter_source`); bad rows raise or are recorded in
    ``report``. Memory: a batch of rows, the row ids, and the bad rows.

    Args:
        kind: ``sft``, ``preference``, ``prompt`` or ``unpaired``: which formats the sources may have (see
            :func:`~llmtune.data.formats.to_canonical`, whose checks and messages this applies batch by batch).
        keep_columns: each canonical row also carries the row as read (every column), as ``columns``.

    Raises:
        DataError: as :func:`~llmtune.data.sources.read_source` and :func:`~llmtune.data.formats.to_canonical`;
            bad rows under ``bad_rows: error``.
    """
    pools: list[RowPool] = []
    bad: list[tuple[str, int, RowError]] = []
    store = SpillList(current_spill_dir(), "canonical")  # every source's rows, one after the other
    for i, ds in enumerate(cfg.datasets):
        pool, source_report, source_bad = _read_source(ds, i, base_dir, kind, store, keep_columns)
        report.sources.append(source_report)
        pools.append(pool)
        bad += [(ds.path, row, err) for row, err in source_bad]
    record_bad(cfg, report, bad)
    return pools


def _read_source(ds, index: int, base_dir, kind: str, store: SpillList, keep_columns: bool = False
                 ) -> tuple[RowPool, SourceReport, list[tuple[int, RowError]]]:
    key = f"data.datasets[{index}]"
    batches = _batches(ds, index, base_dir)
    pending: list = []  # batches up to the first one with an object row (the mapping is checked on it)
    first = check = None  # the first batch with a row (the format is detected from that row), with an object row
    for raw in batches:
        pending.append(raw)
        if first is None and raw.rows:
            first = raw
        if any(isinstance(row, dict) for row in raw.rows):
            check = raw
            break
    if check is not None and ds.columns:
        try:
            check_column_mapping(check, ds, key)  # holds for the whole source when it holds for its first rows
        except DataError:
            present = row_columns(check)
            for raw in batches:
                present |= row_columns(raw)
            check_column_mapping(check, ds, key, present)  # raises unless a later row has the column:
            batches = _batches(ds, index, base_dir)  # then read the source again, from its start
            pending = []
    head = first if first is not None else pending[-1]
    fmt, cols, adapter = source_format(head, ds, kind)
    pool = RowPool(store)
    bad: list[tuple[int, RowError]] = []
    rows_read = tool_rows = 0
    last = head
    for raw in itertools.chain(pending, batches):
        valid, batch_bad = convert_rows(raw, ds, cols, adapter)
        if keep_columns:
            read = dict(zip(raw.row_ids, raw.rows))
            valid = [(row_id, {**row, "columns": read[row_id]}) for row_id, row in valid]
        for row_id, row in valid:
            pool.append(row_id, row)
            tool_rows += is_tool_row(row)
        bad += batch_bad
        rows_read += len(raw.rows) + len(raw.bad)
        last = raw
    if not len(pool) and bad:
        raise DataError(schema_message(last, fmt, cols, bad, key))  # the last batch knows the columns found
    source_report = SourceReport(path=ds.path, location=head.location, format=fmt, rows_read=rows_read,
                                 rows_valid=len(pool), weight=ds.weight, stopped_early=last.stopped_early,
                                 truncated_json=last.truncated_json, tool_rows=tool_rows, skipped_rows=ds.skip_rows)
    return pool, source_report, bad


def _batches(ds, index: int, base_dir) -> Iterator:
    """The source's :class:`~llmtune.data.sources.RawSource` batches."""
    return iter(sources.iter_source(ds, index, base_dir))


def mix(cfg: DataConfig, sizes: list[int]) -> array:
    """The mixed order as global row numbers ``g`` (source ``s``'s row ``j`` is ``sum(sizes[:s]) + j``): ``weight``
    x each source's rows, shuffled with ``cfg.seed`` (an ``array('q')``, 8 bytes per entry; the same order as
    shuffling the ``(s, j)`` list with :class:`random.Random`).

    Raises:
        DataError: a fractional weight rounds a source to no row at all.
    """
    rng = random.Random(cfg.seed)
    entries = array("q")
    base = 0
    for s, (ds, n) in enumerate(zip(cfg.datasets, sizes)):
        copies = int(ds.weight)
        rest = round((ds.weight - copies) * n)
        if n and not copies and not rest:  # the source would silently contribute nothing
            raise DataError(
                f"data.datasets[{s}].weight: {ds.weight:g} x {n} valid rows of {ds.path} rounds to 0 rows, so this "
                f"source would not be trained on at all; raise the weight to at least {1 / n:.3g} (one row) or "
                "remove the source."
            )
        for _ in range(copies):
            entries.extend(range(base, base + n))
        entries.extend(base + j for j in sorted(rng.sample(range(n), rest)))
        base += n
    rng.shuffle(entries)
    return entries


def val_count(val_size: float, n: int) -> int:
    """Rows to hold out: ``val_size`` as a fraction of ``n`` (at least 1) or as a whole count."""
    if val_size <= 0:
        return 0
    if val_size < 1:
        return max(1, round(val_size * n))
    if val_size != int(val_size):
        raise DataError(f"data.val_size: {val_size} is neither a fraction in (0, 1) nor a whole number of rows.")
    return int(val_size)


class GlobalRows:
    """The rows of a build's sources numbered one after the other: source ``s``'s row ``j`` is
    ``g = offsets[s] + j`` (what :func:`mix` orders).

    Args:
        pools: the canonical rows of each source (:func:`read_sources`).
    """

    def __init__(self, pools: list[RowPool]):
        self.pools = pools
        self.offsets = np.cumsum([0, *map(len, pools)]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def source_of(self, g) -> np.ndarray:
        """The source index of each global row of ``g`` (array-like of ints)."""
        return np.searchsorted(np.asarray(self.offsets), g, side="right") - 1

    def row_id(self, g: int) -> tuple[int, int]:
        """``(source index, 0-based row index in the source's file)`` of global row ``g``."""
        s = bisect_right(self.offsets, g) - 1
        return s, self.pools[s].row_ids[g - self.offsets[s]]

    def canonical(self, gs: list[int]) -> list[dict]:
        """The canonical rows of global rows ``gs``, in that order (one read per run of a source's rows)."""
        by_source: dict[int, list[int]] = {}
        for k, s in enumerate(self.source_of(gs).tolist()):
            by_source.setdefault(s, []).append(k)
        out: list = [None] * len(gs)
        for s, ks in by_source.items():
            for k, row in zip(ks, self.pools[s].rows.take(gs[k] - self.offsets[s] for k in ks)):
                out[k] = row
        return out


@dataclass
class TokenizedRows:
    """What :func:`tokenize_mixed` produced.

    Attributes:
        accepted: the kept global row numbers in training order, with repeats (``array('q')``).
        slot: per global row, where its result is in ``results`` (-1: not tokenized, -2: failed).
        results: the results of every row tokenized without error (a :class:`SpillList`).
        truncated: global row -> the cut counts of each truncated result.
        rows: the global row numbering.
    """

    accepted: array
    slot: np.ndarray
    results: SpillList
    truncated: dict[int, dict[str, int]]
    rows: GlobalRows


def tokenize_mixed(cfg: DataConfig, pools: list[RowPool], fn, report: DataReport) -> TokenizedRows:
    """Mix, then tokenize in mixed order, only as far as ``data.max_samples`` needs; results go to disk as they come
    (chunks of at most ``TOKENIZE_CHUNK_ROWS`` rows, one pool of worker processes for all of them). With
    ``max_samples``, rows dropped after the row that reached it are not reported (nor raised under ``bad_rows:
    error``): they were tokenized ahead, not trained on or skipped.

    Raises:
        DataError: bad rows under ``bad_rows: error``, or no row left at all.
    """
    rows = GlobalRows(pools)
    entries = mix(cfg, [len(p) for p in pools])
    target = cfg.max_samples or len(entries)
    slot = np.full(len(rows), -1, dtype=np.int64)
    results = SpillList(current_spill_dir(), "tokenized")
    failed: list[tuple[int, RowError]] = []
    truncated: dict[int, dict[str, int]] = {}
    accepted = array("q")
    pos = 0
    distinct = int(np.count_nonzero(np.bincount(np.frombuffer(entries, dtype=np.int64), minlength=len(rows))))
    with RowTokenizer(fn, cfg.num_proc, distinct if cfg.max_samples is None else min(distinct, target)) as tok:
        while pos < len(entries) and len(accepted) < target:
            need = target - len(accepted)
            lazy = TOKENIZE_CHUNK_ROWS if cfg.max_samples is None else max(64, need + need // 4)
            chunk = entries[pos : pos + min(lazy, TOKENIZE_CHUNK_ROWS)]
            todo = [g for g in dict.fromkeys(chunk) if slot[g] == -1]
            for g, result in zip(todo, tok.map(rows.canonical(todo))):
                if isinstance(result, RowError):
                    slot[g] = -2
                    failed.append((g, result))
                else:
                    slot[g] = results.append(result)
                    if result.truncated:
                        truncated[g] = _cut_counts(result)
            for g in chunk:
                pos += 1
                if slot[g] >= 0:
                    accepted.append(g)
                    if len(accepted) == target:
                        break
    if pos < len(entries):  # stopped at max_samples: rows tokenized ahead of the stop were not reached, so their
        reached = np.zeros(len(rows), dtype=bool)  # failures are not the data's (and depend on the chunk sizes)
        reached[np.frombuffer(entries, dtype=np.int64)[:pos]] = True
        failed = [(g, r) for g, r in failed if reached[g]]
    failed.sort(key=lambda item: item[0])
    dropped = []
    for g, err in failed:
        s, row = rows.row_id(g)
        dropped.append((cfg.datasets[s].path, row, err))
    record_bad(cfg, report, dropped)
    if not accepted:
        counts = "; ".join(f"{k}: {n}" for k, n in report.drop_counts().items()) or "no rows"
        raise DataError(
            f"no training rows left after tokenization ({counts}). Raise data.max_length or check the chat template."
        )
    return TokenizedRows(accepted, slot, results, truncated, rows)


def tokenize_and_split(cfg: DataConfig, pools: list[RowPool], fn, report: DataReport) -> tuple[SpillView, SpillView]:
    """Tokenize the mixed rows and split them into train and eval results (report counts filled in).

    The eval rows are the first ``val_size`` distinct rows of the shuffled order; their repeats (from
    ``weight`` > 1) leave train too.

    Returns:
        ``(train, eval)``: tokenization results in training order, as read-only lists backed by the build's row
        files (:class:`SpillView`; valid until the build ends); ``eval`` is empty when ``val_size == 0``.

    Raises:
        DataError: see :func:`tokenize_mixed`; ``val_size`` leaves no training rows.
    """
    tok = tokenize_mixed(cfg, pools, fn, report)
    accepted = np.frombuffer(tok.accepted, dtype=np.int64)
    _, first = np.unique(accepted, return_index=True)
    distinct = accepted[np.sort(first)]  # in order of first appearance
    n_val = val_count(cfg.val_size, len(accepted))
    if n_val and n_val >= len(distinct):
        raise DataError(
            f"data.val_size={cfg.val_size} asks for {n_val} eval rows but only {len(distinct)} distinct rows are "
            "kept; lower val_size so that training rows remain."
        )
    eval_entries = distinct[:n_val]
    train_entries = accepted[~np.isin(accepted, eval_entries)] if n_val else accepted
    n_sources = len(report.sources)
    train_counts = np.bincount(tok.rows.source_of(train_entries), minlength=n_sources)
    eval_counts = np.bincount(tok.rows.source_of(eval_entries), minlength=n_sources)
    kept_counts = np.bincount(tok.rows.source_of(distinct), minlength=n_sources)
    for s, src in enumerate(report.sources):
        src.train_rows, src.eval_rows, src.rows_kept = int(train_counts[s]), int(eval_counts[s]), int(kept_counts[s])
    kept = np.zeros(len(tok.slot), dtype=bool)
    kept[distinct] = True
    report.truncated_rows = []
    for g in sorted(g for g in tok.truncated if kept[g]):
        s, row = tok.rows.row_id(g)
        report.truncated_rows.append({"source": cfg.datasets[s].path, "row": row, **tok.truncated[g]})
    report.train_rows, report.eval_rows = len(train_entries), len(eval_entries)
    return SpillView(tok.results, tok.slot[train_entries]), SpillView(tok.results, tok.slot[eval_entries])


def _cut_counts(result) -> dict[str, int]:
    """``{prompt_tokens_cut, response_tokens_cut}`` of a truncated result (the counts its kind has)."""
    return {k: getattr(result, k) for k in ("prompt_tokens_cut", "response_tokens_cut") if hasattr(result, k)}


def batched(rows: Iterable[dict], columns: list[str]) -> Iterator[dict[str, list]]:
    """Group row dicts into column batches (for :func:`write_dataset`) of at most ``ARROW_CHUNK_ROWS`` rows and about
    ``ARROW_CHUNK_VALUES`` list elements (token ids: a batch of long rows stays a few MB)."""
    size, max_values = ARROW_CHUNK_ROWS, ARROW_CHUNK_VALUES
    batch: dict[str, list] = {c: [] for c in columns}
    n = values = 0
    for row in rows:
        for c in columns:
            value = row[c]
            batch[c].append(value)
            if isinstance(value, list):
                values += len(value)
        n += 1
        if n == size or values >= max_values:
            yield batch
            batch, n, values = {c: [] for c in columns}, 0, 0
    if n:
        yield batch


def to_dataset(rows: Iterable[dict], columns: list[str], scalar: tuple[str, ...] = ()):
    """A memory-mapped ``datasets.Dataset`` of int64 columns: lists of ints, except the ``scalar`` ones (one int per
    row); ``rows`` (any iterable of row dicts, e.g. a generator over a :class:`SpillView`) are written chunk by chunk
    (:func:`~llmtune.data.cache.write_dataset`: in the cache entry being built, else in a temporary file).

    Raises:
        DataError: the Arrow file cannot be written (disk full).
    """
    import datasets

    features = datasets.Features(
        {c: datasets.Value("int64") if c in scalar else datasets.Sequence(datasets.Value("int64")) for c in columns}
    )
    return write_dataset(batched(rows, columns), features)


def reject_sft_options(cfg: DataConfig, rows: str, packing_reason: str, labels_reason: str) -> None:
    """Refuse SFT-only data options for pairs or prompts.

    Raises:
        DataError: ``data.packing`` is on (``packing_reason`` says why it cannot apply to ``rows``) or
            ``data.train_on`` is ``all`` (``labels_reason``); the message names the key and the value to set.
    """
    if cfg.packing:
        raise DataError(f"data.packing does not apply to {rows} ({packing_reason}); set data.packing: false.")
    if cfg.train_on != "assistant":
        raise DataError(f"data.train_on: all does not apply to {rows} ({labels_reason}); remove it or set "
                        "data.train_on: assistant.")
