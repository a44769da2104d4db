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
from llmtune.models.attention import attention_problem, model_class
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


def meta_model(config: Any, head: str = "causal_lm", trust_remote_code: bool = False):
    """The model ``config`` describes, built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kwargs = {"trust_remote_code": trust_remote_code}
    with torch.device("meta"):
        if head == "score":  # one score: set on a copy of the config (transformers 5's generic sequence-classification
            config = copy.deepcopy(config)  # classes take no num_labels argument in from_config)
            config.num_labels = 1
            return AutoModelForSequenceClassification.from_config(config, **kwargs)
        return AutoModelForCausalLM.from_config(config, **kwargs)


def module_names(config: Any, head: str = "causal_lm", trust_remote_code: bool = False) -> list[str]:
    """Every module name of the model ``config`` describes, from a model built on the meta device (no memory)."""
    return [name for name, _ in meta_model(config, head, trust_remote_code).named_modules() if name]


def num_experts(config: Any) -> int:
    """Routed experts per MoE layer of the model ``config`` describes (0 for a dense model)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def adapted_parameters(recipe: Recipe, model) -> list[str]:
    """The parameters (MoE experts, routers) the recipe's adapter adapts on ``model`` (a meta model is enough):
    ``all-linear``'s parameter targets (:func:`llmtune.models.adapters.parameter_targets`), none for a module list."""
    from llmtune.models.adapters import parameter_targets

    adapter = recipe.adapter
    if adapter.type != "lora" or adapter.target_modules != "all-linear":
        return []
    return parameter_targets(model, adapter.exclude_modules)


def parameter_adapter_problems(recipe: Recipe, model, stage: str | None = None) -> list[tuple[str, str]]:
    """What cannot work with the adapter's parameter targets (MoE experts and routers) on ``model``: DoRA (peft
    adapts parameters with plain LoRA only), ``rollout.engine: vllm`` (vLLM serves no LoRA on MoE experts here:
    docs/models.md), and ``adapter.exclude_modules`` entries that match nothing."""
    from llmtune.models.adapters import matches_module

    problems = []
    adapter = recipe.adapter
    names = [n for n, _ in model.named_modules() if n]
    for i, entry in enumerate(adapter.exclude_modules):
        if not any(matches_module(n, [entry]) for n in names):
            problems.append((f"adapter.exclude_modules.{i}", f"{entry!r} matches no module of the model"
                             f"{_did_you_mean(entry, _leaves(names))}"))
    parameters = adapted_parameters(recipe, model)
    if parameters and adapter.use_dora:
        problems.append(("adapter.use_dora", f"DoRA cannot adapt weights stored as parameters (peft's ParamWrapper), "
                         f"and all-linear adapts {', '.join(parameters)} of this model (MoE experts and router). Set "
                         f"adapter.use_dora: false, or leave them out: adapter.exclude_modules: "
                         f"[{', '.join(sorted({p.rsplit('.', 1)[0] for p in parameters}))}]"))
    if stage in ("ppo", "grpo") and recipe.rollout.engine == "vllm":
        problems += vllm_model_problems(recipe, model.config, parameters)
    return problems


def vllm_model_problems(recipe: Recipe, config: Any, parameters: list[str] | None = None) -> list[tuple[str, str]]:
    """What the vLLM rollout engine cannot serve of this model and adapter: LoRA on MoE experts and routers stored as
    parameters (vLLM loads expert LoRA in its own per-expert layouts; measured with vLLM 0.32: it refuses the
    Qwen3-MoE and Granite-MoE adapters), and any MoE model with LoRA on vLLM's CPU build (its LoRA MoE kernel is
    Triton, GPU only), when the engine is colocated on a machine without CUDA. ``parameters``: the adapted
    parameters (read from a meta model of ``config`` when None)."""
    experts = num_experts(config)
    if not experts or recipe.adapter.type != "lora":
        return []
    if parameters is None:
        try:
            model = meta_model(config, trust_remote_code=recipe.model.trust_remote_code)
            parameters = adapted_parameters(recipe, model)
        except Exception:  # noqa: BLE001 - not buildable here: the engine reports what it cannot load
            parameters = []
    problems = []
    model_type = getattr(config, "model_type", "?")
    if parameters:
        groups = ", ".join(sorted({p.rsplit(".", 1)[0] for p in parameters}))
        problems.append(("rollout.engine", f"vLLM cannot serve this adapter: all-linear adapts the MoE experts and "
                         f"router of {model_type} ({', '.join(parameters)}), which vLLM does not load as a LoRA "
                         f"adapter. Use rollout.engine: hf, or leave them out of the adapter: "
                         f"adapter.exclude_modules: [{groups}] (docs/models.md)"))
    import torch

    if recipe.rollout.vllm.mode == "colocate" and not torch.cuda.is_available():
        problems.append(("rollout.engine", f"vLLM's CPU build cannot sample from a MoE model ({model_type}, "
                         f"{experts} experts) with a LoRA adapter: its LoRA MoE kernel needs a GPU (Triton). Use "
                         "rollout.engine: hf on this machine"))
    return problems


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
    forward; ``check_vocab=False`` for a ``from_run`` chain, whose adapters may resize the embeddings), the
    adapter module names (:func:`adapter_name_problems`) and its MoE parameter targets against DoRA and the vLLM
    engine (:func:`parameter_adapter_problems`). Reads the config only (the model is built on the meta device).
    """
    config = config if config is not None else read_model_config(recipe.model)
    if config is None:
        return []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    problems = position_problems(recipe, config, stage)
    attention = attention_problem(recipe.model.attn_implementation, config, head)
    if attention:
        problems.append(("model.attn_implementation", attention))
    if head == "score" and model_class(config, "score") is None and model_class(config) is not None:
        problems.append(("model.name_or_path", f"{getattr(config, 'model_type', '?')} models have no sequence-"
                         "classification class in transformers (AutoModelForSequenceClassification), so they cannot "
                         f"carry a reward model's score head (stage {stage or 'rm'}); train the reward model on a "
                         "family that has one (docs/models.md)"))
    rows = getattr(text, "vocab_size", None)
    if check_vocab and tokenizer is not None and isinstance(rows, int) and len(tokenizer) > rows:
        problems.append(("model.name_or_path", f"the tokenizer has {len(tokenizer)} tokens but the model's embedding "
                         f"has {rows} rows (vocab_size): token ids >= {rows} would fail the first forward with an "
                         "IndexError. Use the tokenizer that belongs to this model (a chat template must not need "
                         "new tokens)"))
    adapter = recipe.adapter
    if adapter.type == "lora":
        try:
            model = meta_model(config, head, recipe.model.trust_remote_code)
        except Exception as err:  # noqa: BLE001 - an architecture we cannot build empty: peft reports at attach
            log.warning("adapter.target_modules / modules_to_save not checked against the module names of %s: it "
                        "cannot be built on the meta device here (%s: %s). Training is not affected; peft still "
                        "stops when no module matches at all, but a misspelled entry among valid ones goes unnoticed",
                        recipe.model.name_or_path, type(err).__name__, err)
        else:
            if adapter.target_modules != "all-linear" or adapter.modules_to_save:
                problems += adapter_name_problems(recipe, [name for name, _ in model.named_modules() if name])
            problems += parameter_adapter_problems(recipe, model, stage)
    elif stage in ("ppo", "grpo") and recipe.rollout.engine == "vllm":
        problems += vllm_model_problems(recipe, config, [])
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
