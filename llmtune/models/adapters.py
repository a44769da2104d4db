"""Make a loaded base model trainable: a peft LoRA/DoRA/rsLoRA adapter (QLoRA on a quantized base) or full
fine-tuning, with gradient checkpointing that never changes the gradients.

Gradient checkpointing is always the NON-reentrant kind (``torch.utils.checkpoint(..., use_reentrant=False)``).
The reentrant kind only back-propagates into a checkpointed block when one of the block's *tensor inputs*
requires grad. With a frozen base the hidden states entering the first decoder layer come from a frozen
embedding, so none does: every LoRA weight inside the checkpointed layers silently gets no gradient and the run
"trains" nothing (peft #137, transformers #23170). :func:`enable_gradient_checkpointing` switches any model to the
non-reentrant kind, and falls back to making the embedding output require grad when a model's own code still
checkpoints reentrantly (old hub code that ignores the kwargs).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from llmtune.models.load import ModelLoadError

if TYPE_CHECKING:
    from peft import LoraConfig
    from torch import nn

    from llmtune.config.schema import AdapterConfig

logger = logging.getLogger(__name__)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """Count trainable and total parameters (shared/tied parameters once).

    bitsandbytes ``Params4bit`` tensors pack two 4-bit values per byte of storage, so they are counted as
    ``numel * 2 * storage itemsize`` (as peft does); DeepSpeed ZeRO-3 partitioned parameters by ``ds_numel``.

    Args:
        model: any module (a PeftModel counts base + adapter).

    Returns:
        ``(trainable, total)`` in parameters (not bytes).
    """
    trainable = total = 0
    for param in model.parameters():
        n = param.numel()
        if n == 0 and hasattr(param, "ds_numel"):
            n = param.ds_numel
        if type(param).__name__ == "Params4bit":
            storage = getattr(param, "quant_storage", None)
            n = n * 2 * (storage.itemsize if storage is not None else 1)
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total


def is_kbit_quantized(model: nn.Module) -> bool:
    """Whether ``model`` was loaded in 4 or 8 bit with bitsandbytes."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def checkpointing_enabled(model: nn.Module) -> bool:
    """Whether any submodule of ``model`` has gradient checkpointing switched on."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def reentrant_checkpointing_modules(model: nn.Module) -> list[str]:
    """Names of checkpointed submodules whose checkpoint function is (or may be) the reentrant kind.

    A function counts as non-reentrant only if it is a ``functools.partial`` with ``use_reentrant=False``;
    anything else (no function recorded, no keyword, ``True``) is reported.
    """
    found = []
    for name, module in model.named_modules():
        if getattr(module, "gradient_checkpointing", False) is not True:
            continue
        func = getattr(module, "_gradient_checkpointing_func", None)
        if not (isinstance(func, functools.partial) and func.keywords.get("use_reentrant") is False):
            found.append(name or "<root>")
    return found


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Switch on non-reentrant gradient checkpointing and turn off the KV cache (``config.use_cache=False``).

    If some module still checkpoints reentrantly afterwards (model code that ignores the kwargs), the input
    embedding's output is made to require grad (``enable_input_require_grads``) so that adapter weights inside
    checkpointed blocks still receive gradients.

    Args:
        model: a transformers ``PreTrainedModel`` (not yet wrapped by peft).

    Raises:
        ModelLoadError: the architecture does not support gradient checkpointing.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ModelLoadError(
            f"{type(model).__name__} does not support gradient checkpointing; set train.gradient_checkpointing: false"
        )
    # context_fn: a recomputed block runs with the adapter that was active when it first ran (adapter_scope).
    kwargs = {"use_reentrant": False, "context_fn": adapter_recompute_context}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name; the old one warns
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False
    reentrant = reentrant_checkpointing_modules(model)
    if reentrant:
        logger.warning(
            "%d module(s) still use reentrant checkpointing (e.g. %s); making the input embeddings require grad so "
            "that adapter weights inside them get gradients",
            len(reentrant), reentrant[0],
        )
        if hasattr(model, "disable_input_require_grads"):
            model.disable_input_require_grads()  # avoid stacking a second hook
        model.enable_input_require_grads()


def build_lora_config(adapter: AdapterConfig, task_type: str = "CAUSAL_LM", model: nn.Module | None = None
                      ) -> LoraConfig:
    """The peft ``LoraConfig`` for a recipe's ``adapter:`` section (no bias training).

    ``target_modules: all-linear`` adapts every linear map of the model except the output head
    (:func:`all_linear_targets`, given ``model``): the ``nn.Linear`` layers as peft's ``all-linear`` finds them (peft
    excludes ``lm_head`` and, for ``SEQ_CLS``, the ``score`` head, which peft trains in full as a module to save),
    and the weights that are not ``nn.Linear`` layers (MoE experts stored as 3-D parameters, MoE routers) through
    peft's ``target_parameters``. ``adapter.exclude_modules`` leaves modules out (e.g. the router). peft cannot put
    dropout in front of a parameter (its ``ParamWrapper``): with parameter targets the config has
    ``lora_dropout=0`` and :func:`attach_adapter` gives the linear layers ``adapter.lora_dropout`` itself.
    LoRA scaling is ``lora_alpha / lora_r``, or ``lora_alpha / sqrt(lora_r)`` with ``use_rslora``.

    Args:
        adapter: the recipe's ``adapter:`` section.
        task_type: ``CAUSAL_LM`` or ``SEQ_CLS`` (a base with a score head, see :func:`task_type_of`).
        model: the base model (plain or already peft-wrapped) ``all-linear`` is resolved on; None passes
            ``all-linear`` to peft as it is (its ``nn.Linear`` layers only).
    """
    from peft import LoraConfig, TaskType

    targets, parameters, exclude = adapter.target_modules, None, list(adapter.exclude_modules) or None
    if targets == "all-linear" and model is not None:
        targets, parameters = all_linear_targets(model, task_type, adapter.exclude_modules)
        exclude = None  # applied above, to the parameters too (peft's exclude_modules does not see those)
    return LoraConfig(
        task_type=TaskType(task_type),
        r=adapter.lora_r,
        lora_alpha=adapter.lora_alpha,
        lora_dropout=0.0 if parameters else adapter.lora_dropout,
        target_modules=targets,
        target_parameters=parameters or None,
        exclude_modules=exclude,
        modules_to_save=list(adapter.modules_to_save) or None,
        use_dora=adapter.use_dora,
        use_rslora=adapter.use_rslora,
        bias="none",
    )


def matches_module(name: str, entries: Sequence[str]) -> bool:
    """Whether module ``name`` is one of ``entries`` or ends with ``.<entry>`` (peft's rule for a list of names, as
    in ``exclude_modules``)."""
    return any(name == e or name.endswith("." + e) for e in entries)


def all_linear_targets(model: nn.Module, task_type: str = "CAUSAL_LM", exclude: Sequence[str] = ()
                       ) -> tuple[list[str], list[str]]:
    """What ``target_modules: all-linear`` adapts on ``model``: ``(module names, parameter names)``.

    Modules: peft's own ``all-linear`` resolution (every ``nn.Linear``/``Conv1D`` except the output head, and for
    ``SEQ_CLS`` the classifier head), as full names. Parameters: :func:`parameter_targets`. Names matching
    ``exclude`` (module name or dotted suffix) are left out of both.

    Args:
        model: the base model (plain, or peft-wrapped: ``base_layer`` wrappers are looked through).
        task_type: ``CAUSAL_LM`` or ``SEQ_CLS``.
        exclude: ``adapter.exclude_modules``.
    """
    import copy

    from peft import LoraConfig, TaskType
    from peft.tuners.tuners_utils import _maybe_include_all_linear_layers

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    probe = _maybe_include_all_linear_layers(copy.copy(LoraConfig(target_modules="all-linear",
                                                                   task_type=TaskType(task_type))), base)
    modules = sorted(n for n in probe.target_modules if not matches_module(n, exclude))
    return modules, parameter_targets(base, exclude)


def parameter_targets(model: nn.Module, exclude: Sequence[str] = ()) -> list[str]:
    """The weights of ``model`` that are linear maps but not ``nn.Linear`` layers, for peft's ``target_parameters``:
    every 2-D or 3-D parameter outside linear, embedding and norm layers: MoE experts stored as stacked 3-D
    parameters (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``) and router weights (``mlp.router.weight``,
    ``mlp.gate.weight``); biases and 1-D parameters (gpt-oss's attention sinks) are not. Names are relative to their
    decoder layer (the same in every layer; peft matches name suffixes). Works on a model built on the ``meta``
    device (no peft import: ``llmtune validate`` calls it).

    Args:
        model: a transformers model (plain, or with peft layers: their ``base_layer`` wrappers are looked through).
        exclude: module names or dotted suffixes to leave out (``adapter.exclude_modules``).
    """
    import torch

    skip = (torch.nn.Linear, torch.nn.Embedding, torch.nn.Conv1d, torch.nn.LayerNorm)
    found = set()
    for name, owner in model.named_modules():
        if isinstance(owner, skip) or hasattr(owner, "base_layer") or "norm" in type(owner).__name__.lower() \
                or "lora_" in name or type(owner).__name__ == "Conv1D":
            continue
        plain = name.replace(".base_layer", "")  # a module wrapped by peft's ParamWrapper
        if matches_module(plain, exclude):
            continue
        for param_name, param in owner.named_parameters(recurse=False):
            if param.dim() in (2, 3) and not param_name.endswith("bias"):
                parts = f"{plain}.{param_name}".split(".")
                layer = next((i for i, p in enumerate(parts) if p.isdigit()), None)  # model.layers.<i>.<rest>
                found.add(".".join(parts[layer + 1:] if layer is not None else parts))
    return sorted(found)


def task_type_of(model: nn.Module) -> str:
    """peft task type of a loaded base: ``SEQ_CLS`` for ``*ForSequenceClassification`` models, else ``CAUSAL_LM``."""
    return "SEQ_CLS" if type(model).__name__.endswith("ForSequenceClassification") else "CAUSAL_LM"


def _linear_module_names(model: nn.Module) -> list[str]:
    """Distinct last name parts of the linear layers (``q_proj``, ``lm_head``, ...), for error messages."""
    import torch

    names = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) or type(module).__name__ in ("Linear4bit", "Linear8bitLt"):
            names.add(name.rsplit(".", 1)[-1])
    return sorted(names)


def attach_adapter(
    model: nn.Module, adapter: AdapterConfig, *, gradient_checkpointing: bool, quantized: bool,
    frozen_chain: Sequence[dict] = (),
) -> nn.Module:
    """Prepare a loaded base model for training: LoRA/DoRA/rsLoRA through peft, or full fine-tuning.

    Order: for a quantized base, ``peft.prepare_model_for_kbit_training`` (freezes the base, upcasts the
    non-quantized fp16/bf16 parameters such as norms and embeddings to fp32); then non-reentrant gradient
    checkpointing when asked, or when the given model already had checkpointing on (it is kept, and switched
    to non-reentrant, see the module docstring); then the adapter. Logs trainable/total parameter counts.

    Args:
        model: the model from :func:`llmtune.models.load_model`.
        adapter: the recipe's ``adapter:`` section. ``type: none`` = full fine-tuning: every parameter trainable.
        gradient_checkpointing: recompute activations in backward (``train.gradient_checkpointing``).
        quantized: the base was loaded in 4/8 bit (``model.load_in_4bit``/``load_in_8bit``); also detected
            from the model itself.
        frozen_chain: earlier adapters (chain entries, oldest first, LoRA only) to stack frozen under the new one
            (:func:`stack_frozen_adapters`): a ``model.from_run`` chain on a quantized base, which cannot be merged.

    Returns:
        A ``peft.PeftModel`` for ``type: lora`` (only adapter weights and ``modules_to_save`` trainable), else
        ``model`` itself with all parameters trainable.

    Raises:
        ModelLoadError: full fine-tuning of a quantized base or under a frozen chain; ``target_modules`` matching no
            module of the model (the message lists the linear layers it has); checkpointing on an architecture
            without support; a frozen adapter that cannot be loaded.
    """
    quantized = quantized or is_kbit_quantized(model)
    if frozen_chain and adapter.type == "none":
        raise ModelLoadError("adapter.type: none (full fine-tuning) cannot train under a frozen adapter chain "
                             "(model.from_run on a quantized base); set adapter.type: lora")
    if quantized and adapter.type == "none":
        raise ModelLoadError(
            "adapter.type: none (full fine-tuning) cannot train a 4/8-bit quantized base; set adapter.type: lora "
            "(QLoRA) or turn off model.load_in_4bit/load_in_8bit"
        )
    if quantized:
        from peft import prepare_model_for_kbit_training

        # Checkpointing is switched on below, by us (non-reentrant, without the deprecated transformers call).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    if gradient_checkpointing or checkpointing_enabled(model):
        if not gradient_checkpointing:
            logger.warning(
                "the model already has gradient checkpointing switched on; keeping it, as the non-reentrant kind"
            )
        enable_gradient_checkpointing(model)

    if adapter.type == "none":
        for param in model.parameters():
            param.requires_grad_(True)
        result = model
    else:
        from peft import get_peft_model

        config = build_lora_config(adapter, task_type_of(model), model)
        if config.target_parameters and adapter.use_dora:
            raise ModelLoadError(
                f"adapter.use_dora: DoRA cannot adapt weights stored as parameters (peft's ParamWrapper), and "
                f"target_modules: all-linear adapts {', '.join(config.target_parameters)} of this model (MoE experts "
                "and router). Set adapter.use_dora: false, or list the linear layers in adapter.target_modules")
        try:
            result = get_peft_model(model, config)
        except ValueError as err:
            raise ModelLoadError(
                f"adapter.target_modules={adapter.target_modules!r} / adapter.modules_to_save="
                f"{adapter.modules_to_save!r} cannot be applied: {err}. Linear layers of this model: "
                f"{', '.join(_linear_module_names(model))} (or use all-linear)."
            ) from err

        if config.target_parameters and adapter.lora_dropout:
            set_linear_dropout(result, adapter.lora_dropout)
        if frozen_chain:
            stack_frozen_adapters(result, frozen_chain)
        share_lora_inputs_under_autocast(result)

    trainable, total = count_parameters(result)
    kind = "full fine-tuning" if adapter.type == "none" else (
        ("QLoRA" if quantized else "DoRA" if adapter.use_dora else "LoRA")
        + f" r={adapter.lora_r} alpha={adapter.lora_alpha:g}" + (" rsLoRA" if adapter.use_rslora else "")
        + (" DoRA" if quantized and adapter.use_dora else "")
        + (f" on {len(frozen_chain)} frozen earlier adapter(s)" if frozen_chain else "")
    )
    logger.info(
        "%s: %s trainable of %s parameters (%.3f%%)%s",
        kind, f"{trainable:,}", f"{total:,}", 100.0 * trainable / max(total, 1),
        ", gradient checkpointing (non-reentrant)" if checkpointing_enabled(result) else "",
    )
    return result


def set_linear_dropout(model: nn.Module, p: float) -> int:
    """Give every LoRA linear layer of ``model`` dropout ``p`` on its input (peft's config holds 0 when the adapter
    also targets parameters, see :func:`build_lora_config`); parameter wrappers keep none. Returns the layers set."""
    import torch
    from peft.tuners.lora.layer import ParamWrapper

    count = 0
    for module in model.modules():
        if hasattr(module, "lora_dropout") and hasattr(module, "lora_A") and not isinstance(module, ParamWrapper):
            for name in list(module.lora_dropout.keys()):
                module.lora_dropout[name] = torch.nn.Dropout(p)
                count += 1
    logger.info("lora_dropout %g on the %d LoRA linear layers (none on the adapted parameters: peft cannot drop out "
                "their input)", p, count)
    return count


# ---- one saved input per LoRA layer under autocast ---------------------------------------------------------------
def _lora_input_cast_hook(module, args) -> None:
    x = args[0] if args else None
    if x is None or not hasattr(x, "device"):
        return
    import torch

    active = [a for a in module.active_adapters if a in module.lora_A]
    exact = not any(a in getattr(module, "lora_variant", {}) for a in active) and all(
        isinstance(module.lora_dropout[a], torch.nn.Identity) for a in active if a in module.lora_dropout)
    module.cast_input_dtype_enabled = not (exact and torch.is_autocast_enabled(x.device.type))


def share_lora_inputs_under_autocast(model: nn.Module) -> int:
    """Let LoRA layers skip peft's cast of their input to the adapter dtype while autocast is on (bf16/fp16 mixed
    precision with fp32 adapters).

    peft casts a LoRA layer's (bf16) input to the fp32 adapter dtype and autocast casts it back to bf16 for the
    ``A`` matmul, so every LoRA module keeps its own bf16 copy of its input for the backward: q, k, v, o, gate, up
    and down, 6 hidden + 1 intermediate per token per layer (~15 GiB for Llama-3-8B at 4 x 2,048 tokens). Without
    the cast autocast makes the same bf16 operand from the input itself (bf16 -> fp32 -> bf16 is exact), which is
    saved once and shared. Decided at every call by a forward pre-hook: only under autocast, only for plain LoRA
    without dropout (a dropped input is a new tensor either way; DoRA keeps peft's path).

    Returns:
        The number of LoRA layers hooked.
    """
    count = 0
    for module in model.modules():
        if hasattr(module, "cast_input_dtype_enabled") and hasattr(module, "lora_A") \
                and not getattr(module, "_llmtune_cast_hook", False):
            module.register_forward_pre_hook(_lora_input_cast_hook)
            module._llmtune_cast_hook = True
            count += 1
    return count


# ---- frozen earlier adapters under the trained one (a from_run chain on a quantized base) ------------------------
# A quantized base cannot take a merge, so the earlier adapters of a model.from_run chain are loaded as peft adapters
# named FROZEN + index, with no trainable parameter, and stay applied in every forward: they are part of the base the
# stage trains on. adapter_scope below keeps them on (the reference is the trained adapters OFF, not the bare base).

FROZEN = "llmtune_chain_"


def frozen_adapter_names(model: nn.Module) -> list[str]:
    """The frozen chain adapters of ``model`` (names ``llmtune_chain_<i>``, oldest first); empty for none."""
    found = {name for layer in _tuner_layers(model) for name in getattr(layer, "lora_A", {}) if name.startswith(FROZEN)}
    return sorted(found, key=lambda n: int(n[len(FROZEN):]))


def _frozen_config(adapter_dir: Path, modules: set[str], task_type, wrappers: set[str] = frozenset()):
    """The saved adapter's LoraConfig made to load frozen: its exact module names as targets (only those ``modules``
    has; its ``target_parameters`` as saved, whose tensors sit under the parameter wrappers ``wrappers``), no dropout
    (the adapter is a constant of the base), no ``modules_to_save``; and its LoRA tensors."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    config = LoraConfig.from_pretrained(str(adapter_dir))
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    prefix = "base_model.model."
    owners = {k.removeprefix(prefix).split(".lora_")[0] for k in weights if "lora_" in k}
    parameters = {o for o in owners if o in wrappers} if config.target_parameters else set()
    targets = owners - parameters
    missing = sorted(t for t in targets if t not in modules)
    if missing:
        logger.info("frozen adapter %s: %d module(s) not in this model are left out (e.g. %s)", adapter_dir,
                    len(missing), missing[0])
    kept = sorted(targets - set(missing))
    config.target_modules, config.exclude_modules = kept, None
    config.layers_to_transform = config.layers_pattern = None
    config.lora_dropout, config.modules_to_save, config.task_type, config.inference_mode = 0.0, None, task_type, True
    loaded = set(kept) | parameters
    lora = {k: v for k, v in weights.items() if "lora_" in k and k.removeprefix(prefix).split(".lora_")[0] in loaded}
    return config, lora


def stack_frozen_adapters(model: nn.Module, chain: Sequence[dict]) -> list[str]:
    """Load the adapters of ``chain`` into the peft ``model`` as frozen adapters under its trained one(s).

    Each saved LoRA adapter becomes adapter ``llmtune_chain_<i>`` (peft's own layers, so 4-bit ``Linear4bit`` and
    DoRA work as when that run trained) with every parameter frozen and its dropout off; every LoRA layer applies them
    together with the trained adapter, so the model computes ``base(x) + sum_i chain_i(x) + trained(x)``: the chain
    model the earlier runs ended with, plus the new adapter. Which parameters train is left exactly as before.

    Args:
        model: a ``peft.PeftModel`` with its trained adapter ``default`` attached.
        chain: chain entries (``{"stage", "path", ...}``, oldest first) of LoRA adapters holding no whole tensors
            (:func:`llmtune.models.lineage.chain_problems` refuses the others before anything is loaded).

    Returns:
        The frozen adapter names, oldest first.

    Raises:
        ModelLoadError: an adapter cannot be read or loaded into this model.
    """
    from peft import PeftModel, set_peft_model_state_dict

    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    task_type = model.peft_config[model.active_adapter].task_type
    modules = {name.removeprefix("base_model.model.") for name, _ in model.named_modules()}
    wrappers = {name.removeprefix("base_model.model.") for name, m in model.named_modules()
                if type(m).__name__ == "ParamWrapper"}  # MoE experts / routers adapted as parameters
    names = []
    for index, entry in enumerate(chain):
        name, path = f"{FROZEN}{index}", Path(entry["path"])
        try:
            config, lora = _frozen_config(path, modules, task_type, wrappers)
            PeftModel.add_adapter(model, name, config)  # the base class: no classifier modules_to_save for SEQ_CLS
            result = set_peft_model_state_dict(model, lora, adapter_name=name)
        except Exception as err:  # noqa: BLE001 - any peft/safetensors failure is "this adapter does not load here"
            raise ModelLoadError(f"could not load the earlier {entry.get('stage')} adapter {path} (model.from_run "
                                 f"chain) onto the quantized base: {type(err).__name__}: {err}") from err
        missing = [k for k in getattr(result, "missing_keys", []) if f".{name}." in k]
        if missing:
            raise ModelLoadError(f"the earlier {entry.get('stage')} adapter {path} lacks {len(missing)} LoRA tensors "
                                 f"(e.g. {missing[0]}); the file is incomplete")
        names.append(name)
    for param_name, param in model.named_parameters():  # peft's set_adapter calls flipped some flags: restore them
        param.requires_grad_(param_name in trainable)
    trained = [a for a in model.peft_config if not a.startswith(FROZEN)]
    for layer in _tuner_layers(model):
        layer._active_adapter = [*names, *[a for a in _as_list(layer.active_adapter) if a in trained]]
        layer._disable_adapters = False
    # The earlier runs saved these adapters: this stage's checkpoints and adapter/ hold its own adapters only (peft
    # would write each frozen one into a subdirectory of every save); an explicit selected_adapters still wins.
    model.save_pretrained = functools.partial(_save_trained_adapters, model, type(model).save_pretrained)
    logger.info("stacked %d frozen earlier adapter(s) under the trained one: %s", len(names),
                ", ".join(f"{e.get('stage')} ({e['path']})" for e in chain))
    return names


def _save_trained_adapters(model, save_pretrained, *args, selected_adapters=None, **kwargs):
    """``PeftModel.save_pretrained`` that selects the trained adapters (those there are at save time: PPO adds its
    value adapter later) unless told otherwise."""
    if selected_adapters is None:
        selected_adapters = [a for a in model.peft_config if not a.startswith(FROZEN)]
    return save_pretrained(model, *args, selected_adapters=selected_adapters, **kwargs)


def _as_list(value) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def activate_frozen_chain(model: nn.Module) -> None:
    """Apply the frozen chain adapters (if any) together with each layer's active trained adapter, after a peft call
    that reset the active adapters (``add_adapter`` sets every layer back to the model's one active adapter)."""
    frozen = frozen_adapter_names(model)
    if not frozen:
        return
    for layer in _tuner_layers(model):
        layer._active_adapter = [*frozen, *[a for a in _as_list(layer.active_adapter) if not a.startswith(FROZEN)]]


def reference_scope(model: nn.Module) -> "_ApplyScope":
    """Run ``model`` as the reference of a preference / online-RL stage: the model the stage started from, i.e.
    every trained adapter off (LoRA layers and ``modules_to_save`` copies) and the frozen chain, if any, on.
    Gradient flags are left untouched (peft's ``disable_adapter()`` would make frozen chain adapters trainable on
    exit). ``model`` may be wrapped (DDP ``.module``)."""
    return adapter_scope(getattr(model, "module", model), None)


# ---- several adapters on one base ----------------------------------------------------------------------------
# peft's set_adapter()/disable_adapter() also flip requires_grad (the inactive adapter's weights are frozen, and
# leaving disable_adapter() re-enables grads of the ACTIVE adapter only), so switching between two trained adapters
# with them freezes one of them for good. adapter_scope switches which adapter the LoRA layers apply without touching
# requires_grad. With gradient checkpointing the blocks are recomputed during backward, after the scope has been left:
# adapter_recompute_context (the checkpoint's context_fn) re-enters the scope that was active at forward time, so the
# recomputed activations are the ones that were used (otherwise the value adapter's gradients would silently be
# computed with the policy adapter's activations).

_SCOPES: list[tuple[list, list[str] | None, list]] = []  # (tuner layers, active adapters or None, wrappers)


def _tuner_layers(model: nn.Module) -> list:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


class _ApplyScope:
    """Context manager that sets ``(layers, adapters)`` on entry and restores each layer's previous state on exit.

    ``adapters`` None disables every layer; a list (frozen chain adapters first) activates exactly those. Wrappers of
    trained ``modules_to_save`` copies (``wrappers``) pass through to the original module while the scope has no
    trained adapter (the reference), and are left as they are otherwise.
    """

    def __init__(self, layers: list, adapters: list[str] | None, wrappers: list = ()):
        self.layers, self.adapters, self.wrappers, self.saved = layers, adapters, list(wrappers), []

    def __enter__(self):
        self.saved = [(layer, layer._active_adapter, layer._disable_adapters) for layer in self.layers]
        self.saved_wrappers = [(w, w._disable_adapters) for w in self.wrappers]
        for layer in self.layers:
            if self.adapters is None:
                layer._disable_adapters = True
            else:
                layer._active_adapter = list(self.adapters)
                layer._disable_adapters = False
        for wrapper in self.wrappers:
            wrapper._disable_adapters = True
        _SCOPES.append((self.layers, self.adapters, self.wrappers))
        return self

    def __exit__(self, *exc):
        _SCOPES.pop()
        for layer, active, disabled in self.saved:
            layer._active_adapter, layer._disable_adapters = active, disabled
        for wrapper, disabled in self.saved_wrappers:
            wrapper._disable_adapters = disabled
        return False


def adapter_scope(model: nn.Module, adapter: str | None) -> _ApplyScope:
    """Run ``model`` (a peft model, or a module containing one) with only the trained ``adapter`` applied, or with
    every trained adapter off when ``adapter`` is None (the reference model: the model the stage started from).
    Frozen chain adapters (:func:`stack_frozen_adapters`) are part of the base and stay applied in both cases. With
    ``adapter`` None the trained ``modules_to_save`` copies are off too (the original modules run). Gradient flags
    are left untouched, so all adapters stay trainable; nesting restores the outer scope on exit.

    Args:
        model: any module holding peft tuner layers.
        adapter: trained adapter name (``"default"`` = the first one attached), or None for the reference.

    Raises:
        ValueError: ``adapter`` is not an adapter of the model.
    """
    layers = _tuner_layers(model)
    if adapter is not None:
        known = {name for layer in layers for name in getattr(layer, "lora_A", {}).keys()}
        if known and adapter not in known:
            raise ValueError(f"adapter {adapter!r} is not attached; the model has {sorted(known)}")
    frozen = frozen_adapter_names(model)
    if adapter is None:
        return _ApplyScope(layers, frozen or None, _save_wrappers(model))
    return _ApplyScope(layers, [*frozen, adapter])


def _save_wrappers(model: nn.Module) -> list:
    """peft's ``modules_to_save`` wrappers (trained full copies of a module) inside ``model``."""
    from peft.utils.other import ModulesToSaveWrapper

    return [m for m in model.modules() if isinstance(m, ModulesToSaveWrapper)]


def adapter_recompute_context():
    """``context_fn`` for ``torch.utils.checkpoint``: ``(forward context, recompute context)``. The recompute
    context re-applies the adapter scope active when the checkpointed block ran forward (no scope: nothing)."""
    import contextlib

    if not _SCOPES:
        return contextlib.nullcontext(), contextlib.nullcontext()
    layers, adapters, wrappers = _SCOPES[-1]
    return contextlib.nullcontext(), _ApplyScope(layers, adapters, wrappers)
