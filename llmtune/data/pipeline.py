"""Steps shared by every data kind (SFT rows, preference pairs): read, mix, tokenize lazily, split.

1. :func:`read_sources`: read each source (at most its ``max_samples`` rows) and convert/validate rows into
   canonical rows of one kind (bad rows raise under ``bad_rows: error`` or are counted under ``skip``);
2. :func:`mix`: a source contributes ``weight`` x its valid rows (``0.5`` = a seeded random half, ``2`` =
   every row twice, ``1.5`` = every row once plus a random half), then all rows are shuffled with ``seed``;
3. :func:`tokenize_and_split`: tokenize in that order (lazily: with ``data.max_samples`` only until that
   many rows are kept), then hold out ``val_size`` distinct rows for eval (repeats of a held-out row never
   stay in train), and fill the per-source counts and truncated rows of the report.

The row tokenizer is any picklable callable returning a result with a ``truncated`` flag or raising
:class:`~llmtune.data.errors.RowError`; the caller turns results into dataset rows.
"""

from __future__ import annotations

import random
from pathlib import Path

from llmtune.config.schema import DataConfig
from llmtune.data.cache import write_dataset
from llmtune.data.errors import DataError, RowError
from llmtune.data.formats import to_canonical
from llmtune.data.report import DataReport, SourceReport
from llmtune.data.sources import read_source
from llmtune.data.tokenize import tokenize_rows

MAX_LISTED_BAD_ROWS = 10

Entry = tuple[int, int]  # (source index, index into that source's valid rows)


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


def read_sources(
    cfg: DataConfig, base_dir: str | Path, report: DataReport, kind: str = "sft"
) -> list[list[tuple[int, dict]]]:
    """Canonical rows ``[(row_id, row)]`` per source; bad rows raise or are recorded in ``report``.

    Args:
        kind: ``sft`` or ``preference``: which formats the sources may have (see :func:`to_canonical`).
    """
    pools: list[list[tuple[int, dict]]] = []
    bad: list[tuple[str, int, RowError]] = []
    for i, ds in enumerate(cfg.datasets):
        raw = read_source(ds, i, base_dir)
        fmt, valid, source_bad = to_canonical(raw, ds, kind)
        report.sources.append(SourceReport(
            path=ds.path, location=raw.location, format=fmt, rows_read=len(raw.rows) + len(raw.bad),
            rows_valid=len(valid), weight=ds.weight, stopped_early=raw.stopped_early,
            truncated_json=raw.truncated_json,
        ))
        pools.append(valid)
        bad += [(ds.path, row, err) for row, err in source_bad]
    record_bad(cfg, report, bad)
    return pools


def mix(cfg: DataConfig, sizes: list[int]) -> list[Entry]:
    """``(source, index)`` entries: ``weight`` x each source's rows, shuffled with ``cfg.seed``."""
    rng = random.Random(cfg.seed)
    entries: list[Entry] = []
    for s, (ds, n) in enumerate(zip(cfg.datasets, sizes)):
        copies = int(ds.weight)
        rest = round((ds.weight - copies) * n)
        if n and not copies and not rest:  # the source would silently contribute nothing
            raise DataError(
                f"data.datasets[{s}].weight: {ds.weight:g} x {n} valid rows of {ds.path} rounds to 0 rows, so this "
                f"source would not be trained on at all; raise the weight to at least {1 / n:.3g} (one row) or "
                "remove the source."
            )
        entries += [(s, j) for _ in range(copies) for j in range(n)]
        entries += [(s, j) for j in sorted(rng.sample(range(n), rest))]
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


def tokenize_mixed(cfg: DataConfig, pools, fn, report: DataReport) -> tuple[list[Entry], dict]:
    """Mix, then tokenize in mixed order, only as far as ``data.max_samples`` needs.

    Returns:
        ``(accepted, results)``: the kept ``(source, index)`` entries in order (with repeats), and the
        tokenization result (or :class:`RowError`) of every distinct entry tried.

    Raises:
        DataError: bad rows under ``bad_rows: error``, or no row left at all.
    """
    entries = mix(cfg, [len(p) for p in pools])
    target = cfg.max_samples or len(entries)
    results: dict = {}
    accepted: list[Entry] = []
    pos = 0
    while pos < len(entries) and len(accepted) < target:
        need = target - len(accepted)
        chunk = entries[pos : pos + (len(entries) if cfg.max_samples is None else max(64, need + need // 4))]
        todo = list(dict.fromkeys(e for e in chunk if e not in results))
        results.update(zip(todo, tokenize_rows([pools[s][j][1] for s, j in todo], fn, cfg.num_proc)))
        for entry in chunk:
            pos += 1
            if not isinstance(results[entry], RowError):
                accepted.append(entry)
                if len(accepted) == target:
                    break
    failed = sorted((e, r) for e, r in results.items() if isinstance(r, RowError))
    record_bad(cfg, report, [(cfg.datasets[s].path, pools[s][j][0], r) for (s, j), r in failed])
    if not accepted:
        counts = "; ".join(f"{k}: {n}" for k, n in report.drop_counts().items()) or "no rows"
        raise DataError(
            f"no training rows left after tokenization ({counts}). Raise data.max_length or check the chat template."
        )
    return accepted, results


def tokenize_and_split(cfg: DataConfig, pools, fn, report: DataReport) -> tuple[list, list]:
    """Tokenize the mixed rows and split them into train and eval results (report counts filled in).

    The eval rows are the first ``val_size`` distinct rows of the shuffled order; their repeats (from
    ``weight`` > 1) leave train too.

    Returns:
        ``(train, eval)``: tokenization results in training order; ``eval`` is empty when ``val_size == 0``.

    Raises:
        DataError: see :func:`tokenize_mixed`; ``val_size`` leaves no training rows.
    """
    accepted, results = tokenize_mixed(cfg, pools, fn, report)
    distinct = list(dict.fromkeys(accepted))
    n_val = val_count(cfg.val_size, len(accepted))
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
        {"source": cfg.datasets[s].path, "row": pools[s][j][0], **_cut_counts(results[(s, j)])}
        for s, j in sorted(distinct)
        if results[(s, j)].truncated
    ]
    report.train_rows, report.eval_rows = len(train_entries), len(eval_entries)
    return [results[e] for e in train_entries], [results[e] for e in eval_entries]


def _cut_counts(result) -> dict[str, int]:
    """``{prompt_tokens_cut, response_tokens_cut}`` of a truncated result (the counts its kind has)."""
    return {k: getattr(result, k) for k in ("prompt_tokens_cut", "response_tokens_cut") if hasattr(result, k)}


def to_dataset(rows: list[dict], columns: list[str], scalar: tuple[str, ...] = ()):
    """A memory-mapped ``datasets.Dataset`` of int64 columns: lists of ints, except the ``scalar`` ones (one int per
    row); written chunk by chunk (:func:`~llmtune.data.cache.write_dataset`: in the cache entry being built, else in a
    temporary file).

    Raises:
        DataError: the Arrow file cannot be written (disk full).
    """
    import datasets

    features = datasets.Features(
        {c: datasets.Value("int64") if c in scalar else datasets.Sequence(datasets.Value("int64")) for c in columns}
    )
    return write_dataset({c: (lambda a, b, c=c: [r[c] for r in rows[a:b]]) for c in columns}, len(rows), features)


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
