"""Checks of a recipe against the model it names, from the model's config only (no weights are read), so that
``llmtune validate`` makes them too: sequence length vs the position limit, tokenizer vs embedding rows, adapter
module names vs the model's modules (a model built on the ``meta`` device), and readable weight files.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from llmtune.config.schema import ModelConfig, Recipe
from llmtune.utils import get_logger

log = get_logger("models.checks")

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def read_model_config(cfg: ModelConfig) -> Any | None:
    """The transformers config of the recipe's base model without loading weights (local/converted directory,
    or a GGUF file's metadata before its conversion); ``None`` when it cannot be read here (a hub id that is not
    cached) — the checks below are then made when the model is loaded."""
    from transformers import AutoConfig

    from llmtune.models.load import resolve_model_source

    source = resolve_model_source(cfg, convert=False)
    try:
        if (Path(source.path) / "config.json").is_file():
            return AutoConfig.from_pretrained(source.path, trust_remote_code=cfg.trust_remote_code)
        if source.gguf_file is not None:
            gguf = Path(source.gguf_file)
            return AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as err:  # noqa: BLE001 - an unreadable config is reported when the model loads
        log.warning("could not read the model config of %s for the checks (%s: %s)", cfg.name_or_path,
                    type(err).__name__, err)
    return None


def module_names(config: Any, head: str = "causal_lm", trust_remote_code: bool = False) -> list[str]:
    """Every module name of the model ``config`` describes, from a model built on the meta device (no memory)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs = {"trust_remote_code": trust_remote_code}
    with torch.device("meta"):
        if head == "score":
            model = AutoModelForSequenceClassification.from_config(config, num_labels=1, **kwargs)
        else:
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    return [name for name, _ in model.named_modules() if name]


def _leaves(names: list[str]) -> list[str]:
    return sorted({n.rsplit(".", 1)[-1] for n in names})


def adapter_name_problems(recipe: Recipe, names: list[str]) -> list[tuple[str, str]]:
    """``adapter.target_modules`` / ``modules_to_save`` entries that match no module (peft's own matching rule),
    with a did-you-mean from the model's module names."""
    from peft.tuners.tuners_utils import check_target_module_exists

    adapter = recipe.adapter
    if adapter.type != "lora":
        return []
    problems = []
    leaves = _leaves(names)
    targets = adapter.target_modules
    entries = [] if targets == "all-linear" else [targets] if isinstance(targets, str) else list(targets)
    for i, entry in enumerate(entries):
        probe = SimpleNamespace(target_modules=entry if isinstance(targets, str) else [entry], exclude_modules=None,
                                modules_to_save=None, target_parameters=None, layers_to_transform=None,
                                layers_pattern=None)
        if not any(check_target_module_exists(probe, n) for n in names):
            key = "adapter.target_modules" + ("" if isinstance(targets, str) else f".{i}")
            problems.append((key, f"{entry!r} matches no module of the model{_did_you_mean(entry, leaves)}"))
    for i, entry in enumerate(adapter.modules_to_save):
        if not any(n == entry or n.endswith("." + entry) for n in names):
            problems.append((f"adapter.modules_to_save.{i}",
                             f"{entry!r} matches no module of the model{_did_you_mean(entry, leaves)}"))
    return problems


def _did_you_mean(entry: str, leaves: list[str]) -> str:
    close = difflib.get_close_matches(entry.rsplit(".", 1)[-1], leaves, n=3, cutoff=0.5)
    shown = ", ".join(leaves[:40]) + (", ..." if len(leaves) > 40 else "")
    return (f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else "") + f" (module names: {shown})"


def model_fit_problems(recipe: Recipe, tokenizer, head: str = "causal_lm", stage: str | None = None,
                       config: Any | None = None, check_vocab: bool = True) -> list[tuple[str, str]]:
    """Recipe values that cannot work with this model, as ``(dotted key, message)``.

    Checks ``data.max_length`` (PPO, GRPO: prompt + ``rollout.max_new_tokens``) against ``max_position_embeddings``, the
    tokenizer's size against the embedding rows (``vocab_size``: a larger id is an IndexError at the first
    forward; ``check_vocab=False`` for a ``from_run`` chain, whose adapters may resize the embeddings), and the
    adapter module names (:func:`adapter_name_problems`). Reads the config only.
    """
    config = config if config is not None else read_model_config(recipe.model)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    problems: list[tuple[str, str]] = []
    limit = getattr(text, "max_position_embeddings", None)
    data = recipe.data
    if isinstance(limit, int) and limit > 0:
        if stage in ("ppo", "grpo"):
            new = recipe.rollout.max_new_tokens or 0
            need = (data.max_prompt_length or data.max_length) + new
            if need > limit:
                problems.append(("rollout.max_new_tokens", f"prompts of up to {data.max_prompt_length or data.max_length} "
                                 f"tokens + {new} new tokens = {need} exceed the model's position "
                                 f"limit (max_position_embeddings {limit}); lower data.max_prompt_length or "
                                 "rollout.max_new_tokens"))
        elif data.max_length > limit:
            problems.append(("data.max_length", f"{data.max_length} exceeds the model's position limit "
                             f"(max_position_embeddings {limit} in its config); set data.max_length <= {limit}"))
    rows = getattr(text, "vocab_size", None)
    if check_vocab and tokenizer is not None and isinstance(rows, int) and len(tokenizer) > rows:
        problems.append(("model.name_or_path", f"the tokenizer has {len(tokenizer)} tokens but the model's embedding "
                         f"has {rows} rows (vocab_size): token ids >= {rows} would fail the first forward with an "
                         "IndexError. Use the tokenizer that belongs to this model (a chat template must not need "
                         "new tokens)"))
    if recipe.adapter.type == "lora" and (recipe.adapter.target_modules != "all-linear"
                                          or recipe.adapter.modules_to_save):
        try:
            names = module_names(config, head, recipe.model.trust_remote_code)
        except Exception as err:  # noqa: BLE001 - an architecture we cannot build empty: peft reports at attach
            log.warning("could not build %s on the meta device to check adapter names (%s)", recipe.model.name_or_path,
                        err)
        else:
            problems += adapter_name_problems(recipe, names)
    return problems


# ---- weight files -----------------------------------------------------------------------------------------------
def check_weight_files(path: str | Path, original: str | None = None) -> None:
    """Refuse unreadable weights before transformers meets them: every ``*.safetensors`` file of the directory
    must have a valid header that covers the file (truncated and corrupt files are named), and a directory with
    only pickle checkpoints (``*.bin``...) gets a message on how to convert it. Reads headers only.

    Raises:
        ModelLoadError: naming the file and what to do.
    """
    from safetensors import safe_open

    from llmtune.models.load import ModelLoadError

    path = Path(path)
    if not path.is_dir():
        return
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

