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
    outs = [
        sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, dropout=dropout,
                               scaling=scaling, is_causal=True, **kwargs)[0]
        for s, e in zip(bounds, bounds[1:])
    ]
    return torch.cat(outs, dim=1), None


def register() -> str:
    """Register ``llmtune_sdpa_varlen`` with transformers (attention and mask functions; idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION, varlen_sdpa_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)  # padded batches get SDPA's mask as before
    return ATTENTION


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

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
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
