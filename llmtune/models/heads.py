"""Score heads: one scalar per sequence, read at the last REAL token of each row.

transformers' ``*ForSequenceClassification.forward`` finds the token to read by comparing ids with
``config.pad_token_id``. When pad == EOS (SmolLM2, Llama setups that reuse EOS as pad) that is wrong for a row
whose text contains or ends with EOS, and it does not know about left padding. Here the last real token is
found from the attention mask, the backbone runs with position ids counted from the mask, and the head is
applied at that one position, so a left-padded, a right-padded and an unpadded row get the same score.

Shapes: B = rows, T = tokens per row (padded), H = hidden size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last position with mask 1 in each row (works for left and right padding).

    Args:
        attention_mask: (B, T), 1 = real token.

    Returns:
        (B,) long; 0 for a row without any real token.
    """
    import torch

    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * (attention_mask > 0)).argmax(-1)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) position ids counting real tokens only (0 for the first real token; left padding gets 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def score_parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The backbone (hidden states) and the score head of a sequence-classification model.

    Accepts the plain transformers model, a ``peft`` model around it (the LoRA layers and the trained copy of
    the head stay active, or disabled inside ``disable_adapter()``), or a wrapper with ``.module`` (DDP).

    Raises:
        ValueError: the model has no ``score``/``classifier`` head.
    """
    inner = getattr(model, "module", model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    head = getattr(inner, "score", None)
    head = getattr(inner, "classifier", None) if head is None else head
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no score head; load it with head='score'")
    return inner.base_model, head


def sequence_scores(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Score of each row at its last real token, in fp32.

    Args:
        model: a sequence-classification model with one output (see :func:`score_parts`).
        input_ids: (B, T). attention_mask: (B, T), 1 = real token; any padding side.

    Returns:
        (B,) fp32 scores.
    """
    import torch

    backbone, head = score_parts(model)
    hidden = backbone(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=positions_from_mask(attention_mask),
        use_cache=False,
    ).last_hidden_state  # (B, T, H)
    last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last_token_index(attention_mask)]  # (B, H)
    return head(last).squeeze(-1).float()  # (B,)
