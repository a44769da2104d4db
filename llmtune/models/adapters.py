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


def build_lora_config(adapter: AdapterConfig, task_type: str = "CAUSAL_LM") -> LoraConfig:
    """The peft ``LoraConfig`` for a recipe's ``adapter:`` section (no bias training).

    ``target_modules: all-linear`` adapts every linear layer except the output head (peft excludes ``lm_head``
    and, for ``SEQ_CLS``, the ``score`` head, which peft trains in full as a module to save).
    LoRA scaling is ``lora_alpha / lora_r``, or ``lora_alpha / sqrt(lora_r)`` with ``use_rslora``.

    Args:
        adapter: the recipe's ``adapter:`` section.
        task_type: ``CAUSAL_LM`` or ``SEQ_CLS`` (a base with a score head, see :func:`task_type_of`).
    """
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType(task_type),
        r=adapter.lora_r,
        lora_alpha=adapter.lora_alpha,
        lora_dropout=adapter.lora_dropout,
        target_modules=adapter.target_modules,
        modules_to_save=list(adapter.modules_to_save) or None,
        use_dora=adapter.use_dora,
        use_rslora=adapter.use_rslora,
        bias="none",
    )


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
    model: nn.Module, adapter: AdapterConfig, *, gradient_checkpointing: bool, quantized: bool
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

    Returns:
        A ``peft.PeftModel`` for ``type: lora`` (only adapter weights and ``modules_to_save`` trainable), else
        ``model`` itself with all parameters trainable.

    Raises:
        ModelLoadError: full fine-tuning of a quantized base; ``target_modules`` matching no module of the model
            (the message lists the linear layers it has); checkpointing on an architecture without support.
    """
    quantized = quantized or is_kbit_quantized(model)
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

        try:
            result = get_peft_model(model, build_lora_config(adapter, task_type_of(model)))
        except ValueError as err:
            raise ModelLoadError(
                f"adapter.target_modules={adapter.target_modules!r} / adapter.modules_to_save="
                f"{adapter.modules_to_save!r} cannot be applied: {err}. Linear layers of this model: "
                f"{', '.join(_linear_module_names(model))} (or use all-linear)."
            ) from err

        share_lora_inputs_under_autocast(result)

    trainable, total = count_parameters(result)
    kind = "full fine-tuning" if adapter.type == "none" else (
        ("QLoRA" if quantized else "DoRA" if adapter.use_dora else "LoRA")
        + f" r={adapter.lora_r} alpha={adapter.lora_alpha:g}" + (" rsLoRA" if adapter.use_rslora else "")
        + (" DoRA" if quantized and adapter.use_dora else "")
    )
    logger.info(
        "%s: %s trainable of %s parameters (%.3f%%)%s",
        kind, f"{trainable:,}", f"{total:,}", 100.0 * trainable / max(total, 1),
        ", gradient checkpointing (non-reentrant)" if checkpointing_enabled(result) else "",
    )
    return result


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


# ---- several adapters on one base ----------------------------------------------------------------------------
# peft's set_adapter()/disable_adapter() also flip requires_grad (the inactive adapter's weights are frozen, and
# leaving disable_adapter() re-enables grads of the ACTIVE adapter only), so switching between two trained adapters
# with them freezes one of them for good. adapter_scope switches which adapter the LoRA layers apply without touching
# requires_grad. With gradient checkpointing the blocks are recomputed during backward, after the scope has been left:
# adapter_recompute_context (the checkpoint's context_fn) re-enters the scope that was active at forward time, so the
# recomputed activations are the ones that were used (otherwise the value adapter's gradients would silently be
# computed with the policy adapter's activations).

_SCOPES: list[tuple[list, list[str] | None]] = []  # (tuner layers, active adapter names or None = disabled)


def _tuner_layers(model: nn.Module) -> list:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


class _ApplyScope:
    """Context manager that sets ``(layers, adapters)`` on entry and restores each layer's previous state on exit."""

    def __init__(self, layers: list, adapters: list[str] | None):
        self.layers, self.adapters, self.saved = layers, adapters, []

    def __enter__(self):
        self.saved = [(layer, layer._active_adapter, layer._disable_adapters) for layer in self.layers]
        for layer in self.layers:
            if self.adapters is None:
                layer._disable_adapters = True
            else:
                layer._active_adapter = list(self.adapters)
                layer._disable_adapters = False
        _SCOPES.append((self.layers, self.adapters))
        return self

    def __exit__(self, *exc):
        _SCOPES.pop()
        for layer, active, disabled in self.saved:
            layer._active_adapter, layer._disable_adapters = active, disabled
        return False


def adapter_scope(model: nn.Module, adapter: str | None) -> _ApplyScope:
    """Run ``model`` (a peft model, or a module containing one) with only ``adapter`` applied, or with every
    adapter disabled when ``adapter`` is None (the reference model). Gradient flags are left untouched, so all
    adapters stay trainable; nesting restores the outer scope on exit.

    Args:
        model: any module holding peft tuner layers.
        adapter: adapter name (``"default"`` = the first one attached), or None for the bare base.

    Raises:
        ValueError: ``adapter`` is not an adapter of the model.
    """
    layers = _tuner_layers(model)
    if adapter is not None:
        known = {name for layer in layers for name in getattr(layer, "lora_A", {}).keys()}
        if known and adapter not in known:
            raise ValueError(f"adapter {adapter!r} is not attached; the model has {sorted(known)}")
    return _ApplyScope(layers, None if adapter is None else [adapter])


def adapter_recompute_context():
    """``context_fn`` for ``torch.utils.checkpoint``: ``(forward context, recompute context)``. The recompute
    context re-applies the adapter scope active when the checkpointed block ran forward (no scope: nothing)."""
    import contextlib

    if not _SCOPES:
        return contextlib.nullcontext(), contextlib.nullcontext()
    layers, adapters = _SCOPES[-1]
    return contextlib.nullcontext(), _ApplyScope(layers, adapters)
