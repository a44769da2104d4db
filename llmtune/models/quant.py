"""bitsandbytes 4-bit weights: one layout, read as the model computes with them.

bitsandbytes >= 0.49's CPU backend repacks a ``Params4bit`` IN PLACE into a CPU-only layout the first time its
``Linear4bit`` runs an inference forward on a CPU with AVX-512 BF16 (``module.training`` off, input without grad):
the codes are reordered (shape ``(N*K/2, 1)`` -> ``(N, K/2)``), the double-quantized absmax is expanded to bf16 and
``quant_state.packing_format_for_cpu`` is set. From then on:

- ``dequantize_4bit`` and transformers' ``model.dequantize()`` read the packed codes as the standard layout: wrong
  weights (a 64x64 projection off by ~0.1), so a merge or export built on them is a different model;
- every later forward of that layer, training ones too, goes through the bf16 CPU kernel, which has no backward
  to its input: one evaluation pass changes the training loss and the gradients of every layer below.

:func:`keep_standard_4bit_layout` turns the repack off (the module flag ``support_avx512bf16_for_cpu`` that
bitsandbytes checks) and restores any weight already packed to the standard layout with the values the kernel
computed with (codes unchanged, absmax as the bf16 numbers it used). :func:`llmtune.models.load.load_model` calls
it on every quantized model and :func:`dequantize_to_fp32` before reading weights, so training, evaluation,
export, chain merges and reward scoring see the same weights on any CPU (with or without AVX-512) and on GPU
(where bitsandbytes never repacks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn


def _is_packed(state) -> bool:
    return state is not None and bool(getattr(state, "packing_format_for_cpu", False))


def keep_standard_4bit_layout(model: nn.Module) -> int:
    """Keep every bitsandbytes 4-bit weight of ``model`` in the standard layout, in place.

    Turns off the CPU repack of each ``Linear4bit`` (``support_avx512bf16_for_cpu = False``) and converts a weight
    that is already packed (``quant_state.packing_format_for_cpu``) back with bitsandbytes' own inverse
    (``_convert_weight_packed_for_cpu_inverse``). The absmax is restored as the bf16 values the packed kernel used,
    not re-quantized (bitsandbytes' inverse re-quantizes a double-quantized absmax, another rounding, and leaves
    a single-quantized one transposed), so the restored weight is the one the packed model computed with.

    Args:
        model: any module (a peft wrapper too); models without 4-bit layers are left unchanged.

    Returns:
        The number of weights converted back from the packed layout (0 when none had been packed).
    """
    restored = 0
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if type(weight).__name__ != "Params4bit" or not _is_packed(state):
            continue
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        used_absmax = state.absmax  # (K / blocksize, N) bf16: what the CPU kernel multiplied the codes with
        state.original_nested = False  # keep those values: no second quantization of the absmax
        data, state = _convert_weight_packed_for_cpu_inverse(weight.data, state)
        state.absmax = used_absmax.T.reshape(-1).float()  # (N * K / blocksize,) in the standard block order
        weight.data, weight.quant_state = data, state
        restored += 1
    return restored


def compute_dtype_4bit(model: nn.Module) -> torch.dtype | None:
    """The least precise dtype the 4-bit layers of ``model`` computed their last forward in, or ``None`` (no
    4-bit layer, or none ran yet with a set compute dtype).

    A packed CPU weight (see the module docstring) is multiplied by bitsandbytes' bf16 kernel whatever
    ``bnb_4bit_compute_dtype`` says; otherwise a layer computes in its ``compute_dtype`` (which bitsandbytes
    switches to the input dtype for fp32/bf16 inputs).
    """
    import torch

    rank = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
    found = None
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if type(weight).__name__ != "Params4bit":
            continue
        dtype = torch.bfloat16 if _is_packed(weight.quant_state) else getattr(module, "compute_dtype", None)
        if dtype in rank and (found is None or rank[dtype] > rank[found]):
            found = dtype
    return found


def dequantize_to_fp32(model):
    """Replace every bitsandbytes 4/8-bit linear layer of ``model`` by an ``nn.Linear`` holding its dequantized
    weight, computed in fp32, and cast every other floating parameter to fp32.

    Packed CPU weights are restored first (:func:`keep_standard_4bit_layout`), so what is dequantized is the
    weight the model computed with. transformers' ``model.dequantize`` does the replacement; 4-bit weights are
    dequantized in their quantization state's dtype (the load dtype, often bf16), so that dtype is set to fp32
    first: ``code[q] * absmax`` in fp32 is the value the 4-bit weight stands for, and the one the training matmuls
    rounded to their compute dtype.

    Returns:
        The dequantized model (a plain ``PreTrainedModel``; its quantizer and ``quantization_config`` are removed).
    """
    import torch

    keep_standard_4bit_layout(model)
    for param in model.parameters():
        if type(param).__name__ == "Params4bit" and param.quant_state is not None:
            param.quant_state.dtype = torch.float32
    model = model.dequantize(dtype=torch.float32)
    for attr in ("is_loaded_in_4bit", "is_loaded_in_8bit"):
        if attr in vars(model):
            setattr(model, attr, False)
    model.is_quantized = False
    return model.to(torch.float32)


class fp32_compute_4bit:
    """Inside, every bitsandbytes 4-bit layer of ``model`` computes in fp32 from its weights dequantized in fp32
    (``compute_dtype`` and the quantization state's ``dtype`` set to fp32; restored on exit): the model's own function
    without the rounding of its compute dtype. ``llmtune export`` compares a merged model (the 4-bit base dequantized
    to fp32, adapters merged) with this, at fp32 tolerance: the same weights, so any larger difference is a wrong
    merge, not bf16 arithmetic. Layers are kept in the standard layout first (:func:`keep_standard_4bit_layout`)."""

    def __init__(self, model: nn.Module):
        self.model, self.saved = model, []

    def __enter__(self):
        import torch

        keep_standard_4bit_layout(self.model)
        for module in self.model.modules():
            weight = getattr(module, "weight", None)  # peft's LoRA wrapper exposes its base layer's weight too
            if type(weight).__name__ != "Params4bit" or weight.quant_state is None \
                    or not type(module).__module__.startswith("bitsandbytes"):
                continue
            self.saved.append((module, module.compute_dtype, weight.quant_state, weight.quant_state.dtype))
            module.compute_dtype, weight.quant_state.dtype = torch.float32, torch.float32
        return self

    def __exit__(self, *exc):
        for module, compute, state, dtype in self.saved:
            module.compute_dtype, state.dtype = compute, dtype
        self.saved = []
        return False
