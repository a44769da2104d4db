"""DeepSpeed configuration helpers (the launcher and ZeRO specifics grow here)."""

from __future__ import annotations

from typing import Any


def zero_config(stage: int) -> dict[str, Any]:
    """A DeepSpeed config for ZeRO ``stage`` whose ``"auto"`` values transformers fills from the recipe.

    ``"auto"`` covers micro batch, accumulation, clipping, precision and the optimizer/scheduler that
    ``TrainingArguments`` already holds, so the recipe stays the single source of those values.
    """
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "zero_optimization": {"stage": stage},
    }
    if stage == 3:
        config["zero_optimization"].update(
            {
                "overlap_comm": True,
                "contiguous_gradients": True,
                "stage3_gather_16bit_weights_on_model_save": True,
            }
        )
    return config
