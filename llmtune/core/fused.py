"""SwiGLU ``silu(gate) * up`` as one autograd function that keeps 2 of the 3 tensors autograd keeps for it.

Llama-family MLPs compute ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: autograd saves ``gate`` (for the SiLU),
``silu(gate)`` and ``up`` (for the product), three (tokens, intermediate) tensors per layer, the largest activations
of a LoRA step. :class:`SwiGLU` saves ``gate`` and ``up`` and recomputes the sigmoid in the backward (the SiLU
backward computes it anyway), so a step keeps ~15 % less activation memory for the same gradients
(tests/unit/core/test_fused.py). :func:`fuse_swiglu` switches the MLPs of a model whose forward is exactly that
expression with a SiLU; any other MLP is left alone.
"""

from __future__ import annotations

import functools
import inspect
import types

import torch
import torch.nn.functional as F

PATTERN = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"


class SwiGLU(torch.autograd.Function):
    """``silu(gate) * up`` for tensors of one shape; gradients ``d_up = g * silu(gate)`` and
    ``d_gate = g * up * s * (1 + gate * (1 - s))`` with ``s = sigmoid(gate)`` (Shazeer 2020, GLU variants)."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return _product(gate, up)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_up = grad * silu if ctx.needs_input_grad[1] else None
        d_gate = None
        if ctx.needs_input_grad[0]:
            d_gate = grad * up * (sig + silu * (1 - sig))  # d silu / d gate = s + gate * s * (1 - s)
        return d_gate, d_up


def _product(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _swiglu_forward(self, x):
    from llmtune.core.recompute import register

    gate, up = self.gate_proj(x), self.up_proj(x)
    product = SwiGLU.apply(gate, up)
    # down_proj's LoRA A keeps its input for its weight gradient: recomputed from gate and up, which SwiGLU keeps
    register(product, functools.partial(_product, gate.detach(), up.detach()))
    return self.down_proj(product)


@functools.lru_cache(maxsize=None)
def _is_swiglu_class(cls: type) -> bool:
    try:
        return PATTERN in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _is_silu(act) -> bool:
    from transformers.activations import SiLUActivation

    return isinstance(act, (torch.nn.SiLU, SiLUActivation))


def fuse_swiglu(model: torch.nn.Module) -> int:
    """Give every SiLU-gated MLP of ``model`` (call before attaching the adapter) the :class:`SwiGLU` forward.

    Returns:
        The number of MLP modules switched (0 for models whose MLPs differ: GELU, biases in the product, MoE...).
    """
    switched = 0
    for module in model.modules():
        act = getattr(module, "act_fn", None)
        if act is not None and _is_silu(act) and _is_swiglu_class(type(module)):
            module.forward = types.MethodType(_swiglu_forward, module)
            switched += 1
    return switched


def fused_mlps(model: torch.nn.Module) -> int:
    """The number of MLP modules of ``model`` that run the :class:`SwiGLU` forward (see :func:`fuse_swiglu`)."""
    return sum(getattr(m.forward, "__func__", None) is _swiglu_forward for m in model.modules())
