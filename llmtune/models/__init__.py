"""Base models (local / hub / GGUF / builtin), quantization and adapters.

Import direction: ``llmtune.models`` imports ``llmtune.config`` only; torch, transformers and peft are imported
lazily inside functions so that the CLI's ``--help`` and recipe validation stay fast.

Typical use (the core does this)::

    tokenizer = load_tokenizer(recipe.model)
    model = load_model(recipe.model, recipe.precision)
    model = attach_adapter(model, recipe.adapter, gradient_checkpointing=recipe.train.gradient_checkpointing,
                           quantized=recipe.model.load_in_4bit or recipe.model.load_in_8bit)
"""

from llmtune.models.adapters import (
    attach_adapter,
    build_lora_config,
    count_parameters,
    enable_gradient_checkpointing,
)
from llmtune.models.load import (
    BUILTIN_MODELS,
    ModelLoadError,
    ModelSource,
    clear_gguf_quantization,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_source,
)

__all__ = [
    "BUILTIN_MODELS", "ModelLoadError", "ModelSource", "attach_adapter", "build_lora_config",
    "clear_gguf_quantization", "count_parameters", "enable_gradient_checkpointing", "load_model",
    "load_tokenizer", "resolve_dtype", "resolve_model_source",
]
