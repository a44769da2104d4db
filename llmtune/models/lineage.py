"""Stage chaining: ``model.from_run`` and the adapter chain.

A later stage names an earlier finished run (``model: {from_run: runs/sft}``). From that run's ``lineage.json`` and
``recipe.resolved.yaml`` it inherits the base model (``name_or_path``, ``revision``, ``trust_remote_code``), the chat
template (``data.chat_template``) and the adapter chain: the earlier run's own ``previous_adapters`` followed by its
adapter. The chain is merged into the base in fp32, in order, before the new stage's adapter is attached
(:func:`load_model_with_chain`); export merges the same chain (then the run's own adapter).

A value the new recipe sets to something other than its default wins over the inherited one; every inherited and
every overridden value is logged.

A chain entry is ``{"stage", "run_dir", "path", "adapter_type"}`` with absolute paths; ``adapter_type: none`` means the
earlier run fine-tuned every weight and ``path`` holds a whole model, which replaces the model built so far.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmtune.models.load import ModelLoadError, load_model, resolve_dtype

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from llmtune.config import PrecisionConfig, Recipe
    from llmtune.config.schema import ModelConfig

logger = logging.getLogger(__name__)

LINEAGE, RECIPE, ADAPTER = "lineage.json", "recipe.resolved.yaml", "adapter"  # names of llmtune.core.rundir
# Inherited when the new recipe leaves them at their default: (section, key).
INHERITED = (("model", "revision"), ("model", "trust_remote_code"), ("data", "chat_template"))


def read_run(run_dir: str | Path) -> tuple[dict, dict]:
    """``(lineage, resolved recipe as a dict)`` of a finished run.

    Raises:
        ModelLoadError: the directory does not exist or the run is not finished (no ``lineage.json``).
    """
    import yaml

    run = Path(run_dir)
    if not (run / LINEAGE).is_file():
        state = "does not exist" if not run.exists() else f"is not a finished run (no {LINEAGE})"
        raise ModelLoadError(
            f"model.from_run: {run} {state}; train that stage to the end first (its training command "
            "continues from its newest complete checkpoint), or fix the path (relative paths are relative to the working directory)"
        )
    lineage = json.loads((run / LINEAGE).read_text())
    recipe = yaml.safe_load((run / RECIPE).read_text()) if (run / RECIPE).is_file() else {}
    return lineage, recipe or {}


def adapter_chain(run_dir: str | Path, lineage: dict) -> list[dict[str, Any]]:
    """The adapters to merge, oldest first, to rebuild the model a run ended with (its own adapter last)."""
    run = Path(run_dir).resolve()
    own = {"stage": lineage.get("stage"), "run_dir": str(run), "path": str(run / lineage.get("adapter", ADAPTER)),
           "adapter_type": lineage.get("adapter_type", "lora")}
    return [*lineage.get("previous_adapters", []), own]


def from_run_problems(recipe: Recipe, stage: str, head: str, base_dir: str | Path = ".") -> list[tuple[str, str]]:
    """A finished ``model.from_run`` whose model cannot start this stage, as ``(key, message)``: a reward model
    (``model_head: score``: an `llmtune rm` run) under a causal-LM stage (SFT, DPO, ORPO, SimPO, KTO, PPO, GRPO), whose
    chain would otherwise be merged into the policy without a word. A causal-LM run under a score-head stage (RM
    from SFT) is the usual chain and fits. Read from ``lineage.json`` only: no weights (``llmtune validate`` reports
    it too). An unfinished or missing run is reported by :func:`read_run` when the stage starts.

    Args:
        recipe: the recipe. stage: the stage's name. head: the stage's ``model_head`` (``causal_lm`` | ``score``).
        base_dir: directory a relative ``from_run`` is resolved against.
    """
    if not recipe.model.from_run:
        return []
    lineage_path = Path(base_dir) / recipe.model.from_run / LINEAGE
    if not lineage_path.is_file():
        return []
    lineage = json.loads(lineage_path.read_text())
    earlier = lineage.get("model_head", "causal_lm")
    if earlier == "score" and head != "score":
        return [("model.from_run", f"{recipe.model.from_run} is an `llmtune {lineage.get('stage', 'rm')}` run: a reward "
                 f"model (a score head, no language-model head), which cannot be the policy of `llmtune {stage}`. "
                 "Point model.from_run to the policy's run (e.g. the SFT run the reward model was trained from); a "
                 "reward model is used through reward.from_run (ppo, grpo)")]
    return []


def inherit_from_run(recipe: Recipe, base_dir: str | Path = ".") -> tuple[Recipe, list[dict[str, Any]]]:
    """Apply ``model.from_run``: the recipe with inherited values filled in, and the adapter chain to merge.

    Args:
        recipe: a validated recipe; returned unchanged with an empty chain when ``model.from_run`` is null.
        base_dir: directory a relative ``from_run`` is resolved against.

    Returns:
        ``(recipe, chain)``; the recipe is a copy and keeps ``from_run`` (it is recorded in the resolved recipe).

    Raises:
        ModelLoadError: the earlier run is not finished, or the new recipe quantizes the base (4/8 bit), which
            cannot take an fp32-merged chain.
    """
    from llmtune.config.schema import Recipe as RecipeCls

    if not recipe.model.from_run:
        return recipe, []
    run = Path(base_dir) / recipe.model.from_run
    lineage, earlier = read_run(run)
    chain = adapter_chain(run, lineage)
    if recipe.model.load_in_4bit or recipe.model.load_in_8bit:
        raise ModelLoadError(
            f"model.from_run ({run}) merges the earlier adapters into the base in fp32, which a 4/8-bit base cannot "
            f"take; export the earlier run (llmtune export {run}) and use its merged/ directory as "
            "model.name_or_path without from_run, or turn off model.load_in_4bit/load_in_8bit"
        )
    doc = recipe.model_dump(mode="json")
    defaults = RecipeCls().model_dump(mode="json")
    base = lineage.get("base_model", {})
    recorded_base = base.get("path") if base.get("kind") == "local" else base.get("name_or_path")
    values = [("model", "name_or_path", recorded_base)]
    values += [(s, k, earlier.get(s, {}).get(k)) for s, k in INHERITED if k in earlier.get(s, {})]
    for section, key, value in values:
        current, default = doc[section][key], defaults[section][key]
        if value is None:
            continue
        if current not in (value, default):
            logger.warning("from_run %s: %s.%s = %r (set by this recipe; the earlier run used %r)",
                           run, section, key, current, value)
            continue
        doc[section][key] = value
        logger.info("from_run %s: %s.%s = %r (inherited)", run, section, key, value)
    for entry in chain:
        logger.info("from_run %s: merging the %s adapter %s (%s) into the base before training",
                    run, entry["stage"], entry["path"], entry["adapter_type"])
    return RecipeCls.model_validate(doc), chain


def adapter_vocab_rows(model: PreTrainedModel, adapter_dir: str | Path) -> int | None:
    """Rows of the input embedding a saved adapter holds in full (``modules_to_save`` or peft's
    ``save_embedding_layers``), or ``None`` when it holds none (or is not saved as safetensors: peft then reports).
    """
    from safetensors import safe_open

    weights = Path(adapter_dir) / "adapter_model.safetensors"
    if not weights.is_file():
        return None
    emb = model.get_input_embeddings()
    name = next((n for n, m in model.named_modules() if m is emb), None)
    if name is None:
        return None
    rows = None
    with safe_open(str(weights), "pt") as f:  # keys: base_model.model.<name>[.modules_to_save.<adapter>].weight
        for key in f.keys():
            if key.startswith(f"base_model.model.{name}.") and key.endswith("weight") and "lora_" not in key:
                rows = max(rows or 0, f.get_slice(key).get_shape()[0])
    return rows


def fit_vocab_to_adapter(model: PreTrainedModel, adapter_dir: str | Path) -> None:
    """Resize ``model``'s token embeddings (in place) to the vocabulary an adapter was trained with.

    A run that added tokens resized the embeddings before training; the new rows only exist in the adapter, which
    must then hold the full input embedding and, for a causal LM with an untied head, the full output head
    (``adapter.modules_to_save: [embed_tokens, lm_head]``). peft cannot load such an adapter into the base
    until the base has the same number of rows.

    Raises:
        ModelLoadError: the vocabulary was resized but the adapter lacks the output head, so the logits of the new
            tokens cannot be rebuilt.
    """
    from safetensors import safe_open

    rows = adapter_vocab_rows(model, adapter_dir)
    current = model.get_input_embeddings().weight.shape[0]
    if rows is None or rows == current:
        return
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is model.get_input_embeddings().weight
    if head is not None and not tied:
        name = next(n for n, m in model.named_modules() if m is head)
        with safe_open(str(Path(adapter_dir) / "adapter_model.safetensors"), "pt") as f:
            has_head = any(k.startswith(f"base_model.model.{name}.") and "lora_" not in k for k in f.keys())
        if not has_head:
            raise ModelLoadError(
                f"{adapter_dir} was trained with {rows} token embeddings (the base has {current}) but does not hold "
                f"the output head {name}, so the logits of the added tokens cannot be rebuilt; train with "
                f"adapter.modules_to_save: [{name.rsplit('.', 1)[-1]}, "
                f"{next(n for n, m in model.named_modules() if m is model.get_input_embeddings()).rsplit('.', 1)[-1]}]"
            )
    logger.info("resizing the token embeddings %d -> %d to fit the adapter %s", current, rows, adapter_dir)
    model.resize_token_embeddings(rows, mean_resizing=False)  # every new row is overwritten by the adapter


def merge_adapter(model: PreTrainedModel, adapter_dir: str | Path) -> PreTrainedModel:
    """Merge a saved peft adapter into ``model`` (in the model's dtype) and return the plain model.

    The adapter is applied with the task-agnostic ``PeftModel`` so that, e.g., an SFT (causal LM) adapter merges
    into the backbone of a sequence-classification model; weights the model lacks (``lm_head`` of a causal LM
    adapter on a score model) are skipped by peft with a warning.

    Raises:
        ModelLoadError: the adapter cannot be read or does not fit the model.
    """
    from peft import PeftConfig, PeftModel

    from llmtune.models.weight_files import check_weight_files

    check_weight_files(adapter_dir)  # a truncated/corrupt adapter file is named
    fit_vocab_to_adapter(model, adapter_dir)
    try:
        config = PeftConfig.from_pretrained(str(adapter_dir))
        config.task_type, config.inference_mode = None, True
        return PeftModel.from_pretrained(model, str(adapter_dir), config=config).merge_and_unload()
    except Exception as err:  # noqa: BLE001
        raise ModelLoadError(
            f"could not merge the adapter {adapter_dir} into {type(model).__name__}: {type(err).__name__}: {err}"
        ) from err


def trained_base(fp32: ModelConfig, entry: dict[str, Any], *, head: str = "causal_lm") -> PreTrainedModel:
    """The fp32 base the first adapter of a chain was trained on, on CPU.

    An unquantized run trained on the base itself. A QLoRA/8-bit run (``load_in_4bit``/``load_in_8bit`` in its
    resolved recipe) trained on the quantized base: it is loaded quantized exactly as that run loaded it (its
    dtype, quantization settings and precision) and dequantized to fp32, the weights its adapter's update is
    relative to (merging it into the original weights instead gives a model nobody trained; off by the 4-bit
    rounding of every weight). Only the first run of a chain can be quantized: ``model.from_run`` refuses a
    quantized base.

    Args:
        fp32: the ``model:`` section with ``dtype: fp32`` and quantization off.
        entry: the chain's first entry (:func:`adapter_chain`).
        head: ``causal_lm`` or ``score``.

    Raises:
        ModelLoadError: the base cannot be loaded, or the earlier run's recipe is not readable.
    """
    from llmtune.config import PrecisionConfig as Precision

    raw = read_run(entry["run_dir"])[1] if entry.get("run_dir") else {}
    earlier = (raw.get("model") or {})
    if entry.get("adapter_type") == "none" or not (earlier.get("load_in_4bit") or earlier.get("load_in_8bit")):
        return load_model(fp32, Precision(), head=head)
    from llmtune.config import load_recipe
    from llmtune.models.quant import dequantize_to_fp32

    recipe = load_recipe(raw=raw)
    keys = ("dtype", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
            "bnb_4bit_compute_dtype")
    quantized = fp32.model_copy(update={k: getattr(recipe.model, k) for k in keys})
    logger.info("the %s adapter %s was trained on the %s base: merging it into that base dequantized to fp32",
                entry.get("stage"), entry["path"], "4-bit" if quantized.load_in_4bit else "8-bit")
    return dequantize_to_fp32(load_model(quantized, recipe.precision, head=head)).to("cpu")


def load_model_with_chain(
    cfg: ModelConfig, precision: PrecisionConfig, chain: list[dict[str, Any]], *, head: str = "causal_lm",
    dtype: Any = None,
) -> PreTrainedModel:
    """Load the base and merge an adapter chain into it, in fp32, then cast once.

    Args:
        cfg: the ``model:`` section (after :func:`inherit_from_run`).
        precision: decides the final dtype with ``cfg.dtype`` (see :func:`resolve_dtype`).
        chain: entries from :func:`adapter_chain`, oldest first; empty = :func:`load_model` unchanged.
        head: ``causal_lm`` or ``score`` (see :func:`load_model`).
        dtype: final torch dtype (default: :func:`resolve_dtype`); export passes fp32.

    Returns:
        The merged model (no peft wrapper), cast to the final dtype. The first adapter is merged into the base it
        was trained on (:func:`trained_base`: a QLoRA run's dequantized 4-bit base, as ``llmtune export`` merges).

    Raises:
        ModelLoadError: the base or an adapter cannot be loaded.
    """
    from llmtune.config import PrecisionConfig as Precision

    if not chain:
        return load_model(cfg, precision, head=head)
    fp32 = cfg.model_copy(update={"dtype": "fp32", "load_in_4bit": False, "load_in_8bit": False})
    model = trained_base(fp32, chain[0], head=head)
    for entry in chain:
        if entry.get("adapter_type") == "none":  # full fine-tuning: the saved directory is the whole model
            model = load_model(fp32.model_copy(update={"name_or_path": entry["path"]}), Precision(), head=head)
        else:
            model = merge_adapter(model, entry["path"])
    return model.to(dtype if dtype is not None else resolve_dtype(cfg, precision))
