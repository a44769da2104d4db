"""Tokenized-data cache and Arrow output: a rerun, a resume and ``llmtune validate`` reuse the tokenized data.

Every builder (:func:`~llmtune.data.build_sft_data`, preference pairs, prompts, KTO rows) runs through
:func:`cached_build`. The cache entry of a build is keyed by (see :func:`cache_key`):

* the data kind and the builder's own arguments;
* the recipe's ``data`` section (every key except ``num_proc``, ``cache`` and ``cache_dir``, which do not change
  the result);
* every source's resolved location and the SHA-256 of its bytes (all files of a datasets directory);
* the tokenizer: its serialized vocabulary/normalizer/pre-tokenizer (``tokenizer.json``), special tokens, chat
  template, padding/truncation side and class;
* the code that tokenizes: the SHA-256 of ``llmtune/data/*.py`` and ``llmtune/tools.py`` (see :func:`code_files`),
  and the versions of llmtune, tokenizers, transformers and datasets.

So an edited data file, another tokenizer or template, another ``max_length`` or a changed llmtune is a new entry,
never a stale hit. Hub datasets (``datasets.load_dataset``) have no content hash before they are loaded and are not
cached here (``datasets`` caches the download itself); neither are tokenizers that cannot be fingerprinted.

An entry is a directory ``<cache_dir>/<key>/`` with one Arrow file per split (memory-mapped when read back: the
training process holds no copy of the data in its own memory) and ``meta.pkl`` (the data report, the chat template
the build set on the tokenizer, the other fields of the data object). It is written in a staging directory and
renamed into place, so a crash or a kill never leaves a partial entry (the staging directory of a killed build is
removed by the next build). One process builds an entry at a time (a file lock ``<key>.lock``, released by the
kernel if its holder dies): the other ranks of a launch wait and read it instead of tokenizing again. An entry
that cannot be read (a disk error, a file removed) is rebuilt, with a warning. Entries not used for
``LLMTUNE_DATA_CACHE_DAYS`` (default 30) days are removed. ``meta.pkl`` is a pickle: the cache directory is
created private to its owner (mode 0700); do not point ``data.cache_dir`` at a directory others can write.

Where: ``data.cache_dir``, else ``$LLMTUNE_DATA_CACHE``, else ``<$LLMTUNE_CACHE or ~/.cache/llmtune>/data``;
``data.cache: false`` (or ``LLMTUNE_DATA_CACHE=off``) turns it off (the Arrow files then live in a temporary
directory removed at exit).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable, TypeVar

from llmtune.config.schema import DataConfig
from llmtune.data.errors import DataError
from llmtune.data.spill import spilling
from llmtune.data.workdir import STALE_STAGING_S, building_into, data_dir, owner_dead
from llmtune.utils import content_sha256

T = TypeVar("T")

CACHE_FORMAT = 1
META = "meta.pkl"
STAGING_PREFIX = ".staging-"
ARROW_CHUNK_ROWS = 1000  # rows per Arrow record batch written by to_dataset
_NOT_IN_KEY = {"num_proc", "cache", "cache_dir"}


# ---------------------------------------------------------------------------------------------------- Arrow output


def arrow_path(stem: str = "split", *, scratch: bool = False) -> Path:
    """A new file path for a dataset written by :func:`write_dataset`, in :func:`data_dir`."""
    return data_dir(scratch=scratch) / f"{stem}-{uuid.uuid4().hex[:8]}.arrow"


def write_dataset(batches: Iterable[dict[str, list]], features):
    """Write batches of rows (column -> values) to an Arrow file as they come and return them as a memory-mapped
    ``datasets.Dataset``; only one batch is in memory at a time.

    ``Dataset.from_dict`` of 11,035 ShareGPT rows (14M tokens) peaked 1.26 GiB above the rows themselves; this path
    adds ~0.1 GiB.

    Args:
        batches: dicts of equal-length column lists (every column of ``features`` in each).
        features: the ``datasets.Features`` of the columns.

    Raises:
        DataError: the file cannot be written (disk full, permissions); the message names the directory.
    """
    import datasets
    from datasets.arrow_writer import ArrowWriter

    path = arrow_path()
    try:
        writer = ArrowWriter(path=str(path), features=features)
        written = False
        for batch in batches:
            writer.write_batch(batch)
            written = True
        if not written:
            writer.write_batch({name: [] for name in features})
        writer.finalize()
        writer.close()
    except OSError as exc:
        raise DataError(f"cannot write the tokenized data to {path.parent}: {exc.strerror or exc}. Free disk space "
                        "there, or point data.cache_dir (or $LLMTUNE_DATA_CACHE / $TMPDIR) at a disk with room."
                        ) from None
    return datasets.Dataset.from_file(str(path))


# ---------------------------------------------------------------------------------------------------- cache keys


def cache_root(cfg: DataConfig) -> Path | None:
    """The cache directory for ``cfg``, or None when caching is off (``data.cache: false`` or
    ``LLMTUNE_DATA_CACHE=off``)."""
    env = os.environ.get("LLMTUNE_DATA_CACHE", "")
    if not cfg.cache or env.lower() in ("off", "0", "false", "none"):
        return None
    if cfg.cache_dir:
        return Path(cfg.cache_dir).expanduser()
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("LLMTUNE_CACHE") or "~/.cache/llmtune").expanduser() / "data"


def tokenizer_fingerprint(tokenizer) -> str | None:
    """SHA-256 of what decides a tokenizer's output: ``tokenizer.json`` (vocab, merges, normalizer, pre-tokenizer,
    post-processor, added tokens), special tokens, chat template, sides and class; None when it has no serializable
    backend (slow tokenizers: not cached)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not hasattr(backend, "to_str"):
        return None
    try:
        state = {
            "backend": backend.to_str(),
            "class": type(tokenizer).__name__,
            "special": {k: str(v) for k, v in sorted(getattr(tokenizer, "special_tokens_map", {}).items())},
            "ids": [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id],
            "chat_template": getattr(tokenizer, "chat_template", None),
            "padding_side": getattr(tokenizer, "padding_side", None),
            "truncation_side": getattr(tokenizer, "truncation_side", None),
            "add_bos": getattr(tokenizer, "add_bos_token", None),
            "add_eos": getattr(tokenizer, "add_eos_token", None),
            "len": len(tokenizer),
        }
    except Exception:  # an exotic tokenizer: no cache rather than a wrong one
        return None
    return hashlib.sha256(json.dumps(state, sort_keys=True, default=str).encode()).hexdigest()


def code_files() -> list[Path]:
    """The files of the code that builds data: ``llmtune/data/*.py`` and ``llmtune/tools.py`` (the calculator computes
    the tool results of ``builtin:gsm8k-calculator``, and its docstring is the tool schema in those rows)."""
    here = Path(__file__).parent
    return [*sorted(here.glob("*.py")), here.parent / "tools.py"]


def _code_fingerprint() -> dict:
    from importlib import metadata

    import llmtune

    digest = hashlib.sha256()
    for file in code_files():
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    versions = {}
    for name in ("tokenizers", "transformers", "datasets", "jinja2"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"format": CACHE_FORMAT, "llmtune": llmtune.__version__, "data_code": digest.hexdigest(), **versions}


def source_fingerprints(cfg: DataConfig, base_dir: str | Path) -> list[dict] | None:
    """``[{location, sha256}]`` per source, resolved as :func:`~llmtune.data.sources.read_source` does; None when a
    source has no content hash (a hub dataset, a missing file: the build itself reports that)."""
    from llmtune.data.sources import BUILTIN_SOURCES, builtin_file

    out = []
    for ds in cfg.datasets:
        if ds.path.startswith("builtin:"):
            spec = BUILTIN_SOURCES.get(ds.path.split(":", 1)[1])
            path = builtin_file(spec) if spec else None
            if path is None:
                return None
        else:
            path = Path(ds.path).expanduser()
            if not path.is_absolute():
                path = Path(base_dir) / path
        digest = content_sha256(path)
        if digest is None:
            return None
        out.append({"location": str(path.resolve()), "sha256": digest})
    return out


def cache_key(kind: str, cfg: DataConfig, tokenizer, base_dir: str | Path, params: dict) -> str | None:
    """The cache key (SHA-256 hex) of a build, or None when it cannot be cached (see the module docstring)."""
    sources = source_fingerprints(cfg, base_dir)
    tok = tokenizer_fingerprint(tokenizer)
    if sources is None or tok is None:
        return None
    data = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in _NOT_IN_KEY}
    spec = {"kind": kind, "params": params, "data": data, "sources": sources, "tokenizer": tok,
            "code": _code_fingerprint()}
    return hashlib.sha256(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------------------------------- the cache


def _say(message: str) -> None:
    from llmtune.utils import is_main_process

    if is_main_process():
        print(f"data: {message}", file=sys.stderr, flush=True)


def cached_build(kind: str, cfg: DataConfig, tokenizer, base_dir: str | Path, build: Callable[[], T],
                 **params: Any) -> T:
    """Return ``build()``'s data object (a dataclass with ``train``, ``eval`` datasets and ``report``), from the cache
    when an entry for this build exists, else built and stored.

    On a hit, ``tokenizer.chat_template`` is set to what the build had set (as :func:`apply_chat_template_config`
    does). The returned datasets are memory-mapped Arrow files either way, so a hit and a miss give the same rows.

    Args:
        kind: the data kind (``sft``, ``preference``, ``prompt``, ``unpaired``).
        cfg: the recipe's ``data`` section.
        tokenizer: the tokenizer, before the build (its fingerprint is part of the key).
        base_dir: directory relative local paths are resolved against.
        build: the builder, called with no arguments on a miss.
        **params: the builder's other arguments (part of the key).

    Raises:
        DataError: whatever ``build`` raises (bad rows are never cached: a build that raises writes nothing); the
            cache directory cannot be created or written.
    """
    root = cache_root(cfg)
    key = cache_key(kind, cfg, tokenizer, base_dir, params) if root is not None else None
    build = _spilled(build)
    if key is None:
        return build()
    entry = root / key
    hit = _load(entry, tokenizer)
    if hit is not None:
        _say(f"tokenized {kind} data reused from the cache {entry} (data.cache: false rebuilds it)")
        return hit
    lock_file = root / f"{key}.lock"
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)  # meta.pkl is a pickle: only its owner may write here
        lock_file.touch(exist_ok=True)  # a directory where no file can be created fails here, not in the lock
    except OSError as exc:
        raise DataError(f"cannot create the data cache directory {root} or write in it: {exc.strerror or exc}. Set "
                        "data.cache_dir or $LLMTUNE_DATA_CACHE to a writable directory, or data.cache: false."
                        ) from None
    from filelock import FileLock, Timeout

    # One build per entry: the ranks of a launch (or two runs of one recipe) wait for the first and read its entry.
    # flock: released by the kernel when a holder dies, so a killed build never blocks the next one.
    lock = FileLock(str(lock_file))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(f"waiting for another process that tokenizes the same data ({lock.lock_file})")
        lock.acquire()
    try:
        return _build_entry(kind, root, key, tokenizer, build)
    finally:
        lock.release()


def _spilled(build: Callable[[], T]) -> Callable[[], T]:
    """``build`` run with its own row-file directory (:func:`~llmtune.data.spill.spilling`; in the staging entry when
    the cache is on), removed when it returns or raises."""

    def run() -> T:
        with spilling():
            return build()

    return run


def _build_entry(kind: str, root: Path, key: str, tokenizer, build: Callable[[], T]) -> T:
    entry = root / key
    hit = _load(entry, tokenizer)  # built while this process waited for the lock
    if hit is not None:
        _say(f"tokenized {kind} data reused from the cache {entry} (built by another process just now)")
        return hit
    try:
        _cleanup(root)
        prefix = f"{STAGING_PREFIX}{key}-{socket.gethostname()}-{os.getpid()}-"
        staging = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    except OSError as exc:
        raise DataError(f"cannot create the data cache directory {root}: {exc.strerror or exc}. Set data.cache_dir or "
                        "$LLMTUNE_DATA_CACHE to a writable directory, or data.cache: false.") from None
    try:
        with building_into(staging):
            data = build()
            _store(staging, data, tokenizer)
        try:
            os.rename(staging, entry)
        except OSError:  # another rank or process stored the same entry first: use that one
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    stored = _load(entry, tokenizer)
    if stored is None:  # e.g. removed between rename and read: the data built here is still valid
        return data
    size = sum(f.stat().st_size for f in entry.iterdir() if f.is_file()) / 2**20
    _say(f"tokenized {kind} data cached in {entry} ({size:,.1f} MiB; reused by a rerun and by llmtune validate)")
    return stored


def _split_file(dataset) -> str | None:
    files = getattr(dataset, "cache_files", None) or []
    return Path(files[0]["filename"]).name if len(files) == 1 else None


def _store(staging: Path, data, tokenizer) -> None:
    fields = {f.name: getattr(data, f.name) for f in dataclasses.fields(data)}
    splits = {}
    for name in ("train", "eval"):
        value = fields.pop(name)
        if value is None:
            splits[name] = None
            continue
        file = _split_file(value)
        if file is None or not (staging / file).is_file():  # not written by write_dataset (in memory): write it now
            value = write_dataset((value[a : a + ARROW_CHUNK_ROWS] for a in range(0, len(value), ARROW_CHUNK_ROWS)),
                                  value.features)
            file = _split_file(value)
        splits[name] = file
    meta = {"format": CACHE_FORMAT, "type": type(data), "splits": splits, "fields": fields,
            "chat_template": getattr(tokenizer, "chat_template", None), "created": time.time()}
    with open(staging / META, "wb") as fh:
        pickle.dump(meta, fh)
        fh.flush()
        os.fsync(fh.fileno())
    for file in staging.iterdir():  # the renamed entry must hold complete files after a power loss too
        if file.name != META:
            with open(file, "rb") as fh:
                os.fsync(fh.fileno())


def _load(entry: Path, tokenizer):
    """The data object stored in ``entry``, or None (no entry; an unreadable one is removed, with a warning)."""
    meta_file = entry / META
    if not meta_file.is_file():
        return None
    import datasets

    try:
        with open(meta_file, "rb") as fh:
            meta = pickle.load(fh)
        if meta.get("format") != CACHE_FORMAT:
            raise ValueError(f"cache format {meta.get('format')} (this llmtune writes {CACHE_FORMAT})")
        splits = {name: None if file is None else datasets.Dataset.from_file(str(entry / file))
                  for name, file in meta["splits"].items()}
        data = meta["type"](**splits, **meta["fields"])
        template = meta["chat_template"]
    except Exception as exc:  # truncated/corrupt files, a removed split, an old class: rebuild
        _say(f"the cache entry {entry} cannot be read ({type(exc).__name__}: {str(exc)[:200]}); rebuilding it")
        shutil.rmtree(entry, ignore_errors=True)
        return None
    if template is not None and getattr(tokenizer, "chat_template", None) != template:
        tokenizer.chat_template = template
    with contextlib.suppress(OSError):
        os.utime(meta_file)  # last use, for the expiry below
    return data


def _dead_build(path: Path, now: float) -> bool:
    """A staging directory whose build is gone: its process (on this host) no longer exists, or it is older than
    ``STALE_STAGING_S`` (a build on another host of a shared file system)."""
    _, _, rest = path.name[len(STAGING_PREFIX):].partition("-")  # <key>-<host>-<pid>-<random, no dash>
    return owner_dead(rest, path, now)


def _cleanup(root: Path) -> None:
    """Remove staging directories of dead builds (a killed run) and entries unused for ``LLMTUNE_DATA_CACHE_DAYS``
    days."""
    now = time.time()
    max_age = cache_days() * 86400
    for path in root.iterdir():
        try:
            if path.name.startswith(STAGING_PREFIX):
                if path.is_dir() and _dead_build(path, now):
                    shutil.rmtree(path, ignore_errors=True)
                elif not path.is_dir():
                    path.unlink()
            elif (path / META).is_file() and now - (path / META).stat().st_mtime > max_age:
                shutil.rmtree(path, ignore_errors=True)
            elif path.suffix == ".lock" and not (root / path.stem).exists() \
                    and now - path.stat().st_mtime > STALE_STAGING_S:
                path.unlink()  # the lock of an entry that is gone (expired, or its build failed)
        except OSError:
            continue


def cache_days() -> float:
    """``$LLMTUNE_DATA_CACHE_DAYS`` (default 30): entries unused this long are removed.

    Raises:
        DataError: the variable is not a positive number.
    """
    raw = os.environ.get("LLMTUNE_DATA_CACHE_DAYS", "30")
    try:
        days = float(raw)
    except ValueError:
        days = float("nan")
    if not days > 0:
        raise DataError(f"LLMTUNE_DATA_CACHE_DAYS={raw!r}: expected a positive number of days (default 30); set it "
                        "to e.g. 30, or unset it.")
    return days
