"""Local data paths of a recipe: what counts as a local file, and whether it exists.

Lives in the config layer (no torch, no data package) so that ``llmtune validate`` and the pipeline's dry run can
report a missing data file before they load a tokenizer; the data reader (``llmtune.data.sources``) applies the
same rule when it opens a source.
"""

from __future__ import annotations

from pathlib import Path

# suffixes that make a data path local (a file that must exist) rather than a hub dataset id
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv", ".gz", ".txt", ".arrow")


def local_path(path: str, base_dir: str | Path = ".") -> Path:
    """A data source's ``path`` as a local path (``~`` expanded, relative ones against ``base_dir``)."""
    local = Path(path).expanduser()
    return local if local.is_absolute() else Path(base_dir) / local


def missing_local_file(path: str, base_dir: str | Path = ".") -> str | None:
    """``"file not found: <absolute path> (...)"`` when ``path`` names a local file that does not exist; else None.

    A path is local when it starts with ``.``, ``/`` or ``~``, ends with one of :data:`LOCAL_SUFFIXES`, or has more
    than one ``/`` (``owner/name`` is a hub dataset id, ``builtin:...`` an embedded dataset).
    """
    if path.startswith("builtin:"):
        return None
    local = local_path(path, base_dir)
    if local.exists():
        return None
    if path.startswith((".", "/", "~")) or path.lower().endswith(LOCAL_SUFFIXES) or path.count("/") > 1:
        where = f"the current directory, {Path.cwd()}" if str(base_dir) in ("", ".") else str(Path(base_dir).resolve())
        return f"file not found: {local.resolve()} (relative paths are resolved against {where})"
    return None
