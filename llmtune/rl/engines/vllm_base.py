"""The rollout engine's base weights and their identity: the frozen model below the trained adapter
(:func:`rollout_base`), and the content identity a rollout server states and a trainer checks (:func:`base_identity`,
:func:`check_base`)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from llmtune.rl.engines.vllm_client import RolloutEngineError
from llmtune.utils import get_logger

log = get_logger("rollout")

ROLLOUT_BASE = "rollout_base"


def rollout_base(recipe, out: str | Path) -> Path:
    """Directory of the engine's base weights: the model below the trained adapter (see the module docstring);
    ``out`` is where a merged chain is written (kept while the chain is unchanged).

    Raises:
        ModelLoadError: the base or an adapter of the chain cannot be loaded.
    """
    from llmtune.config import PrecisionConfig
    from llmtune.models import inherit_from_run, load_model_with_chain, resolve_model_source

    recipe, chain = inherit_from_run(recipe, ".")
    if not chain:
        return resolve_model_source(recipe.model).path
    out = Path(out)
    key = json.dumps([[e["path"], *(_stat(Path(e["path"]) / f) for f in ("adapter_model.safetensors",
                                                                            "adapter_config.json"))]
                      for e in chain] + [recipe.model.name_or_path])
    if (out / "chain.json").is_file() and (out / "chain.json").read_text() == key:
        return out
    model = load_model_with_chain(recipe.model, PrecisionConfig(), chain, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "chain.json").write_text(key)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def base_identity(recipe) -> str:
    """Identity of the weights a recipe's policy adapter sits on (16 hex digits), the same on every machine that holds
    the same files: the base model's content identity (a GGUF file's sha256, a hub revision; a local directory:
    ``config.json``'s bytes and the names and sizes of its weight files) and the sha256 of every adapter of the
    ``model.from_run`` chain. The rollout server states it (``base_id`` in ``/health``), the trainer compares it
    before the first rollout: a server started for another model or another SFT run is refused, not sampled from.

    Raises:
        ModelLoadError: the base or the earlier run cannot be found.
    """
    from llmtune.models import inherit_from_run, resolve_model_source
    from llmtune.utils import file_sha256

    recipe, chain = inherit_from_run(recipe, ".")
    source = resolve_model_source(recipe.model, convert=False)
    if source.kind == "local":
        directory = Path(source.path)
        config = directory / "config.json"
        weights = sorted((p.name, p.stat().st_size) for p in directory.iterdir()
                         if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
        base = [file_sha256(config) if config.is_file() else None, weights]
    else:
        base = [source.kind, source.fingerprint or source.revision or source.original]
    adapters = [file_sha256(Path(e["path"]) / "adapter_model.safetensors") for e in chain]
    return hashlib.sha256(json.dumps([base, adapters]).encode()).hexdigest()[:16]


def check_base(health: dict, expected: str, url: str) -> None:
    """Refuse a rollout server that serves another base than this run's (``health`` = its ``/health`` answer).

    Raises:
        RolloutEngineError: the server states another ``base_id``.
    """
    served = health.get("base_id")
    if served is None:
        log.warning("the rollout server %s does not state its base (started without --base-id): it cannot be checked "
                    "to serve this run's model; rollout/logprob_diff shows a mismatch", url)
    elif served != expected:
        raise RolloutEngineError(
            f"the rollout server {url} serves another base model (base id {served}; this run trains on {expected}: "
            "another model.name_or_path or model.from_run chain); start it with this run's recipe (llmtune "
            "rollout-server RECIPE) or set rollout.vllm.url to the server of this run's model")


def _stat(path: Path) -> str:
    return f"{path.stat().st_size}-{path.stat().st_mtime_ns}" if path.is_file() else "missing"


