"""Peak training memory, estimated before the first step, and the gradient-checkpointing choice made from it.

``train.gradient_checkpointing: auto`` (the default) turns checkpointing OFF when the estimated peak without it fits
the device with a 15 % margin (:data:`MARGIN`) and ON otherwise: recomputing every decoder layer in the backward
costs ~30 % of the step (on an H200, TRL's Llama-3-8B LoRA SFT: 10.7k tokens/s without, 7.5k with), so it is only
worth it when the memory is short. The same rule holds on a CPU, where the "device memory" is the RAM this process
can still get (``MemAvailable`` plus its own resident set, shared by the local ranks).

The estimate (per device, bytes; :func:`estimate_training_memory`) adds:

- weights: every parameter and buffer of the loaded model as stored (dtype and 4/8-bit packing included);
- trainable state: each trainable parameter's gradient and optimizer states (AdamW: two, in the parameter's dtype;
  bitsandbytes 8-bit optimizers: two bytes), sharded by DeepSpeed ZeRO (stage >= 1: optimizer states, >= 2:
  gradients, 3: parameters; plus ZeRO's fp32 master copy of non-fp32 trainable parameters);
- activations saved for the backward, for the largest micro-batch (``micro_batch_size`` rows of the longest
  sequence a stage can build), counted the way Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
  Transformer Models", section 4.1) count them, tensor by tensor, for a Llama-type decoder layer with LoRA and a
  fused attention kernel (SDPA / FlashAttention keep no (T, T) scores; the eager kernel adds ``a T`` per token, their
  ``5 a s / h`` term without dropout). Per token per layer, in elements of the activation dtype::

      6 h  (inputs and outputs of the two norms, rotated q, attention output = o_proj input; 4 h when the norm
            outputs are recomputed, llmtune.core.fused.recompute_norm_outputs)
      + 2 h_kv  (rotated k, v)
      + 2 i  (gate, up; their product is recomputed, llmtune.core.recompute; 4 i without the fused SwiGLU
              of llmtune.core.fused: gate, silu(gate), up, product)
      + r x (LoRA modules of the layer)  (LoRA A outputs; with lora_dropout > 0 also the dropped inputs)

  Under bf16/fp16 autocast with fp32 adapters (half-precision elements): ``4 h`` (each norm keeps an fp32 copy of its
  input) ``+ 2 h`` (norm outputs, unless recomputed) ``+ 2 h + 2 h_kv + 2 i + r x modules``, plus autocast's half
  copies of the LoRA factors (per layer). The LoRA layers share their input
  (llmtune.models.adapters.share_lora_inputs_under_autocast); with peft's own cast each module would keep a copy
  (``+ 6 h + i`` per token per layer for all-linear).

  With full recomputation (their section 4.2, "2 s b h" bytes per layer at 16 bit) a layer keeps only its input,
  ``h`` per token, and the backward recomputes one layer at a time: ``L h + (one layer)`` per token;
- the LM head and loss: the (N, V) fp32 logits of the trained positions (``llmtune.core.lm_head``) plus the final
  norm's input; for the online-RL stages (PPO, GRPO: ``rows x rollout.max_new_tokens`` response positions at most)
  two (M, V) fp32 buffers: the masked head's logits divided by the sampling temperature and the softmax buffer of
  ``TokenLogps`` (``llmtune.rl.model.PolicyModel.response_logps``).

The activation coefficients are checked against the tensors autograd really saves in
``tests/unit/core/test_memory.py`` (within 10 %); weights and trainable state exactly.
"""

from __future__ import annotations

import dataclasses
import os
import resource

import torch

GB = 2**30
MARGIN = 0.85  # `auto` turns checkpointing off only when the estimate without it is <= 85 % of the device memory


@dataclasses.dataclass
class MemoryEstimate:
    """Estimated peak memory of one training step on one device, in bytes (see the module docstring).

    Attributes:
        weights: parameters and buffers as stored. trainable: gradients + optimizer states (+ ZeRO master copy).
        activations: saved for the backward without checkpointing; activations_checkpointed: with it.
        head: LM head logits and loss buffers of one micro-batch. tokens: tokens of the largest micro-batch.
    """

    weights: int
    trainable: int
    activations: int
    activations_checkpointed: int
    head: int
    tokens: int

    def total(self, checkpointing: bool) -> int:
        """Peak bytes with or without gradient checkpointing."""
        acts = self.activations_checkpointed if checkpointing else self.activations
        return self.weights + self.trainable + acts + self.head

    def summary(self) -> dict:
        """GiB figures for logs and lineage."""
        return {"weights_gb": round(self.weights / GB, 3), "trainable_state_gb": round(self.trainable / GB, 3),
                "activations_gb": round(self.activations / GB, 3),
                "activations_checkpointed_gb": round(self.activations_checkpointed / GB, 3),
                "head_gb": round(self.head / GB, 3), "tokens_per_micro_batch": self.tokens,
                "without_checkpointing_gb": round(self.total(False) / GB, 3),
                "with_checkpointing_gb": round(self.total(True) / GB, 3)}


def optimizer_state_bytes(optim: str, param_bytes: int) -> int:
    """Optimizer state bytes per trainable parameter for a transformers ``optim`` name.

    Args:
        optim: ``train.optim`` (``adamw_torch``, ``adamw_8bit``, ``adafactor``, ``sgd``, ...).
        param_bytes: bytes per element of the trainable parameters (torch keeps the states in their dtype).
    """
    name = optim.lower()
    states = 0 if name == "sgd" else 1 if ("lion" in name or "adafactor" in name) else 2
    return states * (1 if "8bit" in name else param_bytes)


def _lora_modules(layer: torch.nn.Module) -> tuple[int, int, int, int]:
    """(LoRA modules, their rank sum, their input features, input features of those with dropout) of one decoder
    layer (peft layers)."""
    count = rank = inputs = dropped = 0
    for module in layer.modules():
        r = getattr(module, "r", None)
        if isinstance(r, dict) and r and hasattr(module, "lora_A"):
            count += 1
            rank += max(r.values())
            inputs += getattr(module, "in_features", 0)
            drop = getattr(module, "lora_dropout", {})
            if any(not isinstance(d, torch.nn.Identity) for d in getattr(drop, "values", lambda: [])()):
                dropped += getattr(module, "in_features", 0)
    return count, rank, inputs, dropped


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks (the largest ModuleList of the model)."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def activation_elements_per_token(model: torch.nn.Module, seq_len: int, autocast: bool = False) -> tuple[float, float]:
    """Activation elements saved per token by ONE decoder layer without checkpointing, and with it (the layer input).

    Args:
        model: the model to train (plain or peft-wrapped), with its adapter attached.
        seq_len: tokens per sequence (only the eager attention's (T, T) scores depend on it).
        autocast: bf16/fp16 mixed precision (autocast) with fp32 adapters: counted in half-precision elements; the
            norms keep an fp32 copy of their input (2 elements each); LoRA layers share their input
            (:func:`llmtune.models.adapters.share_lora_inputs_under_autocast`) unless they drop it out.

    Returns:
        ``(per_layer, per_layer_checkpointed)`` in elements per token (see the module docstring for the terms).
    """
    from llmtune.core.fused import fused_mlps, recomputed_norms

    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    h = config.hidden_size
    heads = getattr(config, "num_attention_heads", 1) or 1
    h_kv = (getattr(config, "num_key_value_heads", None) or heads) * (getattr(config, "head_dim", None) or h // heads)
    i = getattr(config, "intermediate_size", 4 * h) or 4 * h
    layers = _decoder_layers(model)
    fused = bool(layers and fused_mlps(layers[0]))
    norms = max(_hidden_norms(layers[0], h), 2) if layers else 2  # Gemma 3: 4 (before and after attention and MLP)
    norm_outputs = norms * h - (min(recomputed_norms(layers[0]), norms) * h if layers else 0)  # recomputed: not kept
    _, rank, _, dropped = _lora_modules(layers[0]) if layers else (0, 0, 0, 0)
    mlp = (2 if fused else 4) * i  # gate, up (+ silu(gate) and the product; fused: recomputed, core.recompute)
    experts, top_k = _moe_shape(config)
    if experts:  # each token's top-k experts: their input, gate/up, activation, product and output; the router
        i = getattr(config, "moe_intermediate_size", None) or i
        mlp = top_k * (2 * h + 4 * i) + 2 * experts
    if autocast:  # fp32 copies of the norm inputs, norm outputs, q, out; k, v; MLP; a dropped input and its mask
        per_layer = norms * 2 * h + norm_outputs + 2 * h + 2 * h_kv + mlp + dropped * 1.5
    else:  # norm inputs and outputs, q, out; k, v; MLP; a dropped input and its mask (1 byte: ~1/4 at fp32)
        per_layer = norms * h + norm_outputs + 2 * h + 2 * h_kv + mlp + dropped * 1.25
    per_layer += rank  # LoRA A outputs
    attention = getattr(config, "_attn_implementation", None)
    if attention == "eager":
        per_layer += heads * seq_len  # softmax probabilities (B, a, T, T): a T per token
    elif attention == "llmtune_sdpa_varlen":  # padding-free rows: o_proj's input is a concatenated copy
        per_layer += h
    return float(per_layer), float(h)


def _hidden_norms(layer: torch.nn.Module, h: int) -> int:
    """Norm modules of a decoder layer over the hidden state (weight of ``h`` elements; not Qwen3's per-head q/k
    norms)."""
    return sum(1 for m in layer.modules() if "norm" in type(m).__name__.lower()
               and getattr(getattr(m, "weight", None), "numel", lambda: 0)() == h)


def _moe_shape(config) -> tuple[int, int]:
    """(routed experts, experts per token) of a MoE config; (0, 0) for a dense model."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        experts = getattr(config, key, None)
        if isinstance(experts, int) and experts > 1:
            return experts, int(getattr(config, "num_experts_per_tok", 1) or 1)
    return 0, 0


def adapted_expert_bytes(layer: torch.nn.Module) -> int:
    """Bytes of the weights one decoder layer adapts as parameters (MoE experts and router, peft's ``ParamWrapper``):
    each forward materialises ``W + scale * B @ A`` for the whole expert stack and the backward keeps it, one copy per
    layer per forward, however few tokens (0 for a dense model)."""
    total = 0
    for module in layer.modules():
        if type(module).__name__ == "ParamWrapper":
            param = module.get_param()
            total += getattr(param, "ds_numel", param.numel()) * param.element_size()
    return total


def max_sequence_tokens(recipe, data_kind: str) -> tuple[int, int]:
    """(sequences per micro-batch, tokens per sequence) of the largest micro-batch a stage can build.

    SFT: ``micro_batch_size`` rows of ``data.max_length``; pairwise stages: chosen and rejected rows (2x); online RL
    (``prompt``): prompt (``data.max_prompt_length`` or ``max_length``) + ``rollout.max_new_tokens``.
    """
    t, d = recipe.train, recipe.data
    if data_kind == "pairwise":
        return 2 * t.micro_batch_size, d.max_length
    if data_kind == "prompt":
        new = recipe.rollout.max_new_tokens or 0
        return t.micro_batch_size, (d.max_prompt_length or d.max_length) + new
    return t.micro_batch_size, d.max_length


def estimate_training_memory(model: torch.nn.Module, recipe, data_kind: str, zero: int = 0,
                             world_size: int = 1, passes: int = 1) -> MemoryEstimate:
    """Peak memory of one training step on one device (see the module docstring for the terms and the source).

    Args:
        model: the loaded model with its adapter attached (trainable parameters marked), before training.
        recipe: the resolved recipe (micro batch, lengths, precision, optimizer).
        data_kind: the stage's ``data_kind`` (``sft``, ``pairwise``, ``prompt``).
        zero: DeepSpeed ZeRO stage (0 = none); world_size: ranks it shards over.
        passes: forwards through the body kept for one backward (PPO: 2, the policy and the value adapter).

    Returns:
        A :class:`MemoryEstimate` (bytes).
    """
    # ZeRO-3 partitioned parameters hold their full size in ds_numel (numel() is this rank's 0 or shard)
    weights = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    trainable = [p for p in model.parameters() if p.requires_grad]
    n_train = sum(getattr(p, "ds_numel", p.numel()) for p in trainable)
    grads = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in trainable)
    elem = trainable[0].element_size() if trainable else 4
    states = n_train * optimizer_state_bytes(recipe.train.optim, elem)
    master = n_train * 4 if zero and elem != 4 else 0
    world = max(world_size, 1)
    if zero >= 1:
        states, master = states // world, master // world
    if zero >= 2:
        grads //= world
    if zero >= 3:
        weights //= world

    rows, seq_len = max_sequence_tokens(recipe, data_kind)
    tokens = rows * seq_len
    half = recipe.precision.bf16 or recipe.precision.fp16
    float_params = [p for p in model.parameters() if p.is_floating_point()]
    act_bytes = 2 if half else (float_params[0].element_size() if float_params else 4)
    autocast = bool(half and not zero and elem == 4)  # DeepSpeed runs bf16/fp16 weights, adapters included
    per_layer, per_layer_ckpt = activation_elements_per_token(model, seq_len, autocast=autocast)
    layers = _decoder_layers(model)
    n_layers = len(layers) or getattr(model.config, "num_hidden_layers", 1)
    h, vocab = model.config.hidden_size, model.config.vocab_size
    activations = int(tokens * act_bytes * n_layers * per_layer * passes)
    if autocast and layers:  # autocast's half copies of the LoRA factors, kept for the backward of each layer
        activations += n_layers * 2 * sum(p.numel() for p in layers[0].parameters() if p.requires_grad)
    merged = adapted_expert_bytes(layers[0]) if layers else 0  # per layer, whatever the tokens (MoE experts)
    activations += n_layers * merged * passes
    activations_ckpt = int(tokens * act_bytes * (n_layers * per_layer_ckpt * passes + per_layer)) + merged
    head_rows = rows * (recipe.rollout.max_new_tokens or 0) if data_kind == "prompt" else tokens
    copies = 2 if data_kind == "prompt" else 1  # RL: logits / temperature + the softmax buffer (lm_head.py)
    head = int(head_rows * vocab * 4 * copies + tokens * act_bytes * h)  # + the final norm's input
    return MemoryEstimate(weights=int(weights), trainable=int(grads + states + master), activations=activations,
                          activations_checkpointed=activations_ckpt, head=head, tokens=tokens)


def _self_status_bytes(key: str) -> int:
    """A ``kB`` field of /proc/self/status (``VmRSS``, ``VmHWM``) in bytes.

    Raises:
        OSError: no /proc (not Linux). StopIteration: no such field. ValueError: a field that is not a number.
    """
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def device_memory_bytes() -> int:
    """Memory this process can use for training: the CUDA device's total, else the RAM it can still get
    (``MemAvailable`` + its own resident set) divided by the ranks on this node."""
    if torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, value = line.split(":", 1)
                info[key] = int(value.split()[0]) * 1024
        rss = _self_status_bytes("VmRSS")
    except (OSError, StopIteration, ValueError):
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return int((info.get("MemAvailable", info.get("MemTotal", 0)) + rss) / max(local, 1))


def reset_peak_memory() -> None:
    """Start a new peak for :func:`peak_memory_gb`, called when a stage starts (:func:`llmtune.core.runner.run_stage`).

    Without it a stage that runs after another in the same process (``llmtune pipeline`` runs its steps in one
    process) would report the earlier stage's peak: CUDA's ``max_memory_allocated`` and the process's peak resident
    set only grow. CUDA: ``torch.cuda.reset_peak_memory_stats`` on this rank's device (``LOCAL_RANK``). CPU: the
    process's peak resident set (``VmHWM``, which ``ru_maxrss`` follows) is reset by writing 5 to
    ``/proc/self/clear_refs`` (Linux >= 4.0, proc(5)); where that file is missing or read-only the CPU peak stays the
    process's since it started.
    """
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats(int(os.environ.get("LOCAL_RANK", "0") or 0) % torch.cuda.device_count())
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_gb() -> float:
    """Peak memory (GiB) since the last :func:`reset_peak_memory` (else since the process started): on CUDA the
    tensors allocated on the current device (``torch.cuda.max_memory_allocated``), else the process's peak resident
    set size (``VmHWM``; ``ru_maxrss`` where /proc is not readable)."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / GB
    try:
        return _self_status_bytes("VmHWM") / GB
    except (OSError, StopIteration, ValueError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def choose_checkpointing(setting: bool | str, estimate: MemoryEstimate, device_bytes: int) -> tuple[bool, str]:
    """Whether to checkpoint, and why.

    Args:
        setting: ``train.gradient_checkpointing`` (``True``, ``False`` or ``"auto"``).
        estimate: from :func:`estimate_training_memory`. device_bytes: from :func:`device_memory_bytes`.

    Returns:
        ``(on, reason)``; ``auto`` is off when the estimate without checkpointing is <= :data:`MARGIN` x the device
        memory, else on.
    """
    without, with_ = estimate.total(False), estimate.total(True)
    budget = MARGIN * device_bytes
    if setting is True or setting is False:
        return setting, "train.gradient_checkpointing is set in the recipe"
    if without <= budget:
        return False, (f"auto: {without / GB:.2f} GiB without it fits in {MARGIN:.0%} of the "
                       f"{device_bytes / GB:.1f} GiB device memory (recomputation would only slow the steps)")
    tail = "" if with_ <= budget else (
        f"; even with it the estimate ({with_ / GB:.2f} GiB) exceeds {MARGIN:.0%} of the device: lower "
        "train.micro_batch_size or data.max_length, or use model.load_in_4bit / a higher ZeRO stage")
    return True, (f"auto: {without / GB:.2f} GiB without it exceeds {MARGIN:.0%} of the {device_bytes / GB:.1f} GiB "
                  f"device memory{tail}")


def _size(n: int) -> str:
    return f"{n / GB:.2f} GiB" if n >= GB / 10 else f"{n / 2**20:.1f} MiB"


def describe(estimate: MemoryEstimate, device_bytes: int, on: bool, reason: str) -> str:
    """The one line printed before training."""
    return (f"memory estimate per device: {_size(estimate.total(False))} without gradient checkpointing, "
            f"{_size(estimate.total(True))} with it (weights {_size(estimate.weights)}, grads + optimizer "
            f"{_size(estimate.trainable)}, LM head {_size(estimate.head)}; {estimate.tokens} tokens per "
            f"micro-batch); device memory {device_bytes / GB:.1f} GiB; gradient checkpointing "
            f"{'ON' if on else 'OFF'} ({reason})")
