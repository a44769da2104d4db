"""Padding-free SFT batches: the rows of a micro-batch concatenated into one sequence, attention row by row.

A right-padded (B, T) batch spends ``B * T - sum(lengths)`` positions on padding (~20 % for random GSM8K batches):
every linear layer, norm and activation runs on them. Here the B rows become one (1, sum(lengths)) sequence whose
``position_ids`` restart at 0 at every row, and the attention kernel ``llmtune_sdpa_varlen`` runs SDPA causally on
each row's slice (found from the position ids), so no token attends across rows and no (L, L) mask over the whole
sequence is computed. The first token of every row gets label -100 (in the padded layout it is never a target
either), so the trained tokens and the loss are the same as with padding, up to float rounding
(tests/unit/core/test_padding_free.py). Batches that are not packed (B > 1 with an attention mask, generation with
a cache) go to transformers' own SDPA unchanged.

Shapes: B = rows, L = tokens of the concatenated sequence, H = heads, D = head size.
"""

from __future__ import annotations

from typing import Any

import torch

from llmtune.core.ops import IGNORE_INDEX

ATTENTION = "llmtune_sdpa_varlen"


def row_starts(position_ids: torch.Tensor) -> list[int]:
    """Start offsets of the rows of a packed (1, L) sequence (where the position id is 0), plus L at the end."""
    starts = torch.nonzero(position_ids[0] == 0).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0, *starts]
    return [*starts, position_ids.shape[-1]]


def varlen_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention of transformers' interface (``ALL_ATTENTION_FUNCTIONS``): query (1, H, L, D), key/value (1, H_kv, L,
    D) of a packed sequence -> (1, L, H, D), causal within each row (rows from ``position_ids``). Anything else
    (B > 1, no position ids, a single row) is transformers' SDPA with the mask it built."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.get("position_ids")
    if query.shape[0] != 1 or position_ids is None or position_ids.shape[-1] != query.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    bounds = row_starts(position_ids)
    if len(bounds) <= 2:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k != "is_causal"}
    window = kwargs.get("sliding_window") or None  # this layer's window (Mistral, Gemma 3, ...; None: full causal)
    outs = [
        sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                               window_mask(e - s, window, query.device), dropout=dropout, scaling=scaling,
                               is_causal=True, **kwargs)[0]
        for s, e in zip(bounds, bounds[1:])
    ]
    return torch.cat(outs, dim=1), None


def window_mask(length: int, window: int | None, device=None) -> torch.Tensor | None:
    """(1, 1, length, length) bool mask of causal attention within a sliding window (query i sees key j when
    ``0 <= i - j < window``, transformers' ``sliding_window_overlay``), or None when the row fits the window (plain
    causal attention is then the same)."""
    if window is None or length <= window:
        return None
    i = torch.arange(length, device=device)
    distance = i[:, None] - i[None, :]
    return ((distance >= 0) & (distance < window))[None, None]


def register() -> str:
    """Register ``llmtune_sdpa_varlen`` with transformers (attention and mask functions; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, varlen_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)  # padded batches get SDPA's mask as before
    return ATTENTION


@torch.no_grad()
def isolates_packed_rows(model: torch.nn.Module) -> bool:
    """Whether ``model`` keeps the rows of a packed (1, L) sequence apart when it gets their ``position_ids`` and no
    attention mask (what padding-free batches and ``data.packing`` rely on), asked of the model itself: the logits of
    the second of two 3-token rows, packed, against that row alone (two forwards of <= 6 tokens). SDPA models run
    ``llmtune_sdpa_varlen`` (always True); other kernels rely on transformers finding the rows from the position
    ids, which some model code does not do (gpt-oss builds its masks without them).

    Args:
        model: the loaded ``PreTrainedModel`` (not partitioned by ZeRO-3: its forward needs whole weights).
    """
    vocab = int(getattr(model.config.get_text_config(), "vocab_size", 8) or 8)
    device = next(model.parameters()).device
    ids = (torch.arange(6, device=device) * 7 + 3).remainder(vocab)[None]  # (1, 6): two rows of 3 tokens
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]], device=device)
    was_training = model.training
    model.eval()
    try:
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits[0, 3:].float()
        alone = model(input_ids=ids[:, 3:], position_ids=positions[:, 3:], use_cache=False).logits[0].float()
    finally:
        model.train(was_training)
    scale = float(alone.abs().max()) or 1.0
    return bool(torch.allclose(packed, alone, rtol=1e-2, atol=1e-3 * scale))


def use_varlen_attention(model: torch.nn.Module) -> bool:
    """Switch a model that runs SDPA to ``llmtune_sdpa_varlen`` (same results on padded batches); False if it runs
    another kernel (eager, flash, flex), which is then left as it is."""
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    register()
    for sub in {id(c): c for c in (config, *(getattr(config, k, None) for k in getattr(config, "sub_configs", {})))
                }.values():
        if sub is not None and getattr(sub, "_attn_implementation", None) == "sdpa":
            sub._attn_implementation = ATTENTION
    return True


class PaddingFreeCollator:
    """Concatenate the rows of a micro-batch into one (1, L) sequence with per-row ``position_ids``.

    ``padded``: a padding collator to use instead (set once the model is known not to keep packed rows apart,
    :func:`isolates_packed_rows`); None = padding-free.

    Args:
        rows: dicts with ``input_ids`` and ``labels`` (T_i,), lists or 1-D tensors (rows already packed by
            ``data.packing`` carry their own ``position_ids`` and are concatenated as they are).

    Returns:
        ``input_ids``, ``labels``, ``position_ids`` and ``row_index`` (the batch row each token comes from, for
        per-row evaluation statistics), each (1, L) long with L = sum of the row lengths; no ``attention_mask``
        (every position is a real token). Labels: the rows' own, with -100 at the first token of every row (a row's
        first token is not predicted from the previous row).

    Raises:
        ValueError: empty batch, or a row whose labels and ids differ in length.
    """

    padded = None

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.padded is not None:
            return self.padded(rows)
        if not rows:
            raise ValueError("PaddingFreeCollator got an empty batch")
        ids, labels, positions, index = [], [], [], []
        for b, row in enumerate(rows):
            row_ids = torch.as_tensor(row["input_ids"], dtype=torch.long)
            row_labels = torch.as_tensor(row["labels"], dtype=torch.long).clone()
            if len(row_labels) != len(row_ids):
                raise ValueError(f"row {b}: {len(row_ids)} input_ids but {len(row_labels)} labels")
            if "position_ids" in row:
                pos = torch.as_tensor(row["position_ids"], dtype=torch.long)
            else:
                pos = torch.arange(len(row_ids))
            row_labels[pos == 0] = IGNORE_INDEX
            ids.append(row_ids)
            labels.append(row_labels)
            positions.append(pos)
            index.append(torch.full_like(row_ids, b))
        return {"input_ids": torch.cat(ids)[None], "labels": torch.cat(labels)[None],
                "position_ids": torch.cat(positions)[None], "row_index": torch.cat(index)[None]}
