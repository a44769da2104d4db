"""Generation backends: how online RL samples completions. One interface, so that a faster engine (vLLM on GPUs)
can replace transformers' ``generate`` without touching the stages.

A backend turns (B, P) left-padded prompts into (B, P + N) sequences; everything after a row's first EOS is padding
(``rollout.split_generation`` masks it). Sampling settings come from the stage's section (``temperature``,
``top_p``, ``top_k``); ``greedy`` is the evaluation path.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from llmtune.models.adapters import adapter_scope
from llmtune.rl.model import POLICY


class GenerationBackend(Protocol):
    """What the online-RL trainer calls to sample completions."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 greedy: bool) -> torch.Tensor:
        """(B, P) left-padded prompts + mask -> (B, P + N) sequences (N <= max_new_tokens)."""
        ...


def mergeable_lora_layers(model: torch.nn.Module, adapter: str) -> list | None:
    """The LoRA layers of ``adapter`` when all of them can be merged exactly for sampling, else None.

    Mergeable: plain ``peft.tuners.lora.Linear`` layers (no DoRA or other variant, no LoRA bias; quantized
    layers such as QLoRA's ``Linear4bit`` are other classes) with fp32 base weights (a bf16/fp16 weight has 8/11
    mantissa bits: a LoRA delta below half its ulp, as early in training, would vanish in the merged copy and the
    engine would sample from the base) that are not shared with another module (a tied LM head would change the
    input embeddings too).
    """
    from peft.tuners.lora.layer import Linear, LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and adapter in getattr(m, "lora_A", {})]
    if not layers:
        return None
    owners: dict[int, int] = {}  # parameter -> modules holding it (2 for a tied LM head and embedding)
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    shared = any(owners.get(id(layer.get_base_layer().weight), 0) > 1 for layer in layers)
    plain = all(type(layer) is Linear and adapter not in getattr(layer, "lora_variant", {})
                and not layer.lora_bias.get(adapter, False) and not layer.merged
                and layer.get_base_layer().weight.dtype == torch.float32 for layer in layers)
    return layers if plain and not shared else None


@contextlib.contextmanager
def merged_lora(layers: list, adapter: str):
    """Sample from ``W + scaling * B @ A`` instead of ``W x + scaling * B (A x)``: inside, every layer's base weight is
    a merged copy and peft's forward uses the base layer only (the layer counts as merged); on exit the ORIGINAL
    weight tensors are put back, bit for bit (no subtraction: peft's ``unmerge_adapter`` leaves fp32 rounding
    behind in the frozen base, a drift that grows with every iteration).

    Cost: one merged copy of the adapted weights while inside (transient; 0.4 GiB for SmolLM2-135M in fp32).
    Gain: no per-token LoRA matmuls in ``generate`` (210 LoRA layers x 3 small ops per decoding step for
    SmolLM2-135M on all linear layers): 1.16-1.38x the tokens/s of the unmerged adapter, measured on 2 shared CPU
    cores (SmolLM2-135M fp32, LoRA r16 all-linear, 16 prompts x 24-48 tokens, one thread, alternated runs).
    Exactness: the merged weights differ from the adapter's computation by fp32 rounding only; measured on that
    model, the log-probs of sampled tokens (temperature 0.8) under merged vs unmerged weights differ by at most
    2.7e-5 nats (mean 3e-6); the trainer recomputes every log-prob it trains on with the unmerged adapter, so the
    loss never sees the difference (tests/unit/rl/test_hf_generation.py bounds it by 1e-5 on a tiny model and
    checks the same completions for the same seeds).

    Args:
        layers: from :func:`mergeable_lora_layers`. adapter: the adapter to merge (the active one).
    """
    saved = []
    try:
        with torch.no_grad():
            for layer in layers:
                weight = layer.get_base_layer().weight
                saved.append((layer, weight, weight.data))
                weight.data = weight.data + layer.get_delta_weight(adapter).to(weight.dtype)
                layer.merged_adapters.append(adapter)
        yield
    finally:
        for layer, weight, original in reversed(saved):
            weight.data = original
            layer.merged_adapters.remove(adapter)


def _can_merge(trainer) -> bool:
    """Merging swaps parameter tensors in place: not under ZeRO-3 (partitioned, gathered only for generation) or
    FSDP (sharded flat parameters); there the adapter stays unmerged."""
    if getattr(trainer, "is_fsdp_enabled", False):
        return False
    if getattr(trainer, "is_deepspeed_enabled", False):
        plugin = trainer.accelerator.state.deepspeed_plugin
        return plugin is None or plugin.zero_stage != 3
    return True


class HFGenerationBackend:
    """transformers' batched ``generate`` on the training model: KV cache, left-padded prompts, stops at the
    template's end-of-turn ids; under DeepSpeed ZeRO-3 the weights are gathered for generation by
    ``trl.models.utils.unwrap_model_for_generation``. A plain LoRA policy is merged for the duration of each
    ``generate`` call (:func:`merged_lora`: 1.16-1.38x the tokens/s of the unmerged adapter on a CPU, the original
    weights restored exactly afterwards); only fp32 weights, not under ZeRO-3/FSDP, nor for DoRA/QLoRA adapters or
    tied weights.

    Args:
        trainer: the online-RL trainer (its ``model_wrapped``, ``accelerator``, autocast context).
        eos_ids: ids that end a completion. pad_id: written after it.
        temperature, top_p, top_k: sampling settings (``top_k`` 0 = off).
    """

    def __init__(self, trainer, eos_ids: list[int], pad_id: int, temperature: float, top_p: float, top_k: int):
        self.trainer, self.eos_ids, self.pad_id = trainer, eos_ids, pad_id
        self.sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
        self.merge = _can_merge(trainer)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 greedy: bool) -> torch.Tensor:
        from trl.models.utils import unwrap_model_for_generation

        trainer = self.trainer
        sampling = {"do_sample": False} if greedy else self.sampling
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as unwrapped:
            was_training = unwrapped.training
            unwrapped.eval()
            layers = mergeable_lora_layers(unwrapped.policy, POLICY) if self.merge else None
            merged = merged_lora(layers, POLICY) if layers else contextlib.nullcontext()
            with adapter_scope(unwrapped.policy, POLICY), merged, trainer.compute_loss_context_manager():
                try:
                    sequences = unwrapped.policy.generate(
                        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                        **sampling, eos_token_id=self.eos_ids, pad_token_id=self.pad_id, use_cache=True,
                    )
                except RuntimeError as exc:  # torch.multinomial: "probability tensor contains either inf, nan ..."
                    if "nan" not in str(exc) or "inf" not in str(exc):
                        raise
                    from llmtune.core.guard import NonFiniteError

                    raise NonFiniteError(
                        f"after optimizer step {trainer.state.global_step}: sampling completions met NaN/inf "
                        f"probabilities ({str(exc).strip()}); the policy's logits are not finite. Likely causes: the "
                        "learning rate is too high (lower train.learning_rate), fp16 overflow (use precision.bf16), "
                        "or a bad prompt row. No adapter or lineage.json was written.") from None
            unwrapped.train(was_training)
        return sequences
