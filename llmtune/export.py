"""``llmtune export``: merge a run's adapter chain into its base, save, reload and verify.

The chain is the run's ``previous_adapters`` (from ``model.from_run``, oldest first, in ``lineage.json``) followed
by its own adapter. Merge arithmetic is done in fp32 on an unquantized fp32 copy of the base and cast ONCE to the
output dtype (bf16 merges drift: torchtune #1101), so every merged weight equals ``round_to_dtype(W + scale * B @ A)``
computed in fp32. The saved model is then reloaded with the plain ``Auto*`` class of its head and compared with
the adapter model on sample prompts: logits for a causal LM (``AutoModelForCausalLM``); for a reward model
(``model_head: score``) the one score per sequence (``AutoModelForSequenceClassification``, which must find every
weight, the trained head included: trl #368 lost the head by saving an RM as a causal LM).
"""

from __future__ import annotations

from pathlib import Path

import json

import torch
import yaml

from llmtune.config import Recipe, load_recipe
from llmtune.core import rundir as rd
from llmtune.utils import get_logger, setup_logging, write_json

log = get_logger("export")

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# max |merged - adapter| <= atol + rtol * max |adapter logits|, per output dtype. For fp32 the merge itself
# is one rounding per weight; what remains is fp32 accumulation noise of two different computation orders
# (x W + s (x A) B vs x (W + s B A)), which grows with the logit scale and depth: measured 9.7e-5 at
# max |logit| 43 on SmolLM2-135M (30 layers). Wrong merges (lost scaling, heads, tied weights) are >= 1e-2.
TOLERANCE = {"fp32": (1e-4, 1e-6), "fp16": (1e-2, 1e-2), "bf16": (5e-2, 4e-2)}
SAMPLE_PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write one sentence about the sea.",
    "What is 12 * 7?",
]


class ExportError(RuntimeError):
    """The run cannot be exported (not finished, unsupported adapter) or verification failed."""


def load_run_recipe(run_dir: Path) -> Recipe:
    """The resolved recipe a run was trained with.

    Raises:
        ExportError: the directory is not a finished run.
    """
    if not (run_dir / rd.LINEAGE).is_file():
        raise ExportError(
            f"{run_dir} is not a finished run (no {rd.LINEAGE}); train it to the end, or resume it with "
            "train.resume_from=latest"
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


def auto_class(head: str):
    """The plain transformers class a merged model of this head reloads with."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    return AutoModelForSequenceClassification if head == "score" else AutoModelForCausalLM


@torch.no_grad()
def _outputs(model, inputs: list[torch.Tensor], head: str) -> list[torch.Tensor]:
    """Per prompt: (1, T, V) fp32 logits of a causal LM, or the (1,) fp32 score read at the last token."""
    from llmtune.models import sequence_scores

    model.eval()
    if head == "score":
        return [sequence_scores(model, x, torch.ones_like(x)) for x in inputs]
    return [model(input_ids=x).logits.float() for x in inputs]


def merge_adapter(run_dir: Path, recipe: Recipe, lineage: dict | None = None):
    """Base (fp32, unquantized) with the earlier adapters merged + the run's adapter -> ``(peft_model, tokenizer)``;
    the run's own adapter is not merged yet. ``lineage`` defaults to the run's ``lineage.json``."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from llmtune.config import PrecisionConfig
    from llmtune.models import load_model_with_chain

    if lineage is None:
        lineage = json.loads((run_dir / rd.LINEAGE).read_text())
    head = lineage.get("model_head", "causal_lm")
    adapter_dir = run_dir / rd.ADAPTER
    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    if recipe.adapter.type == "none":  # full fine-tuning: the adapter dir is the whole model
        return auto_class(head).from_pretrained(adapter_dir, dtype=torch.float32), tokenizer
    base_cfg = recipe.model.model_copy(update={"load_in_4bit": False, "load_in_8bit": False, "dtype": "fp32"})
    if recipe.model.load_in_4bit or recipe.model.load_in_8bit:
        log.warning("the run trained on a quantized base; merging into the unquantized fp32 base weights")
    chain = lineage.get("previous_adapters", [])
    for entry in chain:
        log.info("merging the earlier %s adapter %s", entry.get("stage"), entry["path"])
    base = load_model_with_chain(base_cfg, PrecisionConfig(), chain, head=head, dtype=torch.float32)
    if head == "score" and base.config.pad_token_id is None:
        base.config.pad_token_id = tokenizer.pad_token_id
    return PeftModel.from_pretrained(base, adapter_dir, is_trainable=False), tokenizer


def export_run(run_dir: str | Path, dtype: str = "auto", out_dir: str | Path | None = None,
               max_shard_size: str = "2GB") -> dict:
    """Merge, save and verify a finished run; writes ``verification.json`` into the output directory.

    Args:
        run_dir: finished run directory.
        dtype: ``fp32``/``fp16``/``bf16``, or ``auto`` = the run's training precision.
        out_dir: default ``run_dir/merged``.
        max_shard_size: largest safetensors shard.

    Returns:
        The verification report (``passed``, ``max_abs_diff``, ``tolerance``, ``argmax_agreement``, ...). For a
        reward model: ``newly_initialized`` (weights the plain reload had to initialise; must be empty) and
        ``hf_max_abs_diff`` (the reload's own ``forward`` scores vs the adapter model's).

    Raises:
        ExportError: the run is not finished.
    """
    setup_logging()
    run_dir = Path(run_dir)
    recipe = load_run_recipe(run_dir)
    lineage = json.loads((run_dir / rd.LINEAGE).read_text())
    head = lineage.get("model_head", "causal_lm")
    if dtype == "auto":
        dtype = "bf16" if recipe.precision.bf16 else "fp16" if recipe.precision.fp16 else "fp32"
    out = Path(out_dir) if out_dir else run_dir / "merged"
    model, tokenizer = merge_adapter(run_dir, recipe, lineage)
    inputs = sample_inputs(tokenizer)
    reference = _outputs(model, inputs, head)  # adapter model, fp32, unmerged
    merged = model.merge_and_unload() if hasattr(model, "merge_and_unload") else model  # fp32 arithmetic
    merged = merged.to(DTYPES[dtype])  # the one cast
    merged.config.use_cache = True
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True, max_shard_size=max_shard_size)
    tokenizer.save_pretrained(out)
    if head == "causal_lm":
        _save_generation_config(merged, tokenizer, out)

    reloaded, info = auto_class(head).from_pretrained(out, dtype=torch.float32, output_loading_info=True)
    got = _outputs(reloaded, inputs, head)
    max_diff = max(float((a - b).abs().max()) for a, b in zip(got, reference))
    scale = max(float(r.abs().max()) for r in reference)
    atol, rtol = TOLERANCE[dtype]
    tolerance = atol + rtol * scale
    report = {
        "run_dir": str(run_dir),
        "out_dir": str(out),
        "model_head": head,
        "merged_adapters": [e["path"] for e in lineage.get("previous_adapters", [])] + [str(run_dir / rd.ADAPTER)],
        "dtype": dtype,
        "max_abs_diff": max_diff,
        "max_abs_logit": scale,
        "tolerance": tolerance,
        "passed": max_diff <= tolerance,
        "compared": "reloaded merged model (fp32 compute) vs base + adapter (fp32), sample prompts with the chat template",
    }
    if head == "causal_lm":
        agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(got, reference))
        total = sum(r.shape[1] for r in reference)
        report.update(argmax_agreement=agree / total, positions=total)
        summary = f"max |logit diff| {max_diff:.3g} (tolerance {tolerance:.3g}), argmax agreement {agree / total:.4f}"
    else:  # plain transformers use of the export: every weight found, its own forward gives the same scores
        with torch.no_grad():
            hf = [reloaded(input_ids=x).logits[:, 0].float() for x in inputs]
        hf_diff = max(float((a - b).abs().max()) for a, b in zip(hf, reference))
        report.update(newly_initialized=sorted(info.get("missing_keys", [])), hf_max_abs_diff=hf_diff,
                      scores=[float(r[0]) for r in reference])
        report["passed"] = report["passed"] and not report["newly_initialized"] and hf_diff <= tolerance
        summary = (f"max |score diff| {max_diff:.3g}, plain-transformers forward {hf_diff:.3g} (tolerance "
                   f"{tolerance:.3g}), newly initialised weights: {report['newly_initialized'] or 'none'}")
    write_json(out / "verification.json", report)
    level = log.info if report["passed"] else log.error
    level("export %s: %s -> %s", out, summary, "PASSED" if report["passed"] else "FAILED")
    return report


def _save_generation_config(merged, tokenizer, out: Path) -> None:
    """Generation config that stops at every EOS of the model and the tokenizer, with the tokenizer's pad id."""
    from transformers import GenerationConfig

    gen = merged.generation_config if merged.generation_config is not None else GenerationConfig()
    eos_ids = {i for i in _as_list(gen.eos_token_id) + _as_list(merged.config.eos_token_id) if i is not None}
    eos_ids.add(tokenizer.eos_token_id)
    gen.eos_token_id = sorted(eos_ids)
    gen.pad_token_id = tokenizer.pad_token_id
    gen.save_pretrained(out)


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]

