"""Where a data build writes its files (Arrow splits, spill files): the cache entry being built, else this process's
temporary data directory. Shared by :mod:`llmtune.data.cache` (which sets the entry being built) and
:mod:`llmtune.data.spill` (which puts its row files there), below both.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

TEMP_PREFIX = "llmtune-data-"  # + <host>-<pid>-<random>: this process's temporary data directory (cache off)
STALE_STAGING_S = 6 * 3600  # a staging directory older than this belongs to a build that died

_output_dir: contextvars.ContextVar[Path | None] = contextvars.ContextVar("llmtune_data_output_dir", default=None)
_temp_root: Path | None = None


@contextlib.contextmanager
def building_into(entry: Path) -> Iterator[Path]:
    """Within the block, :func:`data_dir` (without ``scratch``) is ``entry``: the staging directory of the cache entry
    being built in this context."""
    token = _output_dir.set(entry)
    try:
        yield entry
    finally:
        _output_dir.reset(token)


def data_dir(*, scratch: bool = False) -> Path:
    """Where a build writes its files: the cache entry being built, or (no entry being built, or ``scratch``: an
    intermediate file) this process's temporary directory ``$TMPDIR/llmtune-data-<host>-<pid>-*``, removed at exit
    (and by a later process when this one was killed)."""
    global _temp_root
    root = None if scratch else _output_dir.get()
    if root is None:
        if _temp_root is None:
            _remove_dead_temp_dirs()
            _temp_root = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{socket.gethostname()}-{os.getpid()}-"))
            atexit.register(shutil.rmtree, _temp_root, True)
        root = _temp_root
    return root


def _remove_dead_temp_dirs() -> None:
    """Remove the temporary data directories (``$TMPDIR/llmtune-data-<host>-<pid>-*``: datasets and row files of
    builds with the cache off) of processes on this host that are gone, e.g. after a ``kill -9``."""
    now = time.time()
    with contextlib.suppress(OSError):
        for path in Path(tempfile.gettempdir()).glob(f"{TEMP_PREFIX}*"):
            if path.is_dir() and owner_dead(path.name[len(TEMP_PREFIX):], path, now, stale_s=None):
                shutil.rmtree(path, ignore_errors=True)


def owner_dead(rest: str, path: Path, now: float, stale_s: float | None = STALE_STAGING_S) -> bool:
    """For a directory named ``...<host>-<pid>-<random, no dash>`` (``rest``): its process, on this host, is gone;
    or (``stale_s``) it is older than that (another host's)."""
    host, _, pid = rest.rpartition("-")[0].rpartition("-")
    if host == socket.gethostname() and pid.isdigit():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:  # exists, owned by someone else
            pass
    return stale_s is not None and now - path.stat().st_mtime > stale_s
