"""Model FLOPs per trained token and the device's peak, for the MFU in ``metrics.jsonl``.

Convention of Kaplan et al. 2020 / Chowdhury et al. 2022 (PaLM, appendix B): matrix multiplies only, recomputation
(gradient checkpointing) NOT counted, so MFU compares setups doing the same model work. Per processed token with
``N`` = weights of every linear layer (LM head included; of MoE experts, the ones a token is routed to), ``N_t`` = trainable ones among them, ``L`` layers,
``d`` hidden size and ``T`` tokens per sequence: forward ``2N + 4 L T d`` (attention scores and values), backward
through the activations the same again, plus ``2 N_t`` for the weight gradients; a frozen reference forward
(DPO) adds one more forward; PPO's value model (a second adapter on the same base, without the LM head) adds one more
forward and backward through the body. Sampling (PPO, GRPO rollouts) costs a forward per generated token with a KV
cache: ``2N + 4 L c d``, ``c`` = the tokens it attends to (prompt + half the completion on average).
"""

from __future__ import annotations

import os

import torch

# Dense bf16/fp16 tensor-core peak TFLOP/s by device name (vendor data sheets, SXM/PCIe as named).
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10G": 125.0,
                   "A10": 125.0, "RTX 4090": 165.0, "RTX 3090": 71.0, "V100": 125.0, "T4": 65.0}


def linear_weights(model: torch.nn.Module) -> tuple[int, int]:
    """(all, trainable) weights of the matrix-multiply parameters of ``model`` that one token goes through: every
    2-D one (LoRA factors included) and, of MoE experts stacked in a 3-D parameter (experts, in, out), the
    ``num_experts_per_tok`` experts a token is routed to."""
    config = getattr(getattr(model, "policy", model), "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    top_k = int(getattr(text, "num_experts_per_tok", 1) or 1)
    total = trainable = 0
    for p in model.parameters():
        shape = getattr(p, "ds_shape", p.shape)  # DeepSpeed ZeRO-3 keeps the full shape there
        if len(shape) == 2:
            n = getattr(p, "ds_numel", p.numel())
            n = n * 2 if hasattr(p, "quant_state") else n  # bitsandbytes 4-bit packs two weights per byte
        elif len(shape) == 3:  # (experts, in, out): the routed experts only
            n = min(top_k, shape[0]) * shape[1] * shape[2]
        else:
            continue
        total += n
        trainable += n if p.requires_grad else 0
    inner = getattr(model, "policy", model)  # online RL: the peft policy inside llmtune.rl.model.PolicyModel
    embeddings = getattr(inner, "get_input_embeddings", lambda: None)()
    if embeddings is not None and getattr(embeddings, "weight", None) is not None:
        out = getattr(inner, "get_output_embeddings", lambda: None)()
        tied = out is not None and out.weight is embeddings.weight
        if not tied:  # an embedding lookup is not a matmul; a tied one is the LM head as well
            total -= embeddings.weight.numel()
            trainable -= embeddings.weight.numel() if embeddings.weight.requires_grad else 0
    return total, max(trainable, 0)


def forward_flops_per_token(model: torch.nn.Module, seq_len: float) -> float:
    """Model FLOPs of one forward per token: ``2N + 4 L T d`` (see the module docstring).

    Args:
        model: plain, peft-wrapped or an online-RL policy wrapper. seq_len: tokens attended to (T).
    """
    n, _ = linear_weights(model)
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    hidden = getattr(config, "hidden_size", 0) or 0
    return 2 * n + 4 * layers * seq_len * hidden


def train_flops_per_token(model: torch.nn.Module, seq_len: float, reference_forward: bool = False,
                          value_forward: bool = False) -> float:
    """Model FLOPs per processed token of one training step (see the module docstring).

    Args:
        model: the trained model (peft-wrapped or plain). seq_len: mean tokens per sequence.
        reference_forward: a frozen reference forward per step (DPO without precomputed reference log-probs).
        value_forward: a value-model forward and backward through the body per step (PPO).
    """
    _, n_trainable = linear_weights(model)
    forward = forward_flops_per_token(model, seq_len)
    out = 2 * forward + 2 * n_trainable + (forward if reference_forward else 0)
    if value_forward:
        config = getattr(model, "config", None)
        head = (getattr(config, "vocab_size", 0) or 0) * (getattr(config, "hidden_size", 0) or 0)
        out += 2 * (forward - 2 * head)
    return out


def peak_tflops() -> float | None:
    """Peak dense TFLOP/s of this process's device: ``LLMTUNE_PEAK_TFLOPS``, else the GPU table; None when unknown
    (CPUs: set the variable to get an MFU)."""
    env = os.environ.get("LLMTUNE_PEAK_TFLOPS")
    if env:
        return float(env)
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        return next((v for k, v in GPU_PEAK_TFLOPS.items() if k in name), None)
    return None
