"""Errors of the model layer (below every module of :mod:`llmtune.models`, which all raise them)."""

from __future__ import annotations

from llmtune.errors import LlmtuneError


class ModelLoadError(LlmtuneError, RuntimeError):
    """A base model, tokenizer or adapter could not be found, converted or loaded; the message says how to fix it."""
