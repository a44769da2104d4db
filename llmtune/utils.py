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


def is_main_process() -> bool:
    """True on global rank 0 (or when not distributed), from the launcher's environment."""
    return int(os.environ.get("RANK", "0")) == 0


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """SHA-256 hex digest of a file's bytes (streamed)."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(chunk_bytes), b""):
            digest.update(chunk)
    return digest.hexdigest()


def append_jsonl(path: str | Path, record: dict[str, Any]) -> None:
    """Append one JSON object as a line (non-finite floats written as null)."""
    with open(path, "a") as fh:
        fh.write(json.dumps(_finite(record)) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON-lines file written by :func:`append_jsonl`."""
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


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
