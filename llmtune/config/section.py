"""The base of every recipe section (:mod:`llmtune.config.schema`): unknown keys are errors, types strict, numbers
finite."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors (``extra='forbid'``), types are strict and numbers
    finite."""

    # strict: no bool -> number and no str -> number coercion (`learning_rate: yes` is an error, not 1.0);
    # allow_inf_nan=False: `1.0e+400` (read as inf) and `.nan` are errors. YAML ints still fill float fields.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), strict=True,
                              allow_inf_nan=False)
