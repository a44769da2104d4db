"""Base models (local / hub / GGUF / builtin), quantization and adapters.

Import direction: ``llmtune.models`` imports ``llmtune.config`` only; torch, transformers and peft are imported
lazily inside functions so that the CLI's ``--help`` and recipe validation stay fast.

Stage chaining (``model.from_run``) lives in :mod:`llmtune.models.lineage`; score heads (reward/value models,
read at the last real token) in :mod:`llmtune.models.heads`.

Typical use (the core does this)::

    tokenizer = load_tokenizer(recipe.model)
    model = load_model(recipe.model, recipe.precision)
    model = attach_adapter(model, recipe.adapter, gradient_checkpointing=recipe.train.gradient_checkpointing is True,
                           quantized=recipe.model.load_in_4bit or recipe.model.load_in_8bit)
"""

from llmtune.models.adapters import (
    adapter_scope,
    attach_adapter,
    build_lora_config,
    count_parameters,
    enable_gradient_checkpointing,
    task_type_of,
)
from llmtune.models.heads import last_token_index, sequence_scores
from llmtune.models.load import (
    BUILTIN_MODELS,
    HEADS,
    ModelLoadError,
    ModelSource,
    clear_gguf_quantization,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_source,
)
from llmtune.models.lineage import adapter_chain, inherit_from_run, load_model_with_chain, merge_adapter

__all__ = [
    "BUILTIN_MODELS", "HEADS", "ModelLoadError", "ModelSource", "adapter_chain", "adapter_scope", "attach_adapter",
    "build_lora_config", "clear_gguf_quantization", "count_parameters", "enable_gradient_checkpointing",
    "inherit_from_run", "last_token_index", "load_model", "load_model_with_chain", "load_tokenizer", "merge_adapter",
    "resolve_dtype", "resolve_model_source", "sequence_scores", "task_type_of",
]
