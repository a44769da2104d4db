"""Pack tokenized rows into sequences of at most ``max_length`` tokens (``data.packing: true``).

Rows are placed best-fit-decreasing (longest first, each into the fullest sequence it still fits), so
few tokens are wasted on padding. Each packed sequence carries ``position_ids`` that restart at 0 for
every row. Transformers (sdpa, eager, flex, flash-attention) detects packed rows from those position
ids **when no attention_mask is passed** and no KV cache is used (``find_packed_sequence_indices`` in
``transformers/masking_utils.py``), so rows do not attend to each other: the packed logits of a row
equal its logits alone (tested). :class:`~llmtune.data.collators.SFTCollator` therefore emits no
``attention_mask`` for packed batches; the model must be called with ``use_cache=False``.

Labels: the first token of every packed row gets label -100. A causal-LM loss predicts ``labels[t]``
from position ``t - 1``, which for a row's first token is the previous row's last token, so no
cross-row prediction is trained. (Unpacked, the label at position 0 is never used either, so packing
does not change which predictions are trained.)
"""

from __future__ import annotations

from bisect import bisect_left, insort

from llmtune.data.tokenize import IGNORE_INDEX


def pack_rows(rows: list[tuple[list[int], list[int]]], max_length: int) -> list[dict[str, list[int]]]:
    """Pack ``(input_ids, labels)`` rows into sequences.

    Args:
        rows: tokenized rows, each of length <= ``max_length``.
        max_length: maximum tokens per packed sequence.

    Returns:
        Packed sequences ``{"input_ids", "labels", "position_ids"}``, each (T,) with T <= ``max_length``.
        Rows keep their relative order inside a sequence; the result is deterministic.

    Raises:
        ValueError: a row is longer than ``max_length``.
    """
    order = sorted(range(len(rows)), key=lambda k: (-len(rows[k][0]), k))
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (tokens still free, bin index), sorted
    for k in order:
        n = len(rows[k][0])
        if n > max_length:
            raise ValueError(f"row of {n} tokens does not fit max_length {max_length}; truncate or drop it first")
        j = bisect_left(free, (n, -1))
        if j < len(free):
            room, b = free.pop(j)
            bins[b].append(k)
        else:
            room, b = max_length, len(bins)
            bins.append([k])
        if room - n > 0:
            insort(free, (room - n, b))
    packed = []
    for members in bins:
        seq: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
        for k in sorted(members):
            ids, labels = rows[k]
            seq["input_ids"] += ids
            seq["labels"] += [IGNORE_INDEX, *labels[1:]]
            seq["position_ids"] += range(len(ids))
        packed.append(seq)
    return packed
