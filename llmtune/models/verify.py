"""Checks on saved adapters: every LoRA tensor present, non-empty and of the expected shape.

ZeRO-3 once saved a 40-byte adapter without any error (DeepSpeed #4295, trl #4416); we check after
every save instead of trusting it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from llmtune.errors import LlmtuneError


class AdapterSaveError(LlmtuneError, RuntimeError):
    """A saved adapter is missing tensors or holds empty / wrongly shaped ones."""


def _expected_lora_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """``{suffix: shape}`` of every lora_A/lora_B weight of the model (default adapter), from module sizes.

    Shapes come from the modules' ``in_features``/``out_features``/``r``, which stay correct under ZeRO-3
    where the parameters themselves are empty placeholders.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for name, module in model.named_modules():
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(lora_a, torch.nn.ModuleDict) or "default" not in lora_a:
            continue
        r = module.r["default"]
        base = module.get_base_layer()
        in_f = getattr(base, "in_features", None)
        out_f = getattr(base, "out_features", None)
        if in_f is None or out_f is None:
            continue
        key = name.split("base_model.model.", 1)[-1]
        shapes[f"{key}.lora_A.weight"] = (r, in_f)
        shapes[f"{key}.lora_B.weight"] = (out_f, r)
    return shapes


def verify_saved_adapter(adapter_dir: str | Path, model: torch.nn.Module) -> int:
    """Check ``adapter_model.safetensors`` against the in-memory PEFT model.

    Returns:
        Number of LoRA tensors checked.

    Raises:
        AdapterSaveError: the file is missing, a LoRA tensor is absent, empty, or has the wrong shape.
    """
    path = Path(adapter_dir) / "adapter_model.safetensors"
    if not path.is_file():
        raise AdapterSaveError(f"{path} was not written")
    expected = _expected_lora_shapes(model)
    with safe_open(str(path), framework="pt") as fh:
        saved = {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    problems = []
    for suffix, shape in expected.items():
        match = [k for k in saved if k.endswith(suffix)]
        if not match:
            problems.append(f"{suffix}: missing")
        elif saved[match[0]] != shape:
            problems.append(f"{suffix}: saved shape {saved[match[0]]}, expected {shape}")
    if not expected:
        problems.append("the model has no LoRA modules")
    if problems:
        raise AdapterSaveError(
            f"adapter saved to {path} is incomplete ({len(problems)} problem(s), e.g. {problems[:3]}); "
            "under DeepSpeed ZeRO-3 the parameters must be gathered before saving"
        )
    return len(expected)
