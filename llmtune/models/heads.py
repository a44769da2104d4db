"""Score heads: one scalar per sequence, read at the last REAL token of each row.

transformers' ``*ForSequenceClassification.forward`` finds the token to read by comparing ids with
``config.pad_token_id``. When pad == EOS (SmolLM2, Llama setups that reuse EOS as pad) that is wrong for a row
whose text contains or ends with EOS, and it does not know about left padding. Here the last real token is
found from the attention mask, the backbone runs with position ids counted from the mask, and the head is
applied at that one position, so a left-padded, a right-padded and an unpadded row get the same score.

Shapes: B = rows, T = tokens per row (padded), H = hidden size.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)
ADDED_PAD_TOKEN = "<|llmtune_pad|>"  # added by export when the vocabulary has no unused token to pad with


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


def use_dedicated_pad(model: nn.Module, tokenizer, *, add: bool = False) -> bool:
    """Switch ``tokenizer`` and ``model.config`` to a pad token no sequence contains, in place.

    transformers' ``*ForSequenceClassification`` reads the score at the last token that is not
    ``config.pad_token_id``; with pad == EOS it reads a sequence ending in EOS one token early. With the pad from
    :func:`llmtune.data.templates.dedicated_pad_token` (an existing unused special token: no resize) it reads the
    last real token of unpadded, right-padded and left-padded rows, as llmtune does.

    Args:
        model: the reward model (its input embedding rows bound the pad id).
        tokenizer: its tokenizer (saved with the model).
        add: when no existing token fits, add :data:`ADDED_PAD_TOKEN` to the tokenizer and, if the embedding has
            no row for it, resize the embeddings by the new rows (they are only ever read at masked positions).

    Returns:
        ``True`` when the pad is dedicated afterwards; ``False`` when no token fits and ``add`` is off.
    """
    from llmtune.data.templates import dedicated_pad_token

    rows = model.get_input_embeddings().weight.shape[0]
    token = dedicated_pad_token(tokenizer, rows)
    if token is None and add:
        tokenizer.add_special_tokens({"pad_token": ADDED_PAD_TOKEN})
        if len(tokenizer) > rows:
            model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
        token = ADDED_PAD_TOKEN
    if token is None:
        logger.warning("no unused token to pad with (the pad %r occurs in sequences); llmtune export adds one",
                       tokenizer.pad_token)
    elif token != tokenizer.pad_token:
        logger.info("pad token %r -> %r: no sequence contains it, so transformers reads reward scores at the last "
                    "real token", tokenizer.pad_token, token)
        tokenizer.pad_token = token
    model.config.pad_token_id = tokenizer.pad_token_id
    return token is not None
