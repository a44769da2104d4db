"""The ``hf`` rollout engine: transformers' batched ``generate`` on the training model itself (token ids in, token ids
out; no engine log-probs: the trainer computes every log-prob it uses).

Prompts are left-padded into one batch, sampling stops at the stop set it is given (nothing else), and each row's
completion is cut right after its first stop token. A plain LoRA policy is merged for the duration of each
``generate`` call (:func:`merged_lora`: 1.16-1.38x the tokens/s of the unmerged adapter on a CPU, the original
weights restored exactly afterwards); only fp32 weights, not under ZeRO-3/FSDP (``Policy.can_merge``), nor for
DoRA/QLoRA adapters or tied weights. Repeated prompts (GRPO's groups) are prefilled once (:func:`shared_prompt_cache`;
only where merging is allowed: under ZeRO-3/FSDP a forward may be collective and ranks whose prompts do not repeat
would run one forward fewer).

Seeds: a batch is sampled from torch's global RNG (``generate``'s own sampling, which the trainer seeds per
iteration), so a prompt's draws depend on what else shares its batch. With ``seeds`` (one per prompt: multi-turn
rollouts, whose batches form as tools return) each prompt draws from its own generator instead
(:class:`PromptSeededSampling`, the same distribution), and its completion no longer depends on the batch, up to
the float rounding of a batched forward (left padding to another width moves a row's logits by ~1e-6 relative).
"""

from __future__ import annotations

import contextlib

import torch

from llmtune.models.adapters import adapter_scope
from llmtune.rl.engines.base import RolloutEngine
from llmtune.rl.types import LENGTH, STOP, Completion, SamplingParams


def mergeable_lora_layers(model: torch.nn.Module, adapter: str) -> list | None:
    """The LoRA layers of ``adapter`` when all of them can be merged exactly for sampling, else None.

    Mergeable: plain ``peft.tuners.lora.Linear`` layers (no DoRA or other variant, no LoRA bias; quantized
    layers such as QLoRA's ``Linear4bit`` and the parameter wrappers of MoE experts are other classes) with fp32 base weights (a bf16/fp16 weight has 8/11
    mantissa bits: a LoRA delta below half its ulp, as early in training, would vanish in the merged copy and the
    engine would sample from the base) that are not shared with another module (a tied LM head would change the
    input embeddings too).
    """
    from peft.tuners.lora.layer import Linear, LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer) and adapter in getattr(m, "lora_A", {})]
    if not layers:
        return None
    plain = all(type(layer) is Linear and adapter not in getattr(layer, "lora_variant", {})
                and not layer.lora_bias.get(adapter, False) and not layer.merged
                and layer.get_base_layer().weight.dtype == torch.float32 for layer in layers)
    if not plain:  # e.g. MoE experts adapted as parameters (peft's ParamWrapper): no base `weight` to swap
        return None
    owners: dict[int, int] = {}  # parameter -> modules holding it (2 for a tied LM head and embedding)
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    shared = any(owners.get(id(layer.get_base_layer().weight), 0) > 1 for layer in layers)
    return None if shared else layers


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


class PromptSeededSampling:
    """Sampling in which every row draws from its own ``torch.Generator`` (seeded per prompt), as the last logits
    processor of a ``generate(do_sample=False)`` call (transformers' ``LogitsProcessorList`` calls any callable): after transformers' temperature, top-k and top-p warpers it
    samples one token per row by inverse CDF (one uniform draw per row per step, the softmax in float64) and returns
    scores that are 0 at that token and -inf elsewhere, so the greedy step takes it. The same distribution as
    ``generate``'s own sampling (``torch.multinomial`` on the warped softmax), other draws: a row's draws are a
    function of its seed only, never of the other rows.

    Args:
        seeds: (B,) one per row.
    """

    def __init__(self, seeds: list[int]):
        self.generators = [torch.Generator().manual_seed(int(s)) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """``scores``: (B, V) warped logits -> (B, V): 0 at each row's sampled token, -inf elsewhere."""
        cdf = torch.softmax(scores.double(), dim=-1).cumsum(-1)  # (B, V)
        draws = torch.cat([torch.rand(1, generator=g, dtype=torch.float64) for g in self.generators])  # (B,)
        draws = (draws.to(cdf.device) * cdf[:, -1]).unsqueeze(1)  # (B, 1), below each row's total
        picked = torch.searchsorted(cdf, draws, right=True).clamp(max=scores.shape[-1] - 1)  # a token of mass > 0
        return torch.full_like(scores, float("-inf")).scatter_(1, picked, 0.0)


def seeded_sampling_processors(sampling: SamplingParams, seeds: list[int]) -> list:
    """The logits processors of a per-prompt-seeded ``generate(do_sample=False)`` call: transformers' temperature,
    top-k and top-p warpers (in ``generate``'s own order), then :class:`PromptSeededSampling`."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = [TemperatureLogitsWarper(sampling.temperature)] if sampling.temperature != 1.0 else []
    if sampling.top_k and sampling.top_k > 0:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return [*warpers, PromptSeededSampling(seeds)]


class HFEngine(RolloutEngine):
    """transformers' ``generate`` on the policy (see the module docstring).

    Args:
        policy: what it samples from (:class:`llmtune.rl.engines.Policy`).
        pad_id: the id prompts are left-padded with and finished rows are filled with.
    """

    seeds_per_prompt = True

    def __init__(self, policy, pad_id: int):
        self.policy, self.pad_id = policy, pad_id
        self.merge = policy.can_merge and policy.adapter is not None
        self.share = policy.can_merge

    def sync(self, version: int) -> None:
        """Nothing to do: ``generate`` runs on the training model itself."""

    @contextlib.contextmanager
    def session(self):
        """Many ``generate`` calls with the policy unchanged (a multi-turn rollout batch: the trainer waits for it):
        the LoRA adapter is merged once for all of them (:func:`merged_lora`, 0.3 s a merge for SmolLM2-135M on a
        CPU core) instead of once per call, and the original weights are put back at the end."""
        layers = mergeable_lora_layers(self.policy.model, self.policy.adapter) if self.merge else None
        with merged_lora(layers, self.policy.adapter) if layers else contextlib.nullcontext():
            yield

    def close(self) -> None:
        """Nothing to free: the model is the trainer's."""

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, budgets: list[int] | None = None,
                 keys: list[int] | None = None, version: int | None = None,
                 seeds: list[int | None] | None = None) -> list[Completion]:
        """One completion per prompt (see :meth:`llmtune.rl.engines.base.RolloutEngine.generate`); ``logprobs`` None
        (transformers' scores are not the trainer's log-probs; the trainer computes its own). With ``budgets``,
        ``generate`` runs to the largest and each completion is cut at its own (the tokens kept are exactly what a
        run to that budget samples: generation is left to right). ``keys`` are ignored (one engine);
        ``sampling.seed`` too (this engine draws from torch's global RNG, which the trainer seeds). ``seeds``: each
        prompt sampled from its own generator (:class:`PromptSeededSampling`; a None entry gets a seed drawn from
        the global RNG); ignored when greedy.

        Raises:
            NonFiniteError: sampling met NaN/inf probabilities (the policy's logits are not finite).
            ValueError: ``version`` is not the policy's current one (this engine samples the training model as it
                is: it has no other version).
        """
        if version is not None and int(version) != int(self.policy.version()):
            raise ValueError(f"the hf engine samples the training model as it is (version {self.policy.version()}), "
                             f"not version {version}")
        input_ids, attention_mask = left_pad(prompts, self.pad_id, self.policy.device)
        options = {"do_sample": False} if sampling.greedy else {
            "do_sample": True, "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k}
        if seeds is not None and not sampling.greedy:
            from transformers.generation.logits_process import LogitsProcessorList

            drawn = [int(s) if s is not None else int(torch.randint(0, 2**31 - 1, ()).item()) for s in seeds]
            options = {"do_sample": False,
                       "logits_processor": LogitsProcessorList(seeded_sampling_processors(sampling, drawn))}
        adapter = self.policy.adapter
        with self.policy.enter() as model:
            was_training = model.training
            model.eval()
            layers = mergeable_lora_layers(model, adapter) if self.merge else None  # None inside a session()
            merged = merged_lora(layers, adapter) if layers else contextlib.nullcontext()
            scope = adapter_scope(model, adapter) if adapter is not None else contextlib.nullcontext()
            try:
                with scope, merged:
                    cache = shared_prompt_cache(model, input_ids, attention_mask) if self.share else None
                    sequences = model.generate(
                        input_ids=input_ids, attention_mask=attention_mask,
                        max_new_tokens=max(budgets) if budgets else sampling.max_new_tokens,
                        **options, eos_token_id=list(sampling.stop_token_ids), pad_token_id=self.pad_id,
                        use_cache=True, **({"cache": cache} if cache is not None else {}))
            except RuntimeError as exc:  # torch.multinomial: "probability tensor contains either inf, nan ..."
                if "nan" not in str(exc) or "inf" not in str(exc):
                    raise
                from llmtune.core.guard import NonFiniteError

                raise NonFiniteError(
                    f"after optimizer step {self.policy.version()}: sampling completions met NaN/inf probabilities "
                    f"({str(exc).strip()}); the policy's logits are not finite. Likely causes: the learning rate is "
                    "too high (lower train.learning_rate), fp16 overflow (use precision.bf16), or a bad prompt row. "
                    "No adapter or lineage.json was written.") from None
            finally:
                model.train(was_training)
        return cut_completions(sequences[:, input_ids.shape[1]:], sampling.stop_token_ids, self.policy.version(),
                               budgets)


def left_pad(prompts: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """B prompts of token ids -> ``(input_ids, attention_mask)``, each (B, P) long, left-padded with ``pad_id`` / 0
    (the prompts end together where generation starts), P = the longest prompt."""
    width = max([len(p) for p in prompts] + [1])
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for b, p in enumerate(prompts):
        if p:
            input_ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, width - len(p):] = 1
    return input_ids.to(device), mask.to(device)


def cut_completions(generated: torch.Tensor, stop_token_ids, version: int | None, budgets: list[int] | None = None
                    ) -> list[Completion]:
    """(B, N) ids ``generate`` produced after the prompts -> B completions, each cut right after its first stop
    token (finish reason ``stop``; ``generate`` fills a finished row with padding) or at its budget (``length``;
    ``budgets`` default N)."""
    is_stop = torch.isin(generated, torch.tensor(list(stop_token_ids), device=generated.device, dtype=torch.long))
    out = []
    for b, (row, stops) in enumerate(zip(generated.tolist(), is_stop.tolist())):
        limit = len(row) if budgets is None else min(len(row), budgets[b])
        stops = stops[:limit]
        end = stops.index(True) + 1 if True in stops else limit
        out.append(Completion(row[:end], None, STOP if True in stops else LENGTH, version))
    return out
