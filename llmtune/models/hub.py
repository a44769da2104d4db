"""Hub models: a hub id's files from the Hugging Face hub or its local cache (offline, or when the hub cannot be
reached), with errors that say what to do (a gated model, a missing cache entry, what ``llmtune validate`` needs)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from llmtune.models.errors import ModelLoadError

logger = logging.getLogger(__name__)

_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "tokenizer*"]
_TRUE = {"1", "on", "yes", "true"}


def hub_offline() -> bool:
    """Whether hub access is disabled (``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE``, read now or at import)."""
    from huggingface_hub import constants

    env = any(os.environ.get(var, "").strip().lower() in _TRUE for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return env or bool(getattr(constants, "HF_HUB_OFFLINE", False))


def hub_source(repo_id: str, cfg, *, download: bool = True) -> tuple[Path, str]:
    """Download (or, offline or with the hub unreachable, find in the HF cache) the files of a hub model.

    Args:
        repo_id: ``org/name``. cfg: the ``model:`` section (``revision``, ``trust_remote_code``).
        download: False (``llmtune validate``): with network access only look the repo up.

    Returns:
        ``(snapshot directory, revision)``; with ``download=False`` online, the directory the download will create.

    Raises:
        ModelLoadError: not cached while offline or unreachable, unknown, gated without access, or incomplete.
    """
    from huggingface_hub import HfApi, constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    revision = cfg.revision
    where = f"{repo_id!r}" + (f" at revision {revision!r}" if revision else "")
    not_local = f" (If {repo_id!r} is meant as a local directory: it does not exist in {Path.cwd()}.)"
    patterns = list(_HUB_PATTERNS) + (["*.py"] if cfg.trust_remote_code else [])
    offline = hub_offline()
    try:
        if offline:
            folder = snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=patterns)
        else:
            info = HfApi().model_info(repo_id, revision=revision)
            if not download:
                from huggingface_hub.file_download import repo_folder_name

                folder = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
                snapshot = folder / "snapshots" / str(info.sha)
                return snapshot, str(info.sha)
            files = [s.rfilename for s in (info.siblings or [])]
            if not any(f.endswith(".safetensors") for f in files):
                patterns.append("*.bin")
            folder = snapshot_download(repo_id, revision=info.sha, allow_patterns=patterns)
    except LocalEntryNotFoundError as err:
        if offline:
            raise ModelLoadError(
                f"model.name_or_path: hub model {where} is not in the local Hugging Face cache and hub access is "
                "disabled (HF_HUB_OFFLINE=1). Download it once with network access, unset HF_HUB_OFFLINE, or set "
                "model.name_or_path to a local model directory (or builtin:smollm2-135m-instruct). "
                + tokenizer_only_hint(repo_id) + not_local
            ) from err
        folder = _cached_snapshot(repo_id, revision, patterns)
        if folder is None:
            raise ModelLoadError(
                f"model.name_or_path: could not download hub model {where} (no connection to the hub?): {err}. "
                "Set model.name_or_path to a local model directory, or retry with network access. "
                + tokenizer_only_hint(repo_id)
            ) from err
    except (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError, HFValidationError) as err:
        raise ModelLoadError(
            f"model.name_or_path: hub model {where} cannot be used: {type(err).__name__}: {str(err).splitlines()[0]}. "
            "Check the spelling, the revision and your access (a gated model such as meta-llama/*: accept its "
            "license on its hub page, then `hf auth login` or HF_TOKEN), or give a local model directory."
            + not_local
        ) from err
    except OSError as err:
        raise ModelLoadError(f"model.name_or_path: downloading hub model {where} failed: {err}") from err
    except Exception as err:  # noqa: BLE001 - connection errors of the HTTP client are not OSErrors
        folder = _cached_snapshot(repo_id, revision, patterns)
        if folder is None:
            raise ModelLoadError(
                f"model.name_or_path: could not reach the hub for {where} ({type(err).__name__}: {err}), and it is "
                "not in the local Hugging Face cache. Give a local model directory, or download it where there is "
                "network. " + tokenizer_only_hint(repo_id) + not_local
            ) from err
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise ModelLoadError(
            f"model.name_or_path: the cached snapshot of hub model {where} at {folder} has no config.json "
            "(an incomplete download?). Download it again with network access or give a local model directory."
        )
    return folder, folder.name


def tokenizer_only_hint(repo_id: str) -> str:
    """How to get what ``llmtune validate`` needs of a hub model (its config and tokenizer files, a few MB; no
    weights) onto a machine, for the error messages and the docs."""
    return (f"llmtune validate needs only the config and tokenizer files, not the weights: `hf download {repo_id} "
            "--exclude '*.safetensors' --exclude '*.bin' --exclude '*.pth' --exclude 'original/*'` (a gated model "
            "needs `hf auth login` first) puts them in the Hugging Face cache, which llmtune reads when the hub is "
            "unreachable or HF_HUB_OFFLINE=1; or add --local-dir DIR and set model.name_or_path=DIR.")


def _cached_snapshot(repo_id: str, revision: str | None, patterns: list[str]) -> str | None:
    """The cached snapshot of a hub model when the hub cannot be reached (as transformers falls back), else None."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, revision=revision, local_files_only=True, allow_patterns=patterns)
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError) or an unusable cache entry
        return None
    logger.warning("model.name_or_path: the hub is unreachable; using the cached snapshot of %s at %s", repo_id, folder)
    return folder
