"""Activations that are cheap to recompute are kept for the backward as a recipe, not as a tensor.

The SwiGLU product ``silu(gate) * up`` of a LoRA decoder layer (the input of ``down_proj``, one (tokens,
intermediate) tensor per layer, the largest activation with ``gate`` and ``up``) is saved only because
``down_proj``'s LoRA ``A`` matrix needs its input for its weight gradient, although it is an elementwise function
of ``gate`` and ``up``, which :class:`llmtune.core.fused.SwiGLU` keeps anyway.

Inside :func:`recompute_cheap_activations` (the core's training forward) such a tensor, once announced with
:func:`register`, is packed by a ``torch.autograd.graph.saved_tensors_hooks`` pack hook as the function that makes
it again, and recomputed when the backward unpacks it: bit-identical values (the same operation on the same
tensors), so the same gradients, and one (tokens, intermediate) tensor less per layer (the selective recomputation
of Korthikanti et al. 2022, section 5, applied to an elementwise op only: no matmul is redone). Inside
gradient-checkpointed layers the checkpoint's own hooks take precedence and nothing changes.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable, Iterator

import torch

_registry: dict[int, tuple[weakref.ref, Callable[[], torch.Tensor]]] | None = None


class _Recipe:
    __slots__ = ("fn", "size", "stride", "offset")

    def __init__(self, fn, size, stride, offset):
        self.fn, self.size, self.stride, self.offset = fn, size, stride, offset


def register(tensor: torch.Tensor, fn: Callable[[], torch.Tensor]) -> None:
    """Announce that ``fn()`` (no grad) returns a tensor equal to ``tensor``, laid out the same (contiguous). A no-op
    outside :func:`recompute_cheap_activations`; ``fn`` must only hold tensors the backward keeps anyway."""
    if _registry is not None and tensor.is_contiguous():  # (a first norm's output needs no grad, yet is saved)
        _registry[tensor.untyped_storage().data_ptr()] = (weakref.ref(tensor), fn)


def _pack(t: torch.Tensor):
    entry = _registry.get(t.untyped_storage().data_ptr()) if _registry else None
    if entry is not None:
        source = entry[0]()
        # alive, so its storage cannot have been reused by another tensor; same dtype: not a cast copy
        if source is not None and source.dtype == t.dtype and \
                source.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
            return _Recipe(entry[1], t.size(), t.stride(), t.storage_offset())
    return t


def _unpack(x):
    if isinstance(x, _Recipe):
        with torch.no_grad():
            return x.fn().as_strided(x.size, x.stride, x.offset)
    return x


@contextlib.contextmanager
def recompute_cheap_activations() -> Iterator[None]:
    """Within: tensors announced with :func:`register` are saved for the backward as their recipe (reentrant-safe)."""
    global _registry
    if _registry is not None:  # already inside
        yield
        return
    _registry = {}
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _registry = None
