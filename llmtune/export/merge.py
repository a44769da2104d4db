"""``llmtune export``: merge a run's adapter chain into its base, save, reload and verify.

The chain is the run's ``previous_adapters`` (from ``model.from_run``, oldest first, in ``lineage.json``) followed
by its own adapter (peft's ``default`` adapter in ``adapter/``; other adapters saved in subdirectories, such as
PPO's value adapter in ``adapter/value/``, are not merged). Merge arithmetic is done in fp32 and the result is
cast ONCE to the output dtype (bf16 merges drift: torchtune #1101), so every merged weight equals
``round_to_dtype(W + sum_i scale_i * B_i @ A_i)`` computed in fp32.

``W`` is the weight the adapter was trained against: the fp32 base for an unquantized run; for a QLoRA run
(``model.load_in_4bit``/``load_in_8bit``) the base is loaded quantized exactly as training loaded it and then
dequantized to fp32. Merging into a still-quantized model is refused (:func:`refuse_quantized_merge`): peft would
round every merged weight back to 4 bits (peft #2321).

Embeddings: an adapter trained after adding tokens holds the resized embedding (and head) in full; the base is
resized to fit before loading (:func:`llmtune.models.lineage.fit_vocab_to_adapter`). When the input embedding and
the output head were trained as separate copies on a base whose config ties them, the merged config is untied and
both are saved (peft #2777: a merged model whose config still said "tied" lost its trained head on reload).

The saved model is reloaded with the plain ``Auto*`` class of its head and compared with the adapter model on
sample prompts: logits and greedy generations for a causal LM (``AutoModelForCausalLM``); for a reward model
(``model_head: score``) the one score per sequence (``AutoModelForSequenceClassification``, which must find every
weight, the trained head included: trl #368 lost the head by saving an RM as a causal LM), on sample conversations
as a consumer scores them (:func:`score_inputs`: ``apply_chat_template(..., tokenize=True)``, also ending in EOS),
both with llmtune's last-real-token reading and with the reload's own ``forward`` (``logits[:, 0]``) unpadded and
in right- and left-padded batches. A reward model is saved with a pad token no sequence contains
(:func:`llmtune.models.heads.use_dedicated_pad`), since transformers pools at the last token that is not the pad
(with pad == EOS a sequence ending in EOS was read one token early). The output directory
also gets ``generation_config.json`` (stopping at every EOS of the chat template), the tokenizer with the training
chat template, ``verification.json`` and a model card (``README.md``) with the lineage.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from llmtune.config import Recipe, load_recipe
from llmtune.core import rundir as rd
from llmtune.data.templates import stop_token_ids, template_eos_ids
from llmtune.models.heads import use_dedicated_pad
from llmtune.models.quant import compute_dtype_4bit, dequantize_to_fp32, fp32_compute_4bit  # noqa: F401
from llmtune.utils import get_logger, setup_logging, write_json
from llmtune.errors import LlmtuneError

log = get_logger("export")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# max |merged - adapter| <= atol + rtol * max |adapter logits|, per output dtype. For fp32 the merge itself
# is one rounding per weight; what remains is fp32 accumulation noise of two different computation orders
# (x W + s (x A) B vs x (W + s B A)), which grows with the logit scale and depth: measured 9.7e-5 at
# max |logit| 43 on SmolLM2-135M (30 layers) for one adapter, 1.55e-4 at max |logit| 38.7 for a chain of three
# (SFT + DPO + PPO, each merged once: more roundings). Wrong merges (lost scaling, heads, tied weights) are >= 1e-2.
TOLERANCE = {"fp32": (1e-4, 5e-6), "fp16": (1e-2, 1e-2), "bf16": (5e-2, 4e-2)}
# A 4-bit reference is evaluated with its 4-bit layers computing in fp32 from their fp32-dequantized weights
# (llmtune.models.quant.fp32_compute_4bit): the merged model's weights exactly, so the fp32 tolerance holds; what the
# trained model computes in bf16 is reported beside (trained_compute), it is rounding, not evidence about the merge.
# An 8-bit (LLM.int8) reference also quantizes its activations per row to int8 (error up to max|x|/254 per element),
# so the model the adapter trained with differs from any dense model by that much: measured 4e-3 on a tiny Llama.
TOLERANCE_INT8 = (5e-2, 2e-2)
SAMPLE_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write one sentence about the sea.",
    "What is 12 * 7?",
]
GENERATION_TOKENS = 16  # new tokens per sample prompt in the greedy-generation comparison
_RUNTIME_METRICS = ("runtime", "per_second", "time", "epoch")  # eval_* keys that are timings, not model quality


class ExportError(LlmtuneError, RuntimeError):
    """The run cannot be exported (not finished, unsupported adapter, quantized merge) or verification failed."""


def load_run_recipe(run_dir: Path) -> Recipe:
    """The resolved recipe a run was trained with.

    Raises:
        ExportError: the directory is not a finished run.
    """
    if not (run_dir / rd.LINEAGE).is_file():
        raise ExportError(
            f"{run_dir} is not a finished run (no {rd.LINEAGE}); train it to the end (rerun its training command: it "
            "continues from its newest complete checkpoint)"
        )
    raw = yaml.safe_load((run_dir / rd.RECIPE).read_text())
    return load_recipe(raw=raw)


def sample_inputs(tokenizer, max_prompts: int = 3) -> list[torch.Tensor]:
    """Token ids (1, T) of the sample prompts rendered with the run's chat template."""
    out = []
    for text in SAMPLE_PROMPTS[:max_prompts]:
        if tokenizer.chat_template:
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        out.append(torch.tensor([ids]))
    return out


SAMPLE_ANSWERS = ["She sold 48 / 2 = 24 clips in May, so 48 + 24 = 72 clips in all. #### 72",
                  "The sea is wide and blue.", "12 * 7 = 84."]


def score_inputs(tokenizer) -> list[torch.Tensor]:
    """Token ids (1, T) a consumer scores a reward model on: each sample conversation (prompt + answer) as
    ``apply_chat_template(conversation, tokenize=True)`` gives it, and the same ids cut after their last
    end-of-turn token, so they END IN EOS (where pad == EOS misled transformers' pooling). Without a chat
    template: prompt + answer + EOS."""
    ends = set(template_eos_ids(tokenizer))
    out = []
    for prompt, answer in zip(SAMPLE_PROMPTS, SAMPLE_ANSWERS):
        if not tokenizer.chat_template:
            out.append(torch.tensor([tokenizer(prompt + " " + answer)["input_ids"] + [tokenizer.eos_token_id]]))
            continue
        conversation = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        ids = list(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"])
        out.append(torch.tensor([ids]))
        last = max((i for i, t in enumerate(ids) if t in ends), default=len(ids) - 1)
        if last < len(ids) - 1:
            out.append(torch.tensor([ids[:last + 1]]))
    return out


def padded_batch(inputs: list[torch.Tensor], pad_id: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, each (B, T): the (1, T_i) rows padded with ``pad_id`` on ``side``."""
    T = max(x.shape[1] for x in inputs)
    ids = torch.full((len(inputs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(inputs), T), dtype=torch.long)
    for b, x in enumerate(inputs):
        span = slice(0, x.shape[1]) if side == "right" else slice(T - x.shape[1], T)
        ids[b, span], mask[b, span] = x[0], 1
    return ids, mask


@torch.no_grad()
def plain_transformers_scores(model, inputs: list[torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """Scores of a reloaded sequence classifier used as plain transformers code uses it: its own ``forward`` and
    ``logits[:, 0]`` (TRL / OpenRLHF style), on each row alone and on right- and left-padded batches of all rows
    (``pad_id``, with the attention mask). Returns ``{"unpadded" | "right" | "left": (B,) fp32}``."""
    model.eval()
    out = {"unpadded": torch.cat([model(input_ids=x).logits[:, 0].float() for x in inputs])}
    for side in ("right", "left"):
        ids, mask = padded_batch(inputs, pad_id, side)
        out[side] = model(input_ids=ids, attention_mask=mask).logits[:, 0].float()
    return out


def auto_class(head: str):
    """The plain transformers class a merged model of this head reloads with."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if head == "score" else AutoModelForCausalLM


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def _outputs(model, inputs: list[torch.Tensor], head: str) -> list[torch.Tensor]:
    """Per prompt: (1, T, V) fp32 logits of a causal LM, or the (1,) fp32 score read at the last token (on CPU)."""
    from llmtune.models import sequence_scores

    model.eval()
    device = _device(model)
    if head == "score":
        return [sequence_scores(model, x.to(device), torch.ones_like(x, device=device)).cpu() for x in inputs]
    return [model(input_ids=x.to(device)).logits.float().cpu() for x in inputs]


@torch.no_grad()
def _generate(model, inputs: list[torch.Tensor], eos_ids: list[int], pad_id: int | None, max_new_tokens: int):
    """Greedy continuation of each prompt, stopping at any of ``eos_ids``: per prompt ``(new token ids, (N, V) fp32
    logits the model gave at each generated position)``."""
    device = _device(model)
    out = []
    for x in inputs:
        res = model.generate(
            input_ids=x.to(device), attention_mask=torch.ones_like(x, device=device), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=eos_ids, pad_token_id=pad_id if pad_id is not None else eos_ids[0],
            return_dict_in_generate=True, output_logits=True,
        )
        out.append((res.sequences[0, x.shape[1]:].tolist(), torch.cat(res.logits).float().cpu()))
    return out


# ---- quantized bases -----------------------------------------------------------------------------------------

def is_quantized(model) -> bool:
    """Whether any layer of ``model`` is a bitsandbytes 4-bit or 8-bit linear (also inside a peft wrapper)."""
    return any(type(p).__name__ in ("Params4bit", "Int8Params") for p in model.parameters())


def refuse_quantized_merge(model) -> None:
    """Refuse to merge an adapter into a model whose base layers are still 4/8-bit.

    peft's merge into a bitsandbytes layer dequantizes the weight, adds ``scale * B @ A`` and quantizes the sum
    back (peft #2321): the update is smaller than one 4-bit step for most weights and is mostly rounded away, and
    the result still needs bitsandbytes to load. Merge into the dequantized base instead (:func:`dequantize_to_fp32`).

    Raises:
        ExportError: ``model`` holds quantized layers.
    """
    if is_quantized(model):
        kinds = ("Linear4bit", "Linear8bitLt")
        layers = sorted({type(m).__name__ for m in model.modules() if type(m).__name__ in kinds})
        raise ExportError(
            f"refusing to merge into a quantized model ({', '.join(layers) or 'bitsandbytes layers'}): the merged "
            "weights would be rounded back to 4/8 bits, losing most of the adapter's update (peft #2321). "
            "llmtune export dequantizes the base to fp32 first and merges into that; do the same "
            "(dequantize_to_fp32 / transformers' model.dequantize()) before merge_and_unload."
        )


def refuse_partitioned_merge(model) -> None:
    """Refuse to merge into DeepSpeed ZeRO-3 partitions: their local tensors are empty placeholders, so a merge
    would silently produce garbage. Happens when the model was loaded while a ZeRO-3 config was alive.

    Raises:
        ExportError: some parameters are partitioned (names one; says to gather or to export in one plain process).
    """
    from llmtune.core.distributed import assert_gathered

    try:
        assert_gathered(model, "merge the adapter")
    except RuntimeError as err:
        raise ExportError(str(err)) from None


# ---- building and merging ------------------------------------------------------------------------------------

def load_adapter_model(run_dir: Path, recipe: Recipe, lineage: dict | None = None):
    """The model the run ended with, unmerged: ``(peft_model, tokenizer, base_info)``.

    Unquantized runs: the fp32 base with the earlier adapters of the chain merged (into the dequantized base once a
    run of the chain was quantized: :func:`llmtune.models.lineage.trained_base`), plus the run's adapter.
    QLoRA runs: the base loaded quantized as training loaded it (same dtype, quantization settings; non-quantized
    parameters upcast to fp32 as ``prepare_model_for_kbit_training`` did), plus the run's adapter and, for a
    ``model.from_run`` chain, the earlier adapters stacked frozen under it: the model the adapter was trained on.
    Full fine-tuning (``adapter.type: none``): the saved model itself (no peft wrapper).
    Only peft's ``default`` adapter in ``adapter/`` is loaded (PPO saves its value adapter under ``adapter/value/``).

    Args:
        run_dir: finished run directory.
        recipe: its resolved recipe (:func:`load_run_recipe`).
        lineage: its ``lineage.json``; read from ``run_dir`` when omitted.

    Returns:
        The model, the tokenizer saved with the adapter (training chat template), and ``base_info``
        (``name_or_path``, ``weights``: what the adapter is merged into), recorded in the report and model card.

    Raises:
        ExportError: a quantized run whose chain training would refuse (``chain_problems``: an inconsistent lineage).
        ModelLoadError: the base or an adapter cannot be loaded, or an added-token adapter lacks its head.
    """
    from peft import PeftModel, prepare_model_for_kbit_training
    from transformers import AutoTokenizer

    from llmtune.config import PrecisionConfig
    from llmtune.models import load_model_with_chain
    from llmtune.models.adapters import stack_frozen_adapters
    from llmtune.models.lineage import (
        chain_problems, chain_quantization, chain_segment, describe_quantization, fit_vocab_to_adapter,
        load_stacked_base, quantization_of,
    )

    if lineage is None:
        lineage = json.loads((run_dir / rd.LINEAGE).read_text())
    head = lineage.get("model_head", "causal_lm")
    adapter_dir = run_dir / rd.ADAPTER
    from llmtune.models.weight_files import check_weight_files

    check_weight_files(adapter_dir)  # a truncated/corrupt adapter file is named
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    info = {"name_or_path": recipe.model.name_or_path, "path": lineage.get("base_model", {}).get("path")}
    if recipe.adapter.type == "none":  # full fine-tuning: the adapter dir is the whole model
        info["weights"] = f"full fine-tuned model in {adapter_dir} (no adapter to merge)"
        return auto_class(head).from_pretrained(adapter_dir, dtype=torch.float32), tokenizer, info
    chain = lineage.get("previous_adapters", [])
    frozen: list[dict] = []
    if recipe.model.load_in_4bit or recipe.model.load_in_8bit:
        problems = chain_problems(recipe, chain, run_dir)
        if problems:
            raise ExportError(f"{run_dir} cannot be rebuilt as trained: " + "; ".join(m for _, m in problems))
        frozen = chain_segment(chain)[1]
        base = load_stacked_base(recipe.model, recipe.precision, chain, head=head)  # quantized as in training
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
        kind = describe_quantization(quantization_of(recipe.model.model_dump(mode="json"),
                                                     recipe.precision.model_dump(mode="json")))
        info["weights"] = (f"{kind} quantized base as trained, dequantized to fp32: the weights the QLoRA adapter"
                           + (f" and the {len(frozen)} earlier adapter(s) stacked under it were" if frozen else " was")
                           + " trained against")
    else:
        base_cfg = recipe.model.model_copy(update={"dtype": "fp32"})
        for entry in chain:
            log.info("merging the earlier %s adapter %s", entry.get("stage"), entry["path"])
        base = load_model_with_chain(base_cfg, PrecisionConfig(), chain, head=head, dtype=torch.float32)
        quant, _ = chain_quantization(chain)
        info["weights"] = ("fp32 base" if quant is None else f"the {describe_quantization(quant)} base an earlier run "
                           "trained on, dequantized to fp32,") + (
            f" with {len(chain)} earlier adapter(s) merged in fp32" if chain else "")
    if head == "score" and base.config.pad_token_id is None:
        base.config.pad_token_id = tokenizer.pad_token_id
    fit_vocab_to_adapter(base, adapter_dir)
    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=False)
    if frozen:  # the earlier adapters under it, unmerged, as training stacked them
        stack_frozen_adapters(model, frozen)
    return model, tokenizer, info


def stacked_chain(recipe: Recipe, lineage: dict) -> list[dict]:
    """The chain entries a quantized run trained on top of unmerged (frozen adapters), oldest first; empty for an
    unquantized run (its chain was merged before training)."""
    from llmtune.models.lineage import chain_segment

    if not (recipe.model.load_in_4bit or recipe.model.load_in_8bit):
        return []
    return chain_segment(lineage.get("previous_adapters", []))[1]


def refuse_nonfinite_weights(model, run_dir: Path) -> None:
    """Refuse to export a model holding NaN/inf weights, naming the tensors.

    Raises:
        ExportError: some (adapter or base) tensors are not finite.
    """
    from llmtune.core.guard import nonfinite_tensors

    bad = nonfinite_tensors(model.named_parameters())
    if bad:
        shown = ", ".join(bad[:8]) + (f", ... ({len(bad)} tensors)" if len(bad) > 8 else "")
        raise ExportError(
            f"cannot export {run_dir}: its weights hold NaN/inf values in {len(bad)} tensor(s): {shown}. The run "
            "trained on non-finite numbers (see the nonfinite_step records in its metrics.jsonl); train it again "
            "with a lower train.learning_rate (or precision.bf16 instead of fp16)."
        )


def merge_in_fp32(model, adapter_dir: Path, frozen_chain: list[dict] = ()):
    """Merge the run's adapter into the weights it was trained against, in fp32; returns the plain merged model
    (every adapted weight ``W + scale * B @ A``).

    A quantized base is unloaded from the adapters, dequantized to fp32 (:func:`dequantize_to_fp32`), the earlier
    adapters it trained under (``frozen_chain``) are merged into it in order, and the run's adapter is attached
    again; then peft's ``merge_and_unload`` adds ``scale * B @ A`` to every adapted weight and replaces each
    ``modules_to_save`` module by its trained copy. Every merged weight is ``W + sum_i s_i B_i A_i`` over the chain
    and the run, the sum the quantized model computed unmerged. Embeddings whose trained copies diverged are untied
    (:func:`untie_diverged_embeddings`).

    Args:
        model: from :func:`load_adapter_model` (a model without a peft wrapper is returned unchanged).
        adapter_dir: the run's ``adapter/``.
        frozen_chain: the chain entries stacked frozen under the run's adapter (a quantized run's
            ``model.from_run`` chain after its last full fine-tuning run; :func:`llmtune.models.lineage.chain_segment`).

    Raises:
        ExportError: a parameter is not fp32, a layer is still quantized, or parameters are ZeRO-3 partitions
            when merging.
    """
    from peft import PeftModel

    if not hasattr(model, "merge_and_unload"):
        return model
    if is_quantized(model):
        from llmtune.models.lineage import merge_adapter

        base = dequantize_to_fp32(model.unload())
        for entry in frozen_chain:
            log.info("merging the earlier %s adapter %s into the dequantized base", entry.get("stage"), entry["path"])
            base = merge_adapter(base, entry["path"])
        model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=False)
    refuse_partitioned_merge(model)
    refuse_quantized_merge(model)
    not_fp32 = sorted({str(p.dtype) for p in model.parameters() if p.is_floating_point() and p.dtype != torch.float32})
    if not_fp32:
        raise ExportError(f"merge must run in fp32 but parameters are {not_fp32}; this is a bug in llmtune export")
    return untie_diverged_embeddings(model.merge_and_unload())


def untie_diverged_embeddings(model):
    """Set ``tie_word_embeddings = False`` when the config ties the input embedding and the output head but they
    are different tensors (trained as separate ``modules_to_save`` copies), so that both are saved and a reload
    does not overwrite the trained head with the embedding (peft #2777). Returns ``model``."""
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or emb is None or head.weight is emb.weight:
        return model
    configs = {id(c): c for c in (model.config, model.config.get_text_config())}.values()
    if any(getattr(c, "tie_word_embeddings", False) for c in configs):
        log.info("the trained output head differs from the trained input embedding: saving them untied")
        for c in configs:
            if hasattr(c, "tie_word_embeddings"):
                c.tie_word_embeddings = False
    return model


# ---- verification --------------------------------------------------------------------------------------------

def _divergence(ref: list[int], got: list[int]) -> int | None:
    """First position where two generations differ (``None``: identical)."""
    if ref == got:
        return None
    return next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))


def compare_generations(reference: list, merged: list, tokenizer, tolerance: float) -> list[dict]:
    """Per prompt: both greedy texts, whether they match, and the adapter model's margin where they first part.

    Args:
        reference, merged: :func:`_generate` results of the adapter model and of the reloaded merged model.
        tolerance: the logit tolerance of the comparison.

    ``margin`` = the adapter model's logit of its own greedy token minus its logit of the merged model's token at
    the first differing position (same prefix up to there); a margin within the logit tolerance is a near-tie
    (``near_tie``), which rounding alone can flip, so it is not evidence of a wrong merge.
    """
    rows = []
    for (ref, ref_logits), (got, _) in zip(reference, merged):
        pos = _divergence(ref, got)
        row = {"adapter_text": tokenizer.decode(ref), "merged_text": tokenizer.decode(got), "match": pos is None}
        if pos is not None:
            row["first_divergence"] = pos
            if pos < len(ref) and pos < len(got):
                row["margin"] = float(ref_logits[pos, ref[pos]] - ref_logits[pos, got[pos]])
            row["near_tie"] = row.get("margin", float("inf")) <= tolerance
        rows.append(row)
    return rows


def export_run(run_dir: str | Path, dtype: str = "auto", out_dir: str | Path | None = None,
               max_shard_size: str | int = "2GB", max_new_tokens: int = GENERATION_TOKENS) -> dict:
    """Merge, save and verify a finished run; writes ``verification.json`` and ``README.md`` into the output dir.

    Args:
        run_dir: finished run directory.
        dtype: ``fp32``/``fp16``/``bf16``, or ``auto`` = the run's training precision.
        out_dir: default ``run_dir/merged``.
        max_shard_size: largest safetensors shard (``"2GB"``, ``"500MB"`` or bytes); bigger models are sharded
            with a ``model.safetensors.index.json``.
        max_new_tokens: tokens generated per sample prompt for the greedy comparison.

    Returns:
        The verification report (``passed``, ``max_abs_diff``, ``tolerance``, ``base``, ...). Causal LMs:
        ``argmax_agreement`` and ``generations`` (adapter vs merged greedy texts). For fp32 every generation must
        match (or part only at a near-tie); for fp16/bf16 the agreement is reported but only the logit tolerance
        decides: rounding every weight to 8 mantissa bits (bf16) legitimately flips greedy choices between tokens
        whose logits are closer than that rounding, so a differing generation there is not evidence of a wrong
        merge. For a reward model: ``newly_initialized`` (weights the plain reload had to initialise; must be
        empty), ``hf_max_abs_diff`` (the reload's own ``forward`` scores vs the adapter model's, worst of
        unpadded / right- / left-padded, each in ``hf_max_abs_diff_by_padding``) and the ``pad_token`` saved.

    Raises:
        ExportError: the run is not finished, or a merge would go into a quantized or ZeRO-3 partitioned model.
        ModelLoadError: the base or an adapter cannot be loaded (see :func:`load_adapter_model`).
    """
    setup_logging()
    run_dir = Path(run_dir)
    recipe = load_run_recipe(run_dir)
    lineage = json.loads((run_dir / rd.LINEAGE).read_text())
    head = lineage.get("model_head", "causal_lm")
    if dtype == "auto":
        dtype = "bf16" if recipe.precision.bf16 else "fp16" if recipe.precision.fp16 else "fp32"
    out = Path(out_dir) if out_dir else run_dir / "merged"
    model, tokenizer, base_info = load_adapter_model(run_dir, recipe, lineage)
    refuse_nonfinite_weights(model, run_dir)
    quantized = is_quantized(model)
    inputs = sample_inputs(tokenizer) if head == "causal_lm" else score_inputs(tokenizer)
    eos_ids = stop_token_ids(tokenizer, getattr(model, "generation_config", None))  # the one stop set
    reference = _outputs(model, inputs, head)  # the adapter model, unmerged (quantized base for QLoRA)
    reference_compute = compute_dtype_4bit(model)  # what the 4-bit layers really computed in (CPU packed: bf16)
    as_trained = None
    if reference_compute not in (None, torch.float32):  # 4-bit layers computed in bf16/fp16: compare the merge with
        as_trained = reference  # the same model computing in fp32 (fp32_compute_4bit), and report this one beside
        with fp32_compute_4bit(model):
            reference = _outputs(model, inputs, head)
    with fp32_compute_4bit(model):
        ref_gens = _generate(model, inputs, eos_ids, tokenizer.pad_token_id, max_new_tokens) \
            if head == "causal_lm" else []
    frozen = stacked_chain(recipe, lineage)
    merged = merge_in_fp32(model, run_dir / rd.ADAPTER, frozen)  # fp32 arithmetic; `model` is merged in place
    del model
    merged = merged.to(DTYPES[dtype])  # the one cast
    merged.config.use_cache = True
    if head == "score":  # transformers pools at the last token != pad_token_id: pad with a token no sequence has
        use_dedicated_pad(merged, tokenizer, add=True)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    from llmtune.models.portable import clean_tokenizer_config, model_max_length

    clean_tokenizer_config(out, model_max_length(out))  # loads elsewhere; the model's real context length
    if head == "causal_lm":
        _save_generation_config(merged, tokenizer, eos_ids, out)
    del merged

    reloaded, info = auto_class(head).from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    got = _outputs(reloaded, inputs, head)
    max_diff = max(float((a - b).abs().max()) for a, b in zip(got, reference))
    scale = max(float(r.abs().max()) for r in reference)
    atol, rtol = TOLERANCE[dtype]
    if quantized and recipe.model.load_in_8bit:  # LLM.int8 quantizes its activations too: no fp32 twin to compare
        atol, rtol = max(atol, TOLERANCE_INT8[0]), max(rtol, TOLERANCE_INT8[1])
        base_info["compute_dtype"] = "int8"
    elif quantized:  # 4-bit: the reference computed in fp32 from the same dequantized weights the merge adds to
        base_info["compute_dtype"] = {v: k for k, v in DTYPES.items()}[reference_compute or torch.float32]
    tolerance = atol + rtol * scale
    report = {
        "run_dir": str(run_dir),
        "out_dir": str(out),
        "model_head": head,
        "base": base_info,
        "merged_adapters": [e["path"] for e in lineage.get("previous_adapters", [])] + [str(run_dir / rd.ADAPTER)],
        "dtype": dtype,
        "max_abs_diff": max_diff,
        "max_abs_logit": scale,
        "tolerance": tolerance,
        "passed": max_diff <= tolerance,
        "compared": "reloaded merged model (fp32 compute) vs the adapter model as trained (base + adapter, unmerged"
                    + ("; its 4-bit layers computing in fp32 from their fp32-dequantized weights" if quantized and not
                       recipe.model.load_in_8bit else "") + "), sample prompts with the chat template",
    }
    if as_trained is not None:  # what the trained model computes in its own compute dtype: rounding, not a check
        report["trained_compute"] = {"dtype": base_info["compute_dtype"], "max_abs_diff": max(
            float((a - b).abs().max()) for a, b in zip(got, as_trained))}
    if head == "causal_lm":
        agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(got, reference))
        total = sum(r.shape[1] for r in reference)
        got_gens = _generate(reloaded, inputs, eos_ids, tokenizer.pad_token_id, max_new_tokens)
        gens = compare_generations(ref_gens, got_gens, tokenizer, tolerance)
        same = sum(g["match"] for g in gens)
        report.update(argmax_agreement=agree / total, positions=total, generations=gens,
                      generation_agreement=same / len(gens), generation_tokens=max_new_tokens)
        if dtype == "fp32":  # one rounding per weight: greedy choices may only differ at near-ties
            report["passed"] = report["passed"] and all(g["match"] or g["near_tie"] for g in gens)
        summary = (f"max |logit diff| {max_diff:.3g} (tolerance {tolerance:.3g}), argmax agreement "
                   f"{agree / total:.4f}, greedy generations identical {same}/{len(gens)}")
    else:  # plain transformers use of the export: every weight found, its own forward gives the same scores
        hf = plain_transformers_scores(reloaded, inputs, tokenizer.pad_token_id)
        expected = torch.cat(reference)
        hf_diffs = {k: float((v - expected).abs().max()) for k, v in hf.items()}
        hf_diff = max(hf_diffs.values())
        report.update(newly_initialized=sorted(info.get("missing_keys", [])), hf_max_abs_diff=hf_diff,
                      hf_max_abs_diff_by_padding=hf_diffs, scores=expected.tolist(),
                      pad_token=tokenizer.pad_token, pad_token_id=tokenizer.pad_token_id,
                      score_inputs="apply_chat_template(conversation, tokenize=True), also cut after its last "
                                   "end-of-turn token (ends in EOS); unpadded, right- and left-padded batches")
        report["passed"] = report["passed"] and not report["newly_initialized"] and hf_diff <= tolerance
        summary = (f"max |score diff| {max_diff:.3g}, plain-transformers forward {hf_diff:.3g} (tolerance "
                   f"{tolerance:.3g}), newly initialised weights: {report['newly_initialized'] or 'none'}")
    write_json(out / "verification.json", report)
    (out / "README.md").write_text(model_card(run_dir, lineage, report))
    level = log.info if report["passed"] else log.error
    level("export %s: %s -> %s", out, summary, "PASSED" if report["passed"] else "FAILED")
    return report


def _save_generation_config(merged, tokenizer, eos_ids: list[int], out: Path) -> None:
    """Generation config that stops at every EOS of the model, the tokenizer and the chat template, with the
    tokenizer's pad id."""
    from transformers import GenerationConfig

    gen = merged.generation_config if merged.generation_config is not None else GenerationConfig()
    ids = {i for i in _as_list(gen.eos_token_id) + _as_list(merged.config.eos_token_id) + eos_ids if i is not None}
    gen.eos_token_id = sorted(ids)
    gen.pad_token_id = tokenizer.pad_token_id
    gen.save_pretrained(out)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


# ---- model card ----------------------------------------------------------------------------------------------

def _stage_lineages(run_dir: Path, lineage: dict) -> list[tuple[dict, dict]]:
    """``(chain entry, that run's lineage or {})`` per merged adapter, oldest first (this run last)."""
    own = {"stage": lineage.get("stage"), "run_dir": str(run_dir), "path": str(run_dir / rd.ADAPTER),
           "adapter_type": lineage.get("adapter_type", "lora")}
    stages = []
    for entry in [*lineage.get("previous_adapters", []), own]:
        path = Path(entry.get("run_dir", "")) / rd.LINEAGE
        stages.append((entry, lineage if entry is own else json.loads(path.read_text()) if path.is_file() else {}))
    return stages


def _key_metrics(summary: dict) -> dict:
    """``{when: {metric: value}}`` for eval_before/eval_after without timing entries."""
    out = {}
    for when in ("eval_before", "eval_after"):
        values = (summary or {}).get(when) or {}
        kept = {k: v for k, v in values.items()
                if isinstance(v, (int, float)) and not any(t in k for t in _RUNTIME_METRICS)}
        if kept:
            out[when] = kept
    return out


def model_card(run_dir: Path, lineage: dict, report: dict) -> str:
    """Markdown model card (YAML front matter for the hub) with the lineage: base model, each merged stage with its
    run dir, adapter type, datasets with sha256 and key eval metrics, the export dtype and the verification."""
    from llmtune.core.artifacts import hub_datasets, portable_of, usage_snippet, versions_lines

    base = lineage.get("base_model", {})
    portable = portable_of(base)
    stages = _stage_lineages(run_dir, lineage)
    front = {"library_name": "transformers", "base_model": portable["name_or_path"],
             "license": portable.get("license"),
             "datasets": hub_datasets([d for _, lin in stages for d in lin.get("data", [])]),
             "pipeline_tag": "text-classification" if report["model_head"] == "score" else "text-generation",
             "tags": ["llmtune", *dict.fromkeys(str(e.get("stage")) for e, _ in stages), "merged-adapter"]}
    front = {k: v for k, v in front.items() if v not in (None, [])}
    kind = "Reward model (sequence classification, one score)" if report["model_head"] == "score" else "Causal LM"
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", "",
             f"# {Path(report['out_dir']).name} — merged by llmtune", "",
             f"{kind} exported from `{run_dir}` in **{report['dtype']}** (merged in fp32, cast once).", "",
             *usage_snippet(portable, "path/to/this/model", report["model_head"], "merged"),
             "## Lineage", "",
             f"- Base model: `{portable['name_or_path']}`" + (f" (revision `{portable['revision']}`)"
                                                              if portable.get("revision") else ""),
             f"- Trained against: {portable.get('weights')}",
             f"- Recipe name: `{base.get('name_or_path')}` ({base.get('kind', '?')})",
             f"- Merged into: {report['base'].get('weights')}", ""]
    for i, (entry, stage_lineage) in enumerate(stages, 1):
        lines += [f"### {i}. {entry.get('stage')} (`{entry.get('run_dir')}`)", "",
                  f"- Adapter: {entry.get('adapter_type', 'lora')} at `{entry.get('path')}`"]
        for source in stage_lineage.get("data", []):
            lines.append(f"- Data: `{source.get('path')}` ({source.get('format', '?')}, "
                         f"{source.get('rows_read', '?')} rows), sha256 `{source.get('sha256')}`")
        summary = stage_lineage.get("summary") or {}
        if "steps" in summary:
            loss = summary.get("train_loss")
            lines.append(f"- Steps: {summary['steps']}, train loss {loss:.4g}" if isinstance(loss, (int, float))
                         else f"- Steps: {summary['steps']}")
        for when, metrics in _key_metrics(summary).items():
            lines.append(f"- {when}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        lines.append("")
    lines += ["## Verification", "",
              f"- {'PASSED' if report['passed'] else 'FAILED'}: max |diff| {report['max_abs_diff']:.3g} "
              f"(tolerance {report['tolerance']:.3g}) between this model and the adapter model on "
              f"{len(SAMPLE_PROMPTS)} sample prompts"]
    if "generation_agreement" in report:
        lines.append(f"- Greedy generations ({report['generation_tokens']} tokens) identical: "
                     f"{report['generation_agreement']:.0%}; argmax agreement {report['argmax_agreement']:.4f}")
    lines += ["- Details: `verification.json`", ""]
    lines += ["## Versions", "", *versions_lines(lineage), ""]
    return "\n".join(lines)
