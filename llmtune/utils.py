"""Small helpers shared by every layer: logging, hashing, JSON lines, rank checks.

Lowest layer of the package: imports nothing from llmtune.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

LOGGER_NAME = "llmtune"


def get_logger(name: str = LOGGER_NAME) -> logging.Logger:
    """The package logger (rich handler on rank 0 once :func:`setup_logging` ran)."""
    return logging.getLogger(name if name.startswith(LOGGER_NAME) else f"{LOGGER_NAME}.{name}")


FILE_WIDTH = 200  # columns of rich output that goes to a file or pipe (rich would cut it at 80)


def make_console(stderr: bool = True, **kwargs):
    """A rich ``Console`` for llmtune's tables and logs: the terminal's width on a terminal, ``FILE_WIDTH`` columns
    when the output is redirected (a log file must not cut table cells)."""
    import sys

    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    width = None if getattr(stream, "isatty", lambda: False)() else FILE_WIDTH
    return Console(stderr=stderr, width=width, **kwargs)


def setup_logging(level: int = logging.INFO) -> None:
    """Send llmtune logs to stderr through rich; quiet on ranks other than 0."""
    from rich.logging import RichHandler

    root = logging.getLogger(LOGGER_NAME)
    if root.handlers:
        return
    handler = RichHandler(console=make_console(stderr=True), show_path=False, rich_tracebacks=False, markup=False)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(level if is_main_process() else logging.WARNING)
    root.propagate = False


def project_root() -> Path | None:
    """The llmtune checkout this package runs from (the folder holding ``pyproject.toml`` and ``scripts/setup.sh``
    above the package), found by walking up from the package folder, or ``None`` for an installed wheel.

    Paths that ``scripts/setup.sh`` creates (``.venv``, ``.venv-vllm``) are found from here, never from a module's
    depth inside the package (which changes when modules move).
    """
    for folder in Path(__file__).resolve().parents:
        if (folder / "pyproject.toml").is_file() and (folder / "scripts" / "setup.sh").is_file():
            return folder
        if folder.name == "site-packages":
            return None
    return None


MMAP_THRESHOLD_BYTES = 128 * 1024  # glibc's own starting value, kept fixed (docs/performance.md: resident memory)


def limit_heap_retention() -> bool:
    """Stop glibc from keeping what torch frees on the CPU: fix malloc's mmap and trim thresholds at 128 KiB.

    glibc starts with a 128 KiB mmap threshold but raises it (up to 32 MiB) each time a large block is freed, after
    which activations come from its heap and freed memory stays resident: PPO's quickstart step peaked at 5.4-6.2 GiB
    for a 3.65 GiB estimate. With the thresholds fixed every large tensor is its own mapping, returned to the system
    when freed (3.5-3.7 GiB; ~3 % more wall time). Same as ``MALLOC_MMAP_THRESHOLD_=131072
    MALLOC_TRIM_THRESHOLD_=131072`` set before the process starts; a user's own setting of either (or of
    ``glibc.malloc`` in ``GLIBC_TUNABLES``) is left alone, and ``LLMTUNE_GLIBC_HEAP=default`` keeps glibc's default.

    Returns:
        Whether the thresholds were set (False off glibc, or when the environment already decides).
    """
    import ctypes
    import sys

    if sys.platform != "linux" or os.environ.get("LLMTUNE_GLIBC_HEAP") == "default" \
            or "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ \
            or "malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, ...)
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD_BYTES)) and bool(mallopt(m_trim_threshold,
                                                                                  MMAP_THRESHOLD_BYTES))


def is_main_process() -> bool:
    """True on global rank 0 (or when not distributed), from the launcher's environment."""
    return int(os.environ.get("RANK", "0")) == 0


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 hex digest of a file's bytes (streamed)."""
    digest = hashlib.sha256()
    _feed_file(digest, path, chunk_bytes)
    return digest.hexdigest()


def _feed_file(digest, path: str | Path, chunk_bytes: int = 1 << 20) -> None:
    with open(path, "rb") as fh:
        while chunk := fh.read(chunk_bytes):
            digest.update(chunk)


_CONTENT_HASHES: dict[tuple, str] = {}


def content_sha256(path: str | Path) -> str | None:
    """SHA-256 hex digest of a data source's content: the bytes of a file, or, for a directory, of all its files in
    sorted order with each file's name relative to the directory folded in before its bytes (so a renamed or moved
    file changes the digest). The identity of a source for the data cache key and ``lineage.json``.

    Memoised in this process per (resolved path, file or directory, every file's name, size in bytes and mtime):
    the cache key and the lineage hash the same source once; a changed file is hashed again.

    Args:
        path: a file or a directory.

    Returns:
        The hex digest, or None when ``path`` does not exist or is a directory without files.
    """
    path = Path(path)
    is_dir = path.is_dir()
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()) if is_dir else []
    if not files:
        return None
    key = (str(path.resolve()), is_dir, tuple((str(f), (st := f.stat()).st_size, st.st_mtime_ns) for f in files))
    if key not in _CONTENT_HASHES:
        digest = hashlib.sha256()
        for file in files:
            if is_dir:
                digest.update(str(file.relative_to(path)).encode() + b"\0")
            _feed_file(digest, file)
        _CONTENT_HASHES[key] = digest.hexdigest()
    return _CONTENT_HASHES[key]


class AwaitTimeout(Exception):
    """:func:`awaited` gave up on an awaitable after its timeout (and cancelled it)."""


def awaited(value: Any, timeout_s: float | None = None) -> Any:
    """``value`` itself, or, when it is awaitable (what user code written as ``async def`` returns), what it resolves
    to: run to completion on a new event loop in the calling thread (which must not be running one).

    Args:
        timeout_s: cancel it after this many seconds and raise :class:`AwaitTimeout` (None: no limit). A coroutine
            that ignores its cancellation is waited for until it returns.
    """
    import inspect

    if not inspect.isawaitable(value):
        return value
    import asyncio
    import contextlib

    async def run() -> Any:
        task = asyncio.ensure_future(value)
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
            raise AwaitTimeout(f"not done within {timeout_s:g} s")
        return task.result()

    return asyncio.run(run())


def dotted_get(doc: dict, dotted: str, default: Any = None) -> Any:
    """``doc["a"]["b"]`` for ``dotted = "a.b"`` in a raw (unvalidated) nested mapping; ``default`` where a key is
    missing or a level is not a mapping. Never raises."""
    node: Any = doc
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON object as a line (non-finite floats written as null). A torn last line (a write cut by a
    crash or a full disk) is ended first, so that the new record stays a line of its own."""
    with open(path, "a+b") as fh:
        torn = False
        if fh.tell() > 0:
            fh.seek(-1, os.SEEK_END)
            torn = fh.read(1) != b"\n"
        fh.write((("\n" if torn else "") + json.dumps(_finite(record)) + "\n").encode())


def read_jsonl(path: str | Path, skip_bad_lines: bool = False) -> list[dict[str, Any]]:
    """Read a JSON-lines file written by :func:`append_jsonl`.

    Args:
        path: the file.
        skip_bad_lines: skip lines that are not JSON (a line torn by a crash or a full disk) with a warning naming
            them, instead of raising.

    Raises:
        json.JSONDecodeError: a line is not JSON and ``skip_bad_lines`` is off.
    """
    records, bad = [], []
    with open(path, errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:
                if not skip_bad_lines:
                    raise
                bad.append(number)
    if bad:
        get_logger("utils").warning("%s: skipped %d line(s) that are not complete JSON (line %s; torn by a crash or "
                                    "a full disk)", path, len(bad), ", ".join(map(str, bad[:5])))
    return records


def write_json(path: str | Path, obj: Any) -> None:
    """Write pretty JSON atomically (temp file + rename)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_finite(obj), indent=2, default=str) + "\n")
    tmp.replace(path)


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and (obj != obj or obj in (float("inf"), float("-inf"))):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
