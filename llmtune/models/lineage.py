"""Stage chaining: ``model.from_run`` and the adapter chain.

A later stage names an earlier finished run (``model: {from_run: runs/sft}``). From that run's ``lineage.json`` and
``recipe.resolved.yaml`` it inherits the base model (``name_or_path``, ``revision``, ``trust_remote_code``), the chat
template (``data.chat_template``), the 4-bit quantization settings and the adapter chain: the earlier run's own
``previous_adapters`` followed by its adapter.

Two ways to put the chain under the new stage's adapter:

- unquantized base: the chain is merged into the base in fp32, in order, then cast once
  (:func:`load_model_with_chain`);
- 4/8-bit base (QLoRA on top of an earlier run): a quantized weight cannot take a merge (it would be rounded back
  to 4 bits, peft #2321), so the chain stays UNMERGED: every earlier adapter is loaded as a frozen peft adapter on
  the quantized base, under the new trainable one (:func:`llmtune.models.adapters.stack_frozen_adapters`). The model
  the new stage starts from is base + chain exactly, and so is its reference (DPO, KTO, PPO, GRPO: the trained
  adapter off, the frozen chain on; :func:`llmtune.models.adapters.adapter_scope`). This is TRL's "load the SFT
  adapter twice" pattern with the new stage's own adapter instead of a second copy of the SFT one, so the lineage,
  export and ``export --adapter`` treat both ways alike.

Every merge into full precision (export, a later unquantized stage, a reward model) goes into the base the chain was
trained on (:func:`trained_base`): once any run of the chain trained on a quantized base, that is the quantized base
dequantized to fp32, the weights every later adapter's update is relative to. All quantized runs of one chain must
quantize the base the same way (:func:`chain_problems`).

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
# Inherited when the new recipe leaves them at their default: (section, key). The 4-bit settings only matter when
# both runs are quantized: then the new run must quantize the base as the earlier one did (chain_problems).
INHERITED = (("model", "revision"), ("model", "trust_remote_code"), ("data", "chat_template"),
             ("model", "bnb_4bit_quant_type"), ("model", "bnb_4bit_use_double_quant"))


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


def quantization_of(model: dict, precision: dict | None = None) -> dict | None:
    """How a run quantized its base, from its resolved recipe's ``model:`` and ``precision:`` sections (dicts).

    Returns:
        ``None`` for an unquantized base, else ``{"bits": 4, "quant_type", "double_quant", "dtype"}`` or
        ``{"bits": 8, "dtype"}``: the settings that decide the quantized weights (``dtype`` = the load dtype,
        ``model.dtype`` with ``auto`` resolved as :func:`llmtune.models.load.resolve_dtype` does: the weights are
        cast to it before they are quantized). The compute dtype is not among them: it changes the arithmetic,
        not the weights.
    """
    if not (model.get("load_in_4bit") or model.get("load_in_8bit")):
        return None
    precision = precision or {}
    dtype = model.get("dtype") or "auto"
    if dtype == "auto":
        dtype = "bf16" if precision.get("bf16") else "fp16" if precision.get("fp16") else "fp32"
    if model.get("load_in_8bit"):
        return {"bits": 8, "dtype": dtype}
    return {"bits": 4, "quant_type": model.get("bnb_4bit_quant_type", "nf4"),
            "double_quant": bool(model.get("bnb_4bit_use_double_quant", True)), "dtype": dtype}


def describe_quantization(quant: dict | None) -> str:
    """``4-bit nf4 (double quantization, loaded as bf16)`` / ``8-bit (loaded as fp16)`` / ``unquantized``."""
    if quant is None:
        return "unquantized"
    if quant["bits"] == 8:
        return f"8-bit (loaded as {quant['dtype']})"
    return (f"4-bit {quant['quant_type']} ({'double' if quant['double_quant'] else 'single'} quantization, loaded as "
            f"{quant['dtype']})")


def chain_segment(chain: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """``(model dir, adapters)``: the whole model the chain's adapters apply to (the last full fine-tuning run of
    the chain, ``adapter_type: none``; ``None`` = the recipe's base) and the adapter entries after it, oldest first."""
    last = max((i for i, e in enumerate(chain) if e.get("adapter_type") == "none"), default=None)
    if last is None:
        return None, list(chain)
    return chain[last]["path"], list(chain[last + 1:])


def _entry_recipe(entry: dict[str, Any]) -> dict:
    """The resolved recipe (a dict) of the run a chain entry comes from; ``{}`` when it is not readable."""
    if not entry.get("run_dir"):
        return {}
    try:
        return read_run(entry["run_dir"])[1]
    except ModelLoadError:
        return {}


def chain_quantization(chain: list[dict[str, Any]]) -> tuple[dict | None, dict[str, Any] | None]:
    """``(quantization, entry)`` of the first run among the chain's adapters (after its last full fine-tuning run)
    that trained on a quantized base, or ``(None, None)``: from that run on, every run of the chain trained on those
    quantized weights (directly, or dequantized when a later run was unquantized)."""
    for entry in chain_segment(chain)[1]:
        raw = _entry_recipe(entry)
        quant = quantization_of(raw.get("model") or {}, raw.get("precision") or {})
        if quant is not None:
            return quant, entry
    return None, None


def full_tensors(adapter_dir: str | Path) -> list[str]:
    """Names of the whole tensors (not LoRA factors) a saved adapter holds: ``modules_to_save`` copies, saved
    embedding layers of a resized vocabulary. Reads the safetensors header only (no weights)."""
    from safetensors import safe_open

    weights = Path(adapter_dir) / "adapter_model.safetensors"
    if not weights.is_file():
        return []
    with safe_open(str(weights), "pt") as f:
        return sorted(k for k in f.keys() if "lora_" not in k)


def link_problems(links: list[dict[str, Any]], mine: dict | None,
                  where: str = "model.from_run") -> list[tuple[str, str]]:
    """What training refuses about a chain of earlier runs under a new stage, from what each run is.

    - Every quantized run of the chain (after its last full fine-tuning run), and the new stage when it quantizes,
      must quantize the base the same way (:func:`quantization_of`): the adapters were trained on those exact
      4/8-bit weights.
    - On a quantized base the chain stays unmerged (frozen adapters): an earlier adapter that holds whole tensors
      (``modules_to_save``, a resized vocabulary) cannot be stacked there.

    Args:
        links: one dict per earlier run, oldest first: ``label`` (names the run in messages), ``adapter_type``,
            ``quantization`` (:func:`quantization_of`) and ``full`` (names of the whole tensors its adapter holds or
            will hold).
        mine: the new stage's :func:`quantization_of`.
        where: how messages name the chain (``model.from_run (runs/sft)``).

    Returns:
        ``(recipe key, message)`` pairs; empty when the chain can be used.
    """
    last = max((i for i, link in enumerate(links) if link.get("adapter_type") == "none"), default=-1)
    segment = links[last + 1:]
    problems: list[tuple[str, str]] = []
    first = next((link for link in segment if link.get("quantization") is not None), None)
    for link in segment:
        if link is not first and link.get("quantization") not in (None, first and first["quantization"]):
            problems.append(("model.from_run", f"{where}: the {link['label']} trained on a "
                             f"{describe_quantization(link['quantization'])} base, the earlier {first['label']} on a "
                             f"{describe_quantization(first['quantization'])} one; a chain must quantize its base "
                             "one way"))
    if mine is not None and first is not None and mine != first["quantization"]:
        theirs = first["quantization"]
        keys = {"bits": "model.load_in_4bit", "quant_type": "model.bnb_4bit_quant_type",
                "double_quant": "model.bnb_4bit_use_double_quant", "dtype": "model.dtype"}
        fix = {"bits": f"model.load_in_{theirs['bits']}bit: true", "quant_type": "model.bnb_4bit_quant_type: "
               f"{theirs.get('quant_type')}", "double_quant": "model.bnb_4bit_use_double_quant: "
               f"{str(theirs.get('double_quant')).lower()}", "dtype": f"model.dtype: {theirs['dtype']}"}
        differ = [k for k in keys if mine.get(k) != theirs.get(k)]
        problems.append((keys[differ[0]], f"this recipe quantizes the base as {describe_quantization(mine)}, but the "
                         f"{first['label']} trained on {describe_quantization(theirs)} weights, which its adapter "
                         f"(and every later one) is relative to; set {', '.join(fix[k] for k in differ)} as in that "
                         "run (or turn quantization off: the chain is then merged into those weights dequantized)"))
    if mine is not None:
        for link in segment:
            if link.get("full"):
                full = link["full"]
                problems.append(("model.from_run", f"{where}: the {link['label']} adapter holds whole tensors "
                                 f"({', '.join(full[:3])}{', ...' if len(full) > 3 else ''}: adapter.modules_to_save "
                                 "or a resized vocabulary). On a 4/8-bit base llmtune keeps the earlier adapters "
                                 "unmerged, which works for LoRA weights only; train this stage on the unquantized "
                                 "base (model.load_in_4bit/load_in_8bit: false: the chain is then merged), or export "
                                 "that run (llmtune export RUN) and quantize its merged/ directory as "
                                 "model.name_or_path without from_run"))
    return problems


def chain_problems(recipe: Recipe, chain: list[dict[str, Any]], run: str | Path | None = None) -> list[tuple[str, str]]:
    """:func:`link_problems` of a finished chain (:func:`adapter_chain`) under ``recipe``: the earlier runs' resolved
    recipes and their adapters' safetensors headers are read, no weights."""
    if not chain:
        return []
    links = []
    for entry in chain:
        raw = _entry_recipe(entry)
        links.append({"label": f"{entry.get('stage')} run {entry.get('run_dir')}", "adapter_type":
                      entry.get("adapter_type", "lora"), "quantization": quantization_of(raw.get("model") or {},
                                                                                      raw.get("precision") or {}),
                      "full": full_tensors(entry["path"]) if entry.get("adapter_type", "lora") != "none" else []})
    mine = quantization_of(recipe.model.model_dump(mode="json"), recipe.precision.model_dump(mode="json"))
    return link_problems(links, mine, f"model.from_run ({run})" if run else "model.from_run")


def inherit_from_run(recipe: Recipe, base_dir: str | Path = ".") -> tuple[Recipe, list[dict[str, Any]]]:
    """Apply ``model.from_run``: the recipe with inherited values filled in, and the adapter chain to put under the
    new adapter (merged on an unquantized base, stacked frozen on a 4/8-bit one).

    Args:
        recipe: a validated recipe; returned unchanged with an empty chain when ``model.from_run`` is null.
        base_dir: directory a relative ``from_run`` is resolved against.

    Returns:
        ``(recipe, chain)``; the recipe is a copy and keeps ``from_run`` (it is recorded in the resolved recipe).

    Raises:
        ModelLoadError: the earlier run is not finished.
        RecipeError: the chain cannot be used under this recipe (:func:`chain_problems`: a quantization that differs
            from the chain's, whole tensors in an adapter to stack on a quantized base); all problems at once.
    """
    from llmtune.config import RecipeError
    from llmtune.config.schema import Recipe as RecipeCls

    if not recipe.model.from_run:
        return recipe, []
    run = Path(base_dir) / recipe.model.from_run
    lineage, earlier = read_run(run)
    chain = adapter_chain(run, lineage)
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
        if current not in (value, default, None):
            logger.warning("from_run %s: %s.%s = %r (set by this recipe; the earlier run used %r)",
                           run, section, key, current, value)
            continue
        doc[section][key] = value
        logger.info("from_run %s: %s.%s = %r (inherited)", run, section, key, value)
    inherited = RecipeCls.model_validate(doc)
    problems = chain_problems(inherited, chain, run)
    if problems:
        raise RecipeError(problems)
    stacked = inherited.model.load_in_4bit or inherited.model.load_in_8bit
    for entry in chain:
        logger.info("from_run %s: %s the %s adapter %s (%s)", run,
                    "stacking (frozen, unmerged) on the quantized base" if stacked else
                    "merging into the base before training", entry["stage"], entry["path"], entry["adapter_type"])
    return inherited, chain


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


def trained_base(fp32: ModelConfig, chain: list[dict[str, Any]], *, head: str = "causal_lm") -> PreTrainedModel:
    """The fp32 base the adapters of a chain were trained on, on CPU.

    The model under the chain's adapters is the recipe's base, or the last full fine-tuning run of the chain
    (:func:`chain_segment`). Once a run of the chain trained on a quantized base (QLoRA / 8-bit), it and every later
    run trained on those quantized weights (stacked on them, or dequantized), so the base is loaded quantized exactly
    as that run loaded it (its dtype, quantization settings and precision) and dequantized to fp32: the weights the
    adapters' updates are relative to. Merging them into the original weights instead gives a model nobody trained
    (off by the 4-bit rounding of every weight). Adapters trained before the first quantized run were trained on the
    original weights; merged into the dequantized ones they give the model the later runs trained and evaluated.

    Args:
        fp32: the ``model:`` section with ``dtype: fp32`` and quantization off.
        chain: the chain (:func:`adapter_chain`), oldest first; empty = the plain base.
        head: ``causal_lm`` or ``score``.

    Raises:
        ModelLoadError: the base cannot be loaded.
    """
    from llmtune.config import PrecisionConfig as Precision

    whole, _ = chain_segment(chain)
    if whole is not None:
        fp32 = fp32.model_copy(update={"name_or_path": whole})
    quant, entry = chain_quantization(chain)
    if quant is None:
        return load_model(fp32, Precision(), head=head)
    from llmtune.config import load_recipe
    from llmtune.models.quant import dequantize_to_fp32

    recipe = load_recipe(raw=_entry_recipe(entry))
    keys = ("dtype", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
            "bnb_4bit_compute_dtype")
    quantized = fp32.model_copy(update={k: getattr(recipe.model, k) for k in keys})
    logger.info("the %s adapter %s was trained on the %s base: merging the chain into that base dequantized to fp32",
                entry.get("stage"), entry["path"], describe_quantization(quant))
    return dequantize_to_fp32(load_model(quantized, recipe.precision, head=head)).to("cpu")


def load_model_with_chain(
    cfg: ModelConfig, precision: PrecisionConfig, chain: list[dict[str, Any]], *, head: str = "causal_lm",
    dtype: Any = None,
) -> PreTrainedModel:
    """Load the base and merge an adapter chain into it, in fp32, then cast once (a model without quantized layers,
    whatever ``cfg`` says about quantization: a chain on a quantized base is :func:`load_stacked_base`'s).

    Args:
        cfg: the ``model:`` section (after :func:`inherit_from_run`).
        precision: decides the final dtype with ``cfg.dtype`` (see :func:`resolve_dtype`).
        chain: entries from :func:`adapter_chain`, oldest first; empty = :func:`load_model` unchanged.
        head: ``causal_lm`` or ``score`` (see :func:`load_model`).
        dtype: final torch dtype (default: :func:`resolve_dtype`); export passes fp32.

    Returns:
        The merged model (no peft wrapper), cast to the final dtype. The adapters are merged into the base they were
        trained on (:func:`trained_base`: a QLoRA chain's dequantized 4-bit base, as ``llmtune export`` merges).

    Raises:
        ModelLoadError: the base or an adapter cannot be loaded.
    """
    if not chain:
        return load_model(cfg, precision, head=head)
    fp32 = cfg.model_copy(update={"dtype": "fp32", "load_in_4bit": False, "load_in_8bit": False})
    model = trained_base(fp32, chain, head=head)
    for entry in chain_segment(chain)[1]:
        model = merge_adapter(model, entry["path"])
    return model.to(dtype if dtype is not None else resolve_dtype(cfg, precision))


def load_stacked_base(cfg: ModelConfig, precision: PrecisionConfig, chain: list[dict[str, Any]], *,
                      head: str = "causal_lm") -> PreTrainedModel:
    """The quantized base a 4/8-bit stage trains on under an adapter chain: ``cfg``'s base (or the chain's last
    full fine-tuning run) loaded quantized as ``cfg`` says. The chain's adapters are not in it: they are stacked as
    frozen adapters when the new adapter is attached (``attach_adapter(..., frozen_chain=chain_segment(chain)[1])``).

    Raises:
        ModelLoadError: the base cannot be loaded.
    """
    whole, _ = chain_segment(chain)
    return load_model(cfg if whole is None else cfg.model_copy(update={"name_or_path": whole}), precision, head=head)
