"""SwiGLU ``silu(gate) * up`` as one autograd function that keeps 2 of the 3 tensors autograd keeps for it.

Llama-family MLPs compute ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``: autograd saves ``gate`` (for the SiLU),
``silu(gate)`` and ``up`` (for the product), three (tokens, intermediate) tensors per layer, the largest activations
of a LoRA step. :class:`SwiGLU` saves ``gate`` and ``up`` and recomputes the sigmoid in the backward (the SiLU
backward computes it anyway), so a step keeps ~15 % less activation memory for the same gradients
(tests/unit/core/test_fused.py). :func:`fuse_swiglu` switches the MLPs of a model whose forward is exactly that
expression with a SiLU; any other MLP is left alone. :func:`recompute_norm_outputs` gives Llama-style RMSNorms a
forward whose output is recomputed in the backward (:mod:`llmtune.core.recompute`).
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


# ---- RMSNorm whose output is recomputed in the backward -------------------------------------------------------------
RMSNORM_LINES = ("variance = hidden_states.pow(2).mean(-1, keepdim=True)",
                 "hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)",
                 "return self.weight * hidden_states.to(input_dtype)")


def _norm_output(weight: torch.Tensor, x: torch.Tensor, rstd: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return weight * (x * rstd).to(dtype)


def _rmsnorm_forward(self, hidden_states):
    from llmtune.core.recompute import register

    input_dtype = hidden_states.dtype
    x = hidden_states.to(torch.float32)
    variance = x.pow(2).mean(-1, keepdim=True)
    rstd = torch.rsqrt(variance + self.variance_epsilon)
    out = self.weight * (x * rstd).to(input_dtype)
    # the LoRA A matrices of the next linear layers keep this output for their weight gradients: recomputed from
    # the fp32 input and rstd, which the norm's own backward keeps anyway (bit-identical: the same operations)
    register(out, functools.partial(_norm_output, self.weight.detach(), x.detach(), rstd.detach(), input_dtype))
    return out


@functools.lru_cache(maxsize=None)
def _is_rmsnorm_class(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return all(line in source for line in RMSNORM_LINES)


def recompute_norm_outputs(model: torch.nn.Module) -> int:
    """Give every Llama-style RMSNorm of ``model`` (transformers' ``weight * (x * rsqrt(mean(x^2) + eps))`` with an
    fp32 computation) a forward whose output is recomputed in the backward instead of kept
    (:mod:`llmtune.core.recompute`): one (tokens, hidden) tensor less per norm for a LoRA model.

    Returns:
        The number of norm modules switched (others, e.g. Gemma's ``1 + weight``, are left alone).
    """
    switched = 0
    for module in model.modules():
        if hasattr(module, "variance_epsilon") and _is_rmsnorm_class(type(module)):
            module.forward = types.MethodType(_rmsnorm_forward, module)
            switched += 1
    return switched


def recomputed_norms(model: torch.nn.Module) -> int:
    """The number of norm modules of ``model`` switched by :func:`recompute_norm_outputs`."""
    return sum(getattr(m.forward, "__func__", None) is _rmsnorm_forward for m in model.modules())


def fused_mlps(model: torch.nn.Module) -> int:
    """The number of MLP modules of ``model`` that run the :class:`SwiGLU` forward (see :func:`fuse_swiglu`)."""
    return sum(getattr(m.forward, "__func__", None) is _swiglu_forward for m in model.modules())
