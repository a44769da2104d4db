"""Rollout engines: how online RL samples completions. One protocol, so that vLLM (``llmtune.rl.vllm_engine``) can
replace transformers' ``generate`` without touching the stages; :func:`build_engine` picks one from ``rollout.engine``.

An engine turns (B, P) left-padded prompts into (B, P + N) sequences; everything after a row's first EOS is padding
(``rollout.split_generation`` masks it). Sampling settings come from the recipe's ``rollout:`` section
(``temperature``, ``top_p``, ``top_k``); ``greedy`` is the evaluation path.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from llmtune.models.adapters import adapter_scope
from llmtune.rl.model import POLICY
from llmtune.utils import get_logger

log = get_logger("rollout")


class RolloutEngine(Protocol):
    """What the online-RL trainer calls to sample completions (interfaces of issue 22, point 2)."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, P) left-padded prompts + mask -> ``(sequences, engine_logps)``: (B, P + N) long sequences
        (N <= max_new_tokens) and (B, N) fp32 log-probs of the sampled tokens under the engine's sampling
        distribution (after temperature), or None when the engine does not report them."""
        ...

    def sync(self, version: int) -> None:
        """Make the engine sample from the trainer's current policy; ``version`` = optimizer steps applied
        (``trainer.state.global_step``)."""
        ...

    def close(self) -> None:
        """Free the engine (processes, memory)."""
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


def shared_prompt_cache(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """A KV cache of all prompt tokens but the last, computed once per DISTINCT prompt and copied to its rows.

    GRPO samples ``num_generations`` completions of each prompt: the (B, P) batch holds every prompt G times, and
    ``generate`` would run the prefill (the costliest forward of sampling: P tokens per row, against one per
    decoding step) G times over the same tokens. Here the B/G distinct rows run it once (``logits_to_keep=1``: no
    LM head over the prompt), the cache rows are repeated for their copies, and ``generate`` continues from it: its
    first step processes the last prompt token of every row and samples from there, with the same position ids
    (``attention_mask.cumsum - 1``, as ``generate`` computes them) and the same causal attention over the same
    keys, so the logits are those of the plain prefill up to float rounding (other matmul shapes) and the random
    draws are the same calls on the same shapes (tests/unit/rl/test_hf_generation.py).

    Args:
        model: the causal LM ``generate`` runs on (peft model, adapter and merge already set by the caller).
        input_ids, attention_mask: (B, P) left-padded prompts.

    Returns:
        The ``transformers`` cache (B rows, P - 1 positions) to pass as ``generate(cache=...)``, or None when no
        prompt repeats (or P < 2): then the plain prefill is as cheap.
    """
    width = input_ids.shape[1]
    if width < 2 or input_ids.shape[0] < 2:
        return None
    rows = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], 1)
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if unique.shape[0] == rows.shape[0]:
        return None
    ids, mask = unique[:, :width - 1], unique[:, width:2 * width - 1].to(attention_mask.dtype)
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values
    cache.batch_select_indices(inverse)
    return cache


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
    tied weights. Repeated prompts (GRPO's groups) are prefilled once (:func:`shared_prompt_cache`; not under
    ZeRO-3/FSDP).

    Args:
        trainer: the online-RL trainer (its ``model_wrapped``, ``accelerator``, autocast context).
        eos_ids: ids that end a completion. pad_id: written after it.
        temperature, top_p, top_k: sampling settings (``top_k`` 0 = off).
    """

    def __init__(self, trainer, eos_ids: list[int], pad_id: int, temperature: float, top_p: float, top_k: int):
        self.trainer, self.eos_ids, self.pad_id = trainer, eos_ids, pad_id
        self.sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
        self.merge = _can_merge(trainer)
        # the shared prompt prefill: not under ZeRO-3/FSDP, where a forward may be collective and ranks whose
        # prompts do not repeat would run one forward fewer
        self.share = self.merge

    def sync(self, version: int) -> None:
        """Nothing to do: ``generate`` runs on the training model itself."""

    def close(self) -> None:
        """Nothing to free: the training model is the trainer's."""

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 greedy: bool) -> tuple[torch.Tensor, None]:
        """``(sequences (B, P + N), None)``: transformers' scores are not the sampled tokens' log-probs under
        the trainer's forward, and the trainer's own log-probs are what the loss uses."""
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
                    cache = shared_prompt_cache(unwrapped.policy, input_ids, attention_mask) if self.share else None
                    sequences = unwrapped.policy.generate(
                        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                        **sampling, eos_token_id=self.eos_ids, pad_token_id=self.pad_id, use_cache=True,
                        **({"cache": cache} if cache is not None else {}),
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
        return sequences, None


ENGINES = ("hf", "vllm")


def vllm_recipe_problems(recipe) -> list[tuple[str, str]]:
    """What ``rollout.engine: vllm`` cannot do with this recipe (see :func:`llmtune.config.validate.rollout_problems`,
    the one list of reasons)."""
    from llmtune.config.validate import rollout_problems

    return rollout_problems(recipe.model_dump(mode="json"), engine="vllm")


def vllm_installed() -> bool:
    """Whether a python with vLLM is available to run the engine (``llmtune.rl.vllm_engine.vllm_python``)."""
    try:
        from llmtune.rl.vllm_engine import vllm_python
    except ModuleNotFoundError as exc:  # a build without the vLLM engine module; any other import error is a bug
        if exc.name != "llmtune.rl.vllm_engine":
            raise
        return False
    return vllm_python() is not None


def select_engine(recipe, cuda_available: bool | None = None, installed: bool | None = None) -> tuple[str, str]:
    """The engine ``rollout.engine`` asks for, and why.

    ``hf``/``vllm`` are taken as given; ``auto`` is vllm when CUDA is available, the recipe is one vLLM can sample
    for (LoRA on an unquantized base, see :func:`vllm_recipe_problems`) and vLLM can be used (server mode: a url
    is set; colocate: vLLM is installed here), else hf (on CPUs hf is the faster engine: issue 22's measurements).

    Args:
        recipe: the typed recipe. cuda_available / installed: overrides of ``torch.cuda.is_available()`` /
            :func:`vllm_installed` (tests).

    Returns:
        ``(engine, reason)`` with engine ``hf`` or ``vllm``.
    """
    rollout = recipe.rollout
    if rollout.engine != "auto":
        return rollout.engine, f"rollout.engine: {rollout.engine}"
    if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
        return "hf", "rollout.engine: auto and no CUDA device (vLLM is for GPUs; on CPUs hf is faster)"
    problems = vllm_recipe_problems(recipe)
    if problems:
        return "hf", f"rollout.engine: auto and vLLM cannot sample this recipe ({problems[0][0]}: {problems[0][1]})"
    if rollout.vllm.mode == "server":
        return "vllm", f"rollout.engine: auto, CUDA and a rollout server at {rollout.vllm.url}"
    if not (vllm_installed() if installed is None else installed):
        return "hf", "rollout.engine: auto and vLLM is not installed (bash scripts/setup.sh sets it up)"
    return "vllm", "rollout.engine: auto, CUDA and vLLM installed"


def build_engine(trainer, recipe) -> RolloutEngine:
    """The rollout engine of an online-RL trainer (:func:`select_engine` picks it; the choice is logged).

    Args:
        trainer: the :class:`~llmtune.rl.trainer.OnlineRLTrainer` (``eos_ids``, ``pad_id``, model, run dir).
        recipe: the typed recipe (``rollout:`` section).

    Raises:
        RolloutEngineError: vLLM is not installed, fails to start or cannot be reached (from
            ``llmtune.rl.vllm_engine.build_vllm_engine``).
    """
    engine, reason = select_engine(recipe)
    log.info("rollout engine: %s (%s)", engine, reason)
    if engine == "vllm":
        from llmtune.rl.vllm_engine import build_vllm_engine

        return build_vllm_engine(trainer, recipe)
    r = recipe.rollout
    return HFGenerationBackend(trainer, trainer.eos_ids, trainer.pad_id, r.temperature, r.top_p, r.top_k)
