"""Disk-backed row stores: what lets a data build hold more rows than fit in memory.

A build keeps its canonical rows (one :class:`RowPool` per source) and its tokenization results (one
:class:`SpillList`) in files of pickled records, with only 8-byte offsets (and, for pools, the rows' 0-based file
indices) in memory. Mixing, the train/eval split and packing then work on integer index arrays, and the final
datasets are written from :class:`SpillView` s chunk by chunk. So a build's peak memory is the index arrays
(~16-24 bytes per row) plus a chunk of rows, not the data: see ``scripts/bench_data.py --synthetic-copies``.

The files live in a directory of :func:`spill_dir` (inside the cache entry being built, so a killed build's files
are removed with its staging directory; else in this process's temporary directory) and are deleted when the build
ends. Records are pickles written and read by this process only (never shared, never from the cache).
"""

from __future__ import annotations

import contextlib
import contextvars
import errno
import os
import pickle
import shutil
import tempfile
from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from llmtune.data.errors import DataError
from llmtune.data.workdir import data_dir

READ_CHUNK_ROWS = 1024  # at most this many records decoded per read ...
READ_CHUNK_BYTES = 1 << 18  # ... and about this many bytes of pickles (token ids unpickle to ~12x their bytes)

_current: contextvars.ContextVar[tuple[Path, list] | None] = contextvars.ContextVar("llmtune_spill", default=None)


class SpillList(Sequence):
    """An append-only list of picklable objects stored in one file; ``len``, indexing, slicing and iteration as a
    list (reads see every append before them).

    Args:
        directory: where the file is created (see :func:`spill_dir`).
        name: file name prefix.

    Raises:
        DataError: the file cannot be created or written (disk full): the message names the directory.
    """

    def __init__(self, directory: str | Path, name: str = "rows"):
        self.directory = Path(directory)
        try:
            fd, path = tempfile.mkstemp(prefix=f"{name}-", suffix=".pkl", dir=self.directory)
        except OSError as exc:
            raise _disk_error(self.directory, exc) from None
        self.path = Path(path)
        self._file = os.fdopen(fd, "w+b", buffering=1 << 20)
        self._offsets = array("q", [0])  # record k = bytes [offsets[k], offsets[k + 1])
        self._dirty = False
        current = _current.get()
        if current is not None and current[0] == self.directory:
            current[1].append(self)  # closed when the build ends

    def append(self, obj: Any) -> int:
        """Store ``obj``; returns its index."""
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self._file.write(data)
        except OSError as exc:
            raise _disk_error(self.directory, exc) from None
        self._offsets.append(self._offsets[-1] + len(data))
        self._dirty = True
        return len(self._offsets) - 2

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def chunk_rows(self) -> int:
        """Records per read: ``READ_CHUNK_BYTES`` of the average record, between 1 and ``READ_CHUNK_ROWS``."""
        n = len(self)
        average = self._offsets[-1] / n if n else 1
        return max(1, min(READ_CHUNK_ROWS, int(READ_CHUNK_BYTES / max(average, 1))))

    def _read(self, start: int, stop: int) -> bytes:
        if self._dirty:
            try:
                self._file.flush()
            except OSError as exc:
                raise _disk_error(self.directory, exc) from None
            self._dirty = False
        return os.pread(self._file.fileno(), self._offsets[stop] - self._offsets[start], self._offsets[start])

    def _run(self, start: int, stop: int) -> list:
        """Records ``[start, stop)`` with one read."""
        data = self._read(start, stop)
        base = self._offsets[start]
        return [pickle.loads(data[self._offsets[k] - base : self._offsets[k + 1] - base]) for k in range(start, stop)]

    def __getitem__(self, k):
        if isinstance(k, slice):
            return self.take(range(*k.indices(len(self))))
        n = len(self)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"SpillList index {k} out of range ({n} records)")
        return pickle.loads(self._read(k, k + 1))

    def take(self, indices: Iterable[int]) -> list:
        """The records at ``indices`` (any order, repeats allowed), consecutive runs read at once."""
        indices = list(indices)
        out: list = [None] * len(indices)
        order = sorted(range(len(indices)), key=indices.__getitem__)
        size = self.chunk_rows()
        p = 0
        while p < len(order):
            q = p + 1
            while q < len(order) and indices[order[q]] - indices[order[q - 1]] <= 1 and q - p < size:
                q += 1
            first, last = indices[order[p]], indices[order[q - 1]]
            run = self._run(first, last + 1)
            for r in order[p:q]:
                out[r] = run[indices[r] - first]
            p = q
        return out

    def __iter__(self) -> Iterator[Any]:
        return iter(SpillView(self, range(len(self))))

    def close(self) -> None:
        """Close and delete the file (idempotent)."""
        with contextlib.suppress(OSError):
            self._file.close()
        with contextlib.suppress(OSError):
            self.path.unlink()


class SpillView(Sequence):
    """The records of a :class:`SpillList` at ``indices`` (e.g. the training rows in training order, with
    repeats), as a read-only list; slices and iteration read in chunks.

    Args:
        store: the records.
        indices: record indices, any order; an ``array('q')``, numpy array or list of ints.
    """

    def __init__(self, store: SpillList, indices):
        self.store = store
        self.indices = indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return self.store.take(int(i) for i in self.indices[k])
        return self.store[int(self.indices[k])]

    def __iter__(self) -> Iterator[Any]:
        size = self.store.chunk_rows()
        for a in range(0, len(self), size):
            yield from self[a : a + size]

    def take(self, ks: Iterable[int]) -> list:
        """The records at view positions ``ks``."""
        return self.store.take(int(self.indices[k]) for k in ks)



class RowPool(Sequence):
    """The canonical rows of one source: ``pool[j] = (row_id, row)`` as the in-memory pools were, with the rows in
    a shared :class:`SpillList` (the sources of a build, one after the other: one open file however many sources)
    and the 0-based file indices ``row_ids`` in memory (8 bytes per row).

    Args:
        store: the build's canonical-row file; this pool's rows are the ones appended from now on, until the next
            pool's (a pool is filled before the next one starts).
    """

    def __init__(self, store: SpillList):
        self.store = store
        self.start = len(store)
        self.row_ids = array("q")

    def append(self, row_id: int, row: dict) -> None:
        if len(self.store) != self.start + len(self.row_ids):
            raise RuntimeError("RowPool.append after another pool of the same store was started")
        self.store.append(row)
        self.row_ids.append(row_id)

    @property
    def rows(self) -> SpillView:
        """The canonical rows (without row ids), as a read-only list."""
        return SpillView(self.store, range(self.start, self.start + len(self.row_ids)))

    def __len__(self) -> int:
        return len(self.row_ids)

    def __getitem__(self, j):
        if isinstance(j, slice):
            return list(zip(self.row_ids[j], self.rows[j]))
        return self.row_ids[j], self.rows[j]

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        return zip(self.row_ids, self.rows)


def current_spill_dir() -> Path:
    """The spill directory of the build running in this context (:func:`spilling`), else a directory under this
    process's temporary data directory (removed at exit)."""
    current = _current.get()
    if current is not None:
        return current[0]
    path = data_dir(scratch=True) / ".spill-unscoped"
    path.mkdir(exist_ok=True)
    return path


@contextlib.contextmanager
def spilling() -> Iterator[Path]:
    """Run a data build with its own :func:`spill_dir`: the build's :class:`SpillList` s are closed and their files
    deleted when the block ends (so views of them must be written out before)."""
    with spill_dir() as path:
        opened: list[SpillList] = []
        token = _current.set((path, opened))
        try:
            yield path
        finally:
            _current.reset(token)
            for store in opened:
                store.close()


@contextlib.contextmanager
def spill_dir() -> Iterator[Path]:
    """A directory for the spill files of one build, removed (with everything in it) when the block ends.

    Inside the cache entry being built when there is one (a killed build's files go with its staging directory),
    else under this process's temporary data directory.
    """
    parent = data_dir()
    try:
        path = Path(tempfile.mkdtemp(prefix=".spill-", dir=parent))
    except OSError as exc:
        raise _disk_error(parent, exc) from None
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _disk_error(directory: Path, exc: OSError) -> DataError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        fix = ("Free disk space there, or point data.cache_dir (or $LLMTUNE_DATA_CACHE / $TMPDIR) at a disk with room "
               "(a build needs about the size of its sources plus the tokenized data on disk while it runs).")
    elif exc.errno in (errno.EMFILE, errno.ENFILE):
        fix = "Raise the open-file limit (`ulimit -n`), or merge small source files."
    else:
        fix = "Point data.cache_dir (or $LLMTUNE_DATA_CACHE / $TMPDIR) at a writable directory."
    return DataError(f"cannot write the data build's row files in {directory}: {exc.strerror or exc}. {fix}")
