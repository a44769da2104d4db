"""Weight files checked before transformers reads them (headers only): truncated or corrupt safetensors, an index
naming missing shards, a directory without weights, pickle checkpoints and how to convert them. Used by model
loading (:mod:`llmtune.models.load`), ``llmtune validate``, export and chat.
"""

from __future__ import annotations

from pathlib import Path

from llmtune.models.errors import ModelLoadError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")

# The files transformers' ``from_pretrained`` loads from a local directory, in its order of preference
# (transformers.utils SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME).
MODEL_WEIGHT_NAMES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json")


def check_weight_files(path: str | Path, original: str | None = None, *, model_dir: bool = False) -> None:
    """Refuse unreadable weights before transformers meets them: every ``*.safetensors`` file of the directory
    must have a valid header that covers the file (truncated and corrupt files are named), and a directory with
    only pickle checkpoints (``*.bin``...) gets a message on how to convert it. Reads headers only.

    Args:
        path: a model or adapter directory (anything else is left to the loader).
        original: how the recipe names it (``model.name_or_path``), for the messages.
        model_dir: ``path`` is a base model directory: it must also hold one of :data:`MODEL_WEIGHT_NAMES` (or
            the file its config names in ``transformers_weights``), else training would fail at the load.

    Raises:
        ModelLoadError: naming the file and what to do.
    """
    from safetensors import safe_open


    path = Path(path)
    if not path.is_dir():
        return
    if model_dir:
        _require_model_weights(path, original)
    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        import json

        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ModelLoadError(f"{index} is not a valid safetensors index ({type(err).__name__}: {err}); copy or "
                                 "download the model again.") from None
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists weight shards that are missing from {path}: {', '.join(missing)}; "
                                 "the copy or download is incomplete, copy or download them again.")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as fh:
                fh.keys()
        except Exception as err:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise ModelLoadError(
                f"{file} is not a readable safetensors file ({err}); it is truncated or corrupt (an interrupted "
                f"download or copy?). Download or copy it again{f' ({original})' if original else ''}, or re-save "
                "the model with save_pretrained."
            ) from None


def _weight_names(path: Path) -> list[str]:
    """The weight files transformers would load from a model directory: :data:`MODEL_WEIGHT_NAMES` and the file
    its config names in ``transformers_weights``."""
    import json

    names = list(MODEL_WEIGHT_NAMES)
    try:  # a config may name its own weight file (transformers' ``transformers_weights``)
        explicit = json.loads((path / "config.json").read_text(encoding="utf-8")).get("transformers_weights")
    except (OSError, ValueError, AttributeError):
        explicit = None
    if isinstance(explicit, str):
        names.append(explicit)
    return names


def has_model_weights(path: str | Path) -> bool:
    """Whether a model directory holds a weight file transformers would load (not whether it is readable)."""
    path = Path(path)
    return any((path / name).is_file() for name in _weight_names(path))


def _require_model_weights(path: Path, original: str | None) -> None:
    """A base model directory with a config but no weight file transformers would load: a ModelLoadError that
    lists what the directory holds and what it needs."""
    names = _weight_names(path)
    if has_model_weights(path):
        return
    held = sorted(p.name for p in path.iterdir())
    shown = ", ".join(held[:16]) + (", ..." if len(held) > 16 else "")
    hint = ""
    if any(n.endswith(".safetensors") for n in held):
        hint = (" It has *.safetensors files but neither model.safetensors nor model.safetensors.index.json (the "
                "index that maps weights to shards): copy the index too, or re-save the model with save_pretrained.")
    ggufs = [n for n in held if n.lower().endswith(".gguf")]
    if ggufs:
        hint += f" For a GGUF model set model.name_or_path to the file itself ({path / ggufs[0]})."
    where = f"{original!r} ({path})" if original and original != str(path) else f"{str(path)!r}"
    raise ModelLoadError(
        f"model.name_or_path: model directory {where} has no weights: it needs one of {', '.join(names)} "
        f"(it holds: {shown or 'nothing'}).{hint} Copy or download the weights (an interrupted download or a "
        "copy of the config and tokenizer only?), or point model.name_or_path at a complete model directory, a "
        ".gguf file or builtin:smollm2-135m-instruct."
    )


def pickle_checkpoint_message(path: str | Path, err: BaseException) -> str | None:
    """A message for torch's refusal of a pickle checkpoint (``weights_only=True`` met a non-tensor object), or
    ``None`` when ``err`` is not that."""
    import pickle

    text = str(err)
    if not (isinstance(err, pickle.UnpicklingError) or "weights_only" in text):
        return None
    path = Path(path)
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES) if path.is_dir() else []
    names = ", ".join(pickles) or "a pickle checkpoint"
    return (f"{path}: {names} is a pickle checkpoint holding more than tensors, and llmtune loads pickles only "
            "with torch.load(weights_only=True): loading it fully would run code from the file. Convert it once, "
            "where you trust the file, to safetensors: load it with transformers' from_pretrained in a Python "
            "session you control and save it with save_pretrained(out_dir) (safetensors is the default), then "
            "point model.name_or_path at out_dir.")

