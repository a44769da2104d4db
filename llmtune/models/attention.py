"""Which attention kernel a model runs: ``model.attn_implementation: auto`` (the default) lets transformers choose as
it does when a user passes nothing (``PreTrainedModel.get_correct_attn_implementation``: SDPA where the model class
supports it, else eager: gpt-oss has no SDPA path, its attention sinks need the eager kernel or flash/flex), and an
explicit kernel the model class cannot run is one error naming the kernels it can, before anything is loaded.

What a class can run is read from transformers' own class flags (``_supports_sdpa``, ``_supports_flash_attn``,
``_supports_flex_attn``; eager always). Whether a flash-attention package is installed is a separate question, left
to transformers (the load error says so).
"""

from __future__ import annotations

from typing import Any

AUTO = "auto"
KERNELS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
"""The kernels a recipe can name (``model.attn_implementation``), besides ``auto``."""

_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
          "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}


def model_class(config: Any, head: str = "causal_lm") -> type | None:
    """The transformers class ``AutoModelForCausalLM`` (``head="causal_lm"``) or ``AutoModelForSequenceClassification``
    (``"score"``) builds for ``config``, without building it; None for a config transformers does not map (remote
    code: its class is only known once its code is imported, and transformers checks the kernel then)."""
    from transformers.models.auto import modeling_auto

    mapping = modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING if head == "score" else \
        modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        return mapping[type(config)]
    except (KeyError, ValueError, ImportError, AttributeError):
        return None


def supported_kernels(cls: type) -> list[str] | None:
    """The kernels of :data:`KERNELS` that ``cls`` can run (eager always), from its class flags; None when a flag is
    not a plain bool (computed per instance), so that nothing is refused on a guess."""
    found = ["eager"]
    for kernel in KERNELS:
        if kernel == "eager":
            continue
        flag = getattr(cls, _FLAGS[kernel], False)
        if not isinstance(flag, bool):
            return None
        if flag:
            found.append(kernel)
    return found


def default_kernel(cls: type | None) -> str | None:
    """What ``auto`` gives ``cls``: ``sdpa`` where it supports it, else ``eager`` (transformers' own default); None
    when the class is not known here."""
    kernels = supported_kernels(cls) if cls is not None else None
    if kernels is None:
        return None
    return "sdpa" if "sdpa" in kernels else "eager"


def attention_problem(requested: str, config: Any, head: str = "causal_lm") -> str | None:
    """Why the model ``config`` describes cannot run ``requested`` (a ``model.attn_implementation`` value), or None
    when it can (or when that cannot be told from the class: transformers decides at load time)."""
    if requested == AUTO:
        return None
    cls = model_class(config, head)
    kernels = supported_kernels(cls) if cls is not None else None
    if kernels is None or requested in kernels:
        return None
    return (f"{requested!r} is not an attention kernel {cls.__name__} ({getattr(config, 'model_type', '?')}) can run; "
            f"it supports {', '.join(kernels)}. Set model.attn_implementation: auto (it picks "
            f"{default_kernel(cls)} for this model) or one of those")


def resolve_attention(requested: str, model_dir: Any, trust_remote_code: bool = False,
                      head: str = "causal_lm") -> str | None:
    """The ``attn_implementation`` argument for ``from_pretrained`` of the model in ``model_dir`` (a local HF
    directory: only its config is read): None for ``auto`` (transformers chooses, see the module docstring), else
    ``requested``.

    Raises:
        ModelLoadError: ``requested`` is a kernel the model class cannot run (:func:`attention_problem`).
    """
    from transformers import AutoConfig

    from llmtune.models.errors import ModelLoadError

    if requested == AUTO:
        return None
    try:
        config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - an unreadable config: from_pretrained reports it
        return requested
    problem = attention_problem(requested, config, head)
    if problem:
        raise ModelLoadError(f"model.attn_implementation: {problem}")
    return requested
