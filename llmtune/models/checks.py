"""Checks of a recipe against the model it names, from the model's config only (no weights are read), so that
``llmtune validate`` makes them too: sequence length vs the position limit, tokenizer vs embedding rows, adapter
module names vs the model's modules (a model built on the ``meta`` device). Weight files are checked by
:mod:`llmtune.models.weight_files`.
"""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from llmtune.config.schema import ModelConfig, Recipe
from llmtune.models.attention import attention_problem
from llmtune.models.load import resolve_model_source
from llmtune.utils import get_logger

log = get_logger("models.checks")

def read_model_config(cfg: ModelConfig) -> Any | None:
    """The transformers config of the recipe's base model without loading weights (local/converted directory,
    or a GGUF file's metadata before its conversion); ``None`` when it cannot be read here (a hub id that is not
    cached) — the checks below are then made when the model is loaded."""
    from transformers import AutoConfig

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
        if head == "score":  # one score: set on a copy of the config (transformers 5's generic sequence-classification
            config = copy.deepcopy(config)  # classes take no num_labels argument in from_config)
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(config, **kwargs)
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

    Checks the longest sequence against the model's position limit (:func:`position_problems`), the attention kernel
    against those the model class can run (:func:`llmtune.models.attention.attention_problem`), the
    tokenizer's size against the embedding rows (``vocab_size``: a larger id is an IndexError at the first
    forward; ``check_vocab=False`` for a ``from_run`` chain, whose adapters may resize the embeddings), and the
    adapter module names (:func:`adapter_name_problems`). Reads the config only.
    """
    config = config if config is not None else read_model_config(recipe.model)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    problems = position_problems(recipe, config, stage)
    attention = attention_problem(recipe.model.attn_implementation, config, head)
    if attention:
        problems.append(("model.attn_implementation", attention))
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
            log.warning("adapter.target_modules / modules_to_save not checked against the module names of %s: it "
                        "cannot be built on the meta device here (%s: %s). Training is not affected; peft still "
                        "stops when no module matches at all, but a misspelled entry among valid ones goes unnoticed",
                        recipe.model.name_or_path, type(err).__name__, err)
        else:
            problems += adapter_name_problems(recipe, names)
    return problems


# ---- positions ----------------------------------------------------------------------------------------------------
# rope types whose config keeps max_position_embeddings at the trained length and extends it by ``factor``
# (transformers: linear position interpolation, dynamic NTK); yarn/llama3/longrope configs state the extended length
FACTOR_ROPE_TYPES = ("linear", "dynamic")


def position_limit(config: Any) -> tuple[int, str] | None:
    """The longest sequence (tokens) the model ``config`` is built for, and where that number comes from.

    ``max_position_embeddings`` of the (text) config; with a ``linear``/``dynamic`` rope scaling (``rope_scaling`` /
    ``rope_parameters``) that states no ``original_max_position_embeddings``, times its ``factor`` (Chen et al.
    2023, position interpolation: the config keeps the pre-training length). ``None`` when the config has no limit.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return None
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope and all(isinstance(v, dict) for v in rope.values()):
        rope = max(rope.values(), key=lambda r: float(r.get("factor") or 1.0))  # per attention type: the widest
    rope = rope if isinstance(rope, dict) else {}
    kind = rope.get("rope_type") or rope.get("type") or "default"
    factor = rope.get("factor")
    if kind in FACTOR_ROPE_TYPES and isinstance(factor, (int, float)) and factor > 1 \
            and "original_max_position_embeddings" not in rope:
        return int(limit * factor), f"max_position_embeddings {limit} x rope_scaling {kind} factor {factor:g}"
    return limit, f"max_position_embeddings {limit}" + ("" if kind == "default" else f", rope_scaling {kind}")


def position_problems(recipe: Recipe, config: Any, stage: str | None = None) -> list[tuple[str, str]]:
    """The stage's longest sequence above the model's position limit (:func:`position_limit`), as
    ``(dotted key, message)``: positions the model never saw in training would be trained on silently.

    Longest sequence: ``data.max_length`` (SFT, RM, DPO, ORPO, SimPO, KTO and its KL sequences); PPO/GRPO: the
    longest prompt (``data.max_prompt_length``, default ``data.max_length``) + ``rollout.max_new_tokens``.
    """
    found = position_limit(config)
    if found is None:
        return []
    limit, source = found
    data = recipe.data
    fix = ("or extend the model's context first (a long-context variant, or rope scaling in its config: "
           "rope_scaling {rope_type: linear|yarn, factor: ...})")
    if stage in ("ppo", "grpo"):
        new = recipe.rollout.max_new_tokens or 0
        prompt = data.max_prompt_length or data.max_length
        if prompt + new > limit:
            return [("rollout.max_new_tokens", f"prompts of up to {prompt} tokens + {new} new tokens = "
                     f"{prompt + new} tokens exceed the model's position limit of {limit} ({source} in its config): "
                     f"positions the model never saw. Lower data.max_prompt_length or rollout.max_new_tokens so that "
                     f"their sum is <= {limit}, {fix}")]
        return []
    if data.max_length > limit:
        return [("data.max_length", f"{data.max_length} exceeds the model's position limit of {limit} ({source} in "
                 f"its config): sequences would train on positions the model never saw. Set data.max_length <= "
                 f"{limit}, {fix}")]
    return []
