"""``llmtune export RUN --adapter``: one peft adapter equal to a run's whole adapter chain, on the original base.

A run trained with ``model.from_run`` learned its adapter on the base *with the earlier adapters merged*, so its
``adapter/`` alone on the base is a different model. LoRA updates add up, so the chain is one LoRA of the summed
rank: for every adapted module with links ``i`` (``delta_i = s_i * B_i @ A_i``, ``s_i = alpha_i / r_i``, or
``alpha_i / sqrt(r_i)`` with rsLoRA),

    sum_i s_i B_i A_i = [s_1 B_1 | s_2 B_2 | ...] @ [A_1; A_2; ...]

so the exported ``lora_A`` stacks the ``A_i`` along the rank (dim 0), ``lora_B`` concatenates the scaled ``B_i``
(dim 1) and the exported scaling is 1 (``lora_alpha = r``, no rsLoRA). Modules adapted by fewer links are padded
with zero rank rows/columns to the common rank ``r`` (exact: they add zero). Modules a link trained in full
(``modules_to_save``) take that link's weights, which supersede the earlier links' updates of that module (the
link was trained starting from them). The result is exact up to fp32 rounding, and verified like the merge: plain
``PeftModel.from_pretrained(base, exported)`` against llmtune's chain model on the sample prompts.

Refused (not exactly one LoRA): DoRA links in a chain (the magnitude vector is not additive), LoRA on a module an
earlier link trained in full, ``rank_pattern``/``alpha_pattern``, LoRA biases, resized vocabularies, full
fine-tuning links, a QLoRA run on top of a full fine-tuning run (no hub base is its base). A QLoRA run's chain (stacked
frozen on the 4-bit base in training) folds the same way: the adapter is for the 4-bit base, and it is verified on
the base loaded with the run's ``BitsAndBytesConfig`` by plain transformers (both models' 4-bit layers computing in
fp32, so that the fp32 tolerance holds).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from llmtune.core import rundir as rd
from llmtune.export.merge import (
    TOLERANCE, ExportError, auto_class, fp32_compute_4bit, load_adapter_model, load_run_recipe, sample_inputs,
)
from llmtune.utils import get_logger, setup_logging, write_json

log = get_logger("export")

_PREFIX = "base_model.model."
_PAIRS = (("lora_A", "lora_B"), ("lora_embedding_A", "lora_embedding_B"))
_UNSUPPORTED = {"rank_pattern": {}, "alpha_pattern": {}, "lora_bias": False, "bias": "none", "use_dora": False,
                "trainable_token_indices": None, "target_parameters": None, "layer_replication": None}


def _read_link(entry: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    """``(adapter_config, state dict)`` of one chain entry's saved adapter."""
    from safetensors.torch import load_file

    path = Path(entry["path"])
    if entry.get("adapter_type", "lora") == "none":
        raise ExportError(f"the chain holds a full fine-tuning run ({entry.get('run_dir')}): its weights are a "
                          "whole model, not an adapter; export a merged model (llmtune export RUN) instead")
    weights = path / "adapter_model.safetensors"
    if not weights.is_file():
        raise ExportError(f"adapter {path} has no adapter_model.safetensors (of the chain entry {entry.get('stage')})")
    return json.loads((path / "adapter_config.json").read_text()), load_file(str(weights))


def _scale(config: dict, rank: int) -> float:
    """peft's LoRA scaling of one module: alpha / r, or alpha / sqrt(r) with rsLoRA."""
    alpha = float(config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def concatenate_chain(links: list[tuple[dict, dict[str, torch.Tensor]]], modules: set[str] | None = None):
    """Fold a chain of LoRA adapters (oldest first) into one adapter: ``(adapter_config, state dict, notes)``.

    Args:
        links: ``(adapter_config.json as a dict, adapter state dict)`` per link, in training order.
        modules: module names of the target model (``model.layers.0.self_attn.q_proj``, ``score``, ...); pieces of
            modules it lacks (an SFT link's ``lm_head`` under a reward model) are left out and noted, as the chain
            merge skips them. ``None`` keeps everything.

    Returns:
        The peft config of the single adapter (``r = lora_alpha`` = the largest summed rank, ``target_modules`` =
        full module names, ``modules_to_save``, the last link's ``task_type``), its state dict in peft's saved key
        format (``base_model.model.<module>.lora_A.weight``; fp32) and notes on what was left out.

    Raises:
        ExportError: a link is not exactly representable (see the module docstring).
    """
    if not links:
        raise ExportError("the adapter chain is empty")
    if len(links) == 1:  # nothing to fold: the adapter as trained (DoRA, patterns and all) is the chain
        return dict(links[0][0]), dict(links[0][1]), []
    dora = [i for i, (cfg, _) in enumerate(links, 1) if cfg.get("use_dora")]
    if dora:
        raise ExportError(f"link {dora[0]} of the chain is DoRA: a DoRA update rescales each weight column by a "
                          "learned magnitude, so DoRA links do not add up into one adapter exactly; export a merged "
                          "model (llmtune export RUN) instead")
    pieces: dict[str, dict] = {}  # module -> {"kind", "A": [...], "B": [...]} (LoRA) or {"full": {param: tensor}}
    notes: list[str] = []
    for index, (cfg, state) in enumerate(links, 1):
        for key, expected in _UNSUPPORTED.items():
            if cfg.get(key) is not None and cfg.get(key) != expected:
                raise ExportError(f"link {index} of the chain sets {key}={cfg.get(key)!r}; llmtune export --adapter "
                                  "can only fold plain LoRA/rsLoRA links; export a merged model instead")
        saved = list(cfg.get("modules_to_save") or [])
        full: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in state.items():
            name = key.removeprefix(_PREFIX)
            pair = next(((a, b) for a, b in _PAIRS if f".{a}." in name or f".{b}." in name
                         or name.endswith((f".{a}", f".{b}"))), None)
            if pair is not None:
                continue
            module, _, param = name.rpartition(".")
            if not any(module == m or module.endswith("." + m) for m in saved):
                raise ExportError(f"link {index} of the chain holds the full tensor {key} outside modules_to_save "
                                  "(saved embedding layers of a resized vocabulary?); export a merged model instead")
            full.setdefault(module, {})[param] = tensor.float()
        for a_name, b_name in _PAIRS:
            for key, a in state.items():
                name = key.removeprefix(_PREFIX)
                suffix = f".{a_name}.weight" if a_name == "lora_A" else f".{a_name}"
                if not name.endswith(suffix):
                    continue
                module = name.removesuffix(suffix)
                b = state[_PREFIX + module + suffix.replace(a_name, b_name)]
                entry = pieces.setdefault(module, {"kind": a_name, "A": [], "B": []})
                if "full" in entry:
                    raise ExportError(f"link {index} adapts {module} with LoRA after an earlier link trained it in "
                                      "full (modules_to_save): one peft adapter cannot hold both; export a merged model")
                entry["A"].append(a.float())  # (r_i, in) or, for embeddings, (r_i, num_embeddings)
                entry["B"].append(b.float() * _scale(cfg, a.shape[0]))  # (out, r_i) scaled by s_i
        for module, params in full.items():  # trained from the chain so far: supersedes earlier updates
            pieces[module] = {"full": params}
    if modules is not None:
        missing = sorted(m for m in pieces if m not in modules)
        for m in missing:
            del pieces[m]
        if missing:
            notes.append(f"left out (not in the target model, as the chain merge skips them): {', '.join(missing)}")
    lora = {m: p for m, p in pieces.items() if "full" not in p}
    rank = max((sum(a.shape[0] for a in p["A"]) for p in lora.values()), default=1)
    tensors: dict[str, torch.Tensor] = {}
    for module, p in sorted(lora.items()):
        a, b = torch.cat(p["A"], dim=0), torch.cat(p["B"], dim=1)
        pad = rank - a.shape[0]
        if pad:  # zero rank rows/columns: exact
            a = torch.cat([a, a.new_zeros((pad, *a.shape[1:]))], dim=0)
            b = torch.cat([b, b.new_zeros((b.shape[0], pad, *b.shape[2:]))], dim=1)
        a_key, b_key = ("lora_A.weight", "lora_B.weight") if p["kind"] == "lora_A" else \
            ("lora_embedding_A", "lora_embedding_B")
        tensors[f"{_PREFIX}{module}.{a_key}"] = a.contiguous()
        tensors[f"{_PREFIX}{module}.{b_key}"] = b.contiguous()
    saved_modules = sorted(m for m, p in pieces.items() if "full" in p)
    for module in saved_modules:
        for param, tensor in pieces[module]["full"].items():
            tensors[f"{_PREFIX}{module}.{param}"] = tensor.contiguous()
    config = dict(links[-1][0])  # task type, peft version, ... of the last link
    config.update(r=rank, lora_alpha=rank, use_rslora=False, use_dora=False, lora_dropout=0.0,
                  target_modules=sorted(lora), modules_to_save=saved_modules or None, rank_pattern={},
                  alpha_pattern={}, layers_to_transform=None, layers_pattern=None, inference_mode=True)
    return config, tensors, notes


def export_adapter(run_dir: str | Path, out_dir: str | Path | None = None) -> dict:
    """Write ``RUN_DIR/exported_adapter`` (or ``out_dir``): one adapter equal to the run's whole chain on the
    original base, loadable with plain ``PeftModel.from_pretrained``, then verify it.

    Verification: plain transformers loads the base in fp32 (with a one-score head for reward models) and plain peft
    the exported adapter; its logits (reward models: scores) on the sample prompts are compared with llmtune's
    chain model (the base with the earlier adapters merged in fp32, plus the run's adapter); fp32 tolerance.

    Returns:
        The report (also ``verification.json``): ``passed``, ``max_abs_diff``, ``tolerance``, ``links``,
        ``rank``, ``notes``.

    Raises:
        ExportError: the run is unfinished, quantized or full fine-tuning, or a link cannot be folded exactly.
    """
    from peft import PeftModel
    from safetensors.torch import save_file

    from llmtune.core.artifacts import front_matter, hub_datasets, lineage_lines, usage_snippet
    from llmtune.models import resolve_model_source
    from llmtune.models.lineage import adapter_chain
    from llmtune.models.portable import clean_tokenizer_config, model_max_length, portable_base

    setup_logging()
    run_dir = Path(run_dir)
    recipe = load_run_recipe(run_dir)
    lineage = json.loads((run_dir / rd.LINEAGE).read_text())
    head = lineage.get("model_head", "causal_lm")
    if recipe.adapter.type == "none":
        raise ExportError(f"{run_dir} fine-tuned every weight (adapter.type: none): there is no adapter to export; "
                          "use llmtune export RUN for the model")
    quantized = recipe.model.load_in_4bit or recipe.model.load_in_8bit
    if quantized and any(e.get("adapter_type") == "none" for e in lineage.get("previous_adapters", [])):
        raise ExportError(f"{run_dir} trained on a quantized full fine-tuning run of its chain: there is no base an "
                          "adapter alone can load on; export a merged model (llmtune export RUN) instead")
    out = Path(out_dir) if out_dir else run_dir / "exported_adapter"
    if out.exists() and any(out.iterdir()):
        if not (out / "verification.json").is_file() or (out / "config.json").exists():
            raise ExportError(f"--out {out} exists and is not an earlier exported adapter; give a new or empty "
                              "directory (an earlier llmtune export --adapter output is replaced)")
        shutil.rmtree(out)
    chain = adapter_chain(run_dir, lineage)
    links = [_read_link(e) for e in chain]

    reference_model, tokenizer, _ = load_adapter_model(run_dir, recipe, lineage)
    inputs = sample_inputs(tokenizer)
    with torch.no_grad(), fp32_compute_4bit(reference_model):  # 4-bit layers in fp32: the function itself, no
        reference = [reference_model(input_ids=x).logits.float() for x in inputs]  # bf16 rounding per link
    del reference_model

    source = resolve_model_source(recipe.model)
    extra = {"num_labels": 1} if head == "score" else {}
    from llmtune.models.load import quantization_kwargs, quiet_load_report

    quantization = quantization_kwargs(recipe.model, recipe.precision)
    if quantized:  # the base as training quantized it: plain transformers + bitsandbytes, as the card shows
        extra.update(quantization_config=plain_quantization_config(quantization),
                     dtype=getattr(torch, quantization["dtype"]))
    with quiet_load_report():  # a one-score head is always new here (the trained one is in the adapter)
        base = auto_class(head).from_pretrained(source.path, **{"dtype": torch.float32, **extra})
    if quantized:
        from peft import prepare_model_for_kbit_training

        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)  # as training did
    if head == "score" and base.config.pad_token_id is None:
        base.config.pad_token_id = tokenizer.pad_token_id
    config, tensors, notes = concatenate_chain(links, {n for n, _ in base.named_modules()})
    portable = portable_base(recipe.model.name_or_path, source.kind, str(source.path), source.revision)
    config["base_model_name_or_path"] = portable["name_or_path"]
    config["revision"] = portable["revision"]
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out)
    clean_tokenizer_config(out, model_max_length(source.path))

    plain = PeftModel.from_pretrained(base, str(out)).eval()  # what a peft user does
    with torch.no_grad(), fp32_compute_4bit(plain):
        got = [plain(input_ids=x).logits.float() for x in inputs]
    max_diff = max(float((a - b).abs().max()) for a, b in zip(got, reference))
    scale = max(float(r.abs().max()) for r in reference)
    atol, rtol = TOLERANCE["fp32"]
    if recipe.model.load_in_8bit:  # LLM.int8 layers return fp16, rounded per stacked link and once when folded
        atol, rtol = max(atol, TOLERANCE["fp16"][0]), max(rtol, TOLERANCE["fp16"][1])
    tolerance = atol + rtol * scale
    report = {
        "run_dir": str(run_dir), "out_dir": str(out), "model_head": head,
        "links": [{"stage": e.get("stage"), "path": e.get("path"), "r": c.get("r"), "lora_alpha": c.get("lora_alpha"),
                   "use_rslora": bool(c.get("use_rslora")), "target_modules": c.get("target_modules"),
                   "modules_to_save": c.get("modules_to_save")} for e, (c, _) in zip(chain, links)],
        "rank": config["r"], "target_modules": len(config["target_modules"]),
        "modules_to_save": config["modules_to_save"], "notes": notes,
        "base_model_name_or_path": config["base_model_name_or_path"], "verified_on": str(source.path),
        "max_abs_diff": max_diff, "max_abs_logit": scale, "tolerance": tolerance, "passed": max_diff <= tolerance,
        "compared": ("plain PeftModel.from_pretrained(base, exported adapter) vs llmtune's chain model "
                     + ("(the quantized base loaded with the run's BitsAndBytesConfig, earlier adapters stacked + the "
                        "run's adapter), both with the 4-bit layers computing in fp32, " if quantized else
                        "(earlier adapters merged in fp32 + the run's adapter), fp32, ")
                     + "sample prompts with the chat template"),
        "quantization": quantization,
    }
    write_json(out / "verification.json", report)
    front = front_matter({"base_model": portable["name_or_path"], "library_name": "peft",
                          "license": portable.get("license"),
                          "datasets": hub_datasets([d for _, lin in _link_lineages(chain) for d in lin.get("data", [])]),
                          "pipeline_tag": "text-classification" if head == "score" else "text-generation",
                          "tags": ["llmtune", *dict.fromkeys(str(e.get("stage")) for e in chain), "lora"]})
    lines = [front, f"# {run_dir.name}: the whole llmtune adapter chain as one adapter", "",
             f"One LoRA adapter equal to the chain {' -> '.join(str(e.get('stage')) for e in chain)} on the base "
             f"(LoRA updates concatenated along the rank, scaling folded in: r = lora_alpha = {config['r']}). Load it "
             "on the base alone; no earlier adapter is needed.", "",
             "## Base model", "", f"- `base_model_name_or_path`: `{portable['name_or_path']}`",
             f"- Trained against: {portable['weights']}", "",
             *usage_snippet(portable, "path/to/this/adapter", head, "adapter", local_base=str(source.path),
                            quantization=quantization),
             "## Verification", "",
             f"- {'PASSED' if report['passed'] else 'FAILED'}: max |diff| {max_diff:.3g} (tolerance {tolerance:.3g}) "
             "between plain peft with this adapter and llmtune's chain model; details in `verification.json`", ""]
    for i, (entry, lin) in enumerate(_link_lineages(chain), 1):
        lines += [f"## Link {i}: {entry.get('stage')} (`{entry.get('run_dir')}`)", "", *lineage_lines(lin)]
    (out / "README.md").write_text("\n".join(lines))
    level = log.info if report["passed"] else log.error
    level("exported adapter %s (%d link(s), rank %d): max |diff| %.3g vs the chain model (tolerance %.3g) -> %s",
          out, len(chain), config["r"], max_diff, tolerance, "PASSED" if report["passed"] else "FAILED")
    return report


def plain_quantization_config(quantization: dict):
    """A transformers ``BitsAndBytesConfig`` from :func:`llmtune.models.load.quantization_kwargs`' ``config`` (what
    a user outside llmtune writes)."""
    from transformers import BitsAndBytesConfig

    kwargs = dict(quantization["config"])
    if "bnb_4bit_compute_dtype" in kwargs:
        kwargs["bnb_4bit_compute_dtype"] = getattr(torch, kwargs["bnb_4bit_compute_dtype"])
    return BitsAndBytesConfig(**kwargs)


def _link_lineages(chain: list[dict]) -> list[tuple[dict, dict]]:
    """``(chain entry, that run's lineage or {})`` per link."""
    out = []
    for entry in chain:
        path = Path(entry.get("run_dir", "")) / rd.LINEAGE
        out.append((entry, json.loads(path.read_text()) if path.is_file() else {}))
    return out
