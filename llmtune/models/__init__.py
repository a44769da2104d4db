"""Base models (local / hub / GGUF / builtin), quantization and adapters.

Import direction: ``llmtune.models`` imports ``llmtune.config`` only; torch, transformers and peft are imported
lazily inside functions so that the CLI's ``--help`` and recipe validation stay fast.
"""

from llmtune.models.load import (
    BUILTIN_MODELS,
    ModelLoadError,
    ModelSource,
    load_model,
    load_tokenizer,
    resolve_model_source,
)

__all__ = ["BUILTIN_MODELS", "ModelLoadError", "ModelSource", "load_model", "load_tokenizer", "resolve_model_source"]
