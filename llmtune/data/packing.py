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
from collections.abc import Iterable, Sequence

import numpy as np

from llmtune.data.tokenize import IGNORE_INDEX


def pack_plan(lengths: Sequence[int], max_length: int) -> list[np.ndarray]:
    """Best-fit-decreasing bins of row indices (each bin's rows hold at most ``max_length`` tokens together).

    Memory: int arrays over the rows plus the list of bins that still have room, so 10^7 rows plan in ~1 GiB.

    Args:
        lengths: tokens of each row, each <= ``max_length``.
        max_length: maximum tokens per packed sequence.

    Returns:
        One ascending int64 array of row indices per packed sequence, in the order the sequences are opened
        (deterministic; views into one array).

    Raises:
        ValueError: a row is longer than ``max_length``.
    """
    sizes = np.asarray(lengths, dtype=np.int64)
    if sizes.size and sizes.max() > max_length:
        n = int(sizes.max())
        raise ValueError(f"row of {n} tokens does not fit max_length {max_length}; truncate or drop it first")
    order = np.argsort(-sizes, kind="stable")  # longest first, ties in row order
    bin_of = np.empty(len(sizes), dtype=np.int64)
    n_bins = 0
    free: list[tuple[int, int]] = []  # (tokens still free, bin index), sorted
    for k, n in zip(order.tolist(), sizes[order].tolist()):
        j = bisect_left(free, (n, -1))
        if j < len(free):
            room, b = free.pop(j)
        else:
            room, b = max_length, n_bins
            n_bins += 1
        bin_of[k] = b
        if room - n > 0:
            insort(free, (room - n, b))
    members = np.argsort(bin_of, kind="stable")  # by bin, rows ascending inside a bin
    bounds = np.searchsorted(bin_of[members], np.arange(n_bins + 1))
    return [members[bounds[b] : bounds[b + 1]] for b in range(n_bins)]


def pack_sequence(rows: Iterable[tuple[list[int], list[int]]]) -> dict[str, list[int]]:
    """One packed sequence ``{"input_ids", "labels", "position_ids"}`` of the ``(input_ids, labels)`` rows of a bin,
    in order (each row's first label -100, positions restarting at 0)."""
    seq: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}
    for ids, labels in rows:
        seq["input_ids"] += ids
        seq["labels"] += [IGNORE_INDEX, *labels[1:]]
        seq["position_ids"] += range(len(ids))
    return seq


def pack_rows(rows: list[tuple[list[int], list[int]]], max_length: int) -> list[dict[str, list[int]]]:
    """Pack ``(input_ids, labels)`` rows into sequences (:func:`pack_plan`, then :func:`pack_sequence` per bin).

    Args:
        rows: tokenized rows, each of length <= ``max_length``.
        max_length: maximum tokens per packed sequence.

    Returns:
        Packed sequences ``{"input_ids", "labels", "position_ids"}``, each (T,) with T <= ``max_length``.
        Rows keep their relative order inside a sequence; the result is deterministic.

    Raises:
        ValueError: a row is longer than ``max_length``.
    """
    plan = pack_plan([len(r[0]) for r in rows], max_length)
    return [pack_sequence(rows[k] for k in members.tolist()) for members in plan]
