"""Batch collation for SFT: right padding, labels padded with -100 by position.

Shapes: B = rows in the batch, T = longest row (rounded up to ``pad_to_multiple_of``).
"""

from __future__ import annotations

from typing import Any

import torch

from llmtune.data.tokenize import IGNORE_INDEX


class SFTCollator:
    """Pad rows of ``input_ids``/``labels`` (and ``position_ids`` for packed rows) into tensors.

    Padding is decided by position (each row's own length), never by comparing token ids, so a
    tokenizer whose pad token equals EOS keeps the real EOS labels (trl #976).

    Unpacked rows give ``input_ids``, ``attention_mask`` (1 = real token) and ``labels``. Packed rows
    (rows with ``position_ids``) give ``input_ids``, ``labels`` and ``position_ids`` and **no**
    ``attention_mask``: transformers then builds a block-diagonal causal mask from the position ids
    (``find_packed_sequence_indices``); a 2-D mask would disable that and let packed rows attend to each
    other. Padded positions continue the last row's positions; since padding is on the right, no real
    token attends to it, and its labels are -100. Call the model with ``use_cache=False``.

    Args:
        tokenizer: gives ``pad_token_id`` (falls back to ``eos_token_id``, then 0; the value never matters
            for the loss because labels are -100 and the mask excludes padding).
        pad_to_multiple_of: round T up to a multiple of this (e.g. 8 for tensor cores); None = no rounding.
    """

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = None):
        pad = tokenizer.pad_token_id
        if pad is None:
            pad = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        self.pad_token_id = pad
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Collate rows into a batch.

        Args:
            rows: dicts with ``input_ids`` (T_i,) and ``labels`` (T_i,), optionally ``position_ids`` (T_i,);
                lists or 1-D tensors.

        Returns:
            ``input_ids`` (B, T) long, ``labels`` (B, T) long (-100 on padding), and either
            ``attention_mask`` (B, T) long or ``position_ids`` (B, T) long.

        Raises:
            ValueError: empty batch, a row whose labels and ids differ in length, or a batch mixing packed
                and unpacked rows.
        """
        if not rows:
            raise ValueError("SFTCollator got an empty batch")
        packed = ["position_ids" in r for r in rows]
        if any(packed) and not all(packed):
            raise ValueError("batch mixes packed rows (with position_ids) and unpacked rows")
        lengths = [len(r["input_ids"]) for r in rows]
        T = max(lengths)
        if self.pad_to_multiple_of:
            T = -(-T // self.pad_to_multiple_of) * self.pad_to_multiple_of
        B = len(rows)
        input_ids = torch.full((B, T), self.pad_token_id, dtype=torch.long)
        labels = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((B, T), dtype=torch.long)
        position_ids = torch.zeros((B, T), dtype=torch.long) if packed[0] else None
        for b, (row, n) in enumerate(zip(rows, lengths)):
            if len(row["labels"]) != n:
                raise ValueError(f"row {b}: {n} input_ids but {len(row['labels'])} labels")
            input_ids[b, :n] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            labels[b, :n] = torch.as_tensor(row["labels"], dtype=torch.long)
            attention_mask[b, :n] = 1
            if position_ids is not None:
                pos = torch.as_tensor(row["position_ids"], dtype=torch.long)
                position_ids[b, :n] = pos
                last = int(pos[-1]) if n else -1
                position_ids[b, n:] = torch.arange(last + 1, last + 1 + T - n)
        batch = {"input_ids": input_ids, "labels": labels}
        if position_ids is not None:
            batch["position_ids"] = position_ids
        else:
            batch["attention_mask"] = attention_mask
        return batch


class PreferenceCollator:
    """Stack chosen and rejected sequences of preference pairs into one right-padded batch.

    Rows ``0..B-1`` of the batch are the chosen sequences and rows ``B..2B-1`` the rejected ones, in the
    order of the pairs, padded to one common T (one forward pass for both, as DPO/RM stages need).
    Padding is found by position (each sequence's own length, kept in ``attention_mask``), never by
    comparing ids: SmolLM2's pad token equals its EOS (trl #976).

    Args:
        tokenizer: gives ``pad_token_id`` (fallbacks as :class:`SFTCollator`).
        pad_to_multiple_of: round T up to a multiple of this; None = no rounding.
    """

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = None):
        self.pad = SFTCollator(tokenizer, pad_to_multiple_of)

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """Collate pairs into a batch.

        Args:
            rows: B pairs, each with ``chosen_input_ids``/``chosen_labels`` and ``rejected_input_ids``/
                ``rejected_labels`` (lists or 1-D tensors); other keys (``prompt_length``) are ignored.

        Returns:
            ``input_ids`` (2B, T), ``attention_mask`` (2B, T) (1 = real token) and ``labels`` (2B, T)
            (-100 on the prompt and on padding), all long.

        Raises:
            ValueError: empty batch, or a sequence whose labels and ids differ in length.
        """
        if not rows:
            raise ValueError("PreferenceCollator got an empty batch")
        seqs = [
            {"input_ids": r[f"{side}_input_ids"], "labels": r[f"{side}_labels"]}
            for side in ("chosen", "rejected")
            for r in rows
        ]
        return self.pad(seqs)
