"""What llmtune's memory estimator (llmtune/core/memory.py) predicts for a recipe on a model you cannot download here.

    python scripts/estimate_memory.py recipes/llama3_8b_qlora_sft.yaml scripts/model_configs/llama-3.1-8b-instruct.json
    python scripts/estimate_memory.py recipes/llama3_8b_qlora_dpo.yaml scripts/model_configs/llama-3.1-8b-instruct.json \
        --chain-rank 16 [--device-gib 79.2] [override ...]

The model is built from its config.json (the published values, written by hand in scripts/model_configs/) with
random weights, but with 2 and then 3 decoder layers only; llmtune loads it as training would (4-bit quantized by
bitsandbytes for real, the stage's model changes, the adapter; with ``--chain-rank`` a frozen earlier adapter of that
rank stacked under it, as a stage on a QLoRA run has) and runs ``estimate_training_memory`` on it. Every term of
the estimate is affine in the number of layers (weights, adapter state and activations per layer; embeddings, head
and logits once), so the two points give the full model's numbers exactly. Needs ~4 GiB of RAM for an 8B config
and no GPU. Prints the estimate and what ``train.gradient_checkpointing: auto`` chooses for ``--device-gib`` (79.2:
an 80 GB A100 / H100 as CUDA reports it). An estimate, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def build(config: dict, layers: int, out: Path) -> Path:
    """A random model of ``config`` with ``layers`` decoder layers, saved in bf16, with the tiny offline tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtune.models.tiny import make_tiny_tokenizer

    cfg = AutoConfig.for_model(**{**config, "num_hidden_layers": layers})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.02)
    model.save_pretrained(out)
    make_tiny_tokenizer().save_pretrained(out)
    return out


def estimate(recipe, model_dir: Path, chain_rank: int | None, work: Path):
    from llmtune.core.distributed import zero_stage
    from llmtune.core.memory import estimate_training_memory
    from llmtune.models import attach_adapter, load_model
    from llmtune.stages import STAGES

    cfg = recipe.model.model_copy(update={"name_or_path": str(model_dir), "from_run": None})
    quantized = cfg.load_in_4bit or cfg.load_in_8bit
    chain = []
    if chain_rank:
        sft = recipe.adapter.model_copy(update={"lora_r": chain_rank, "lora_alpha": 2 * chain_rank})
        earlier = attach_adapter(load_model(cfg, recipe.precision), sft, gradient_checkpointing=False,
                                 quantized=quantized)
        earlier.save_pretrained(work / "chain")
        chain = [{"stage": "sft", "path": str(work / "chain"), "adapter_type": "lora"}]
        del earlier
    stage = STAGES[recipe.stage](recipe)
    model = stage.prepare_model(load_model(cfg, recipe.precision, head=stage.model_head), None)
    model = attach_adapter(model, recipe.adapter, gradient_checkpointing=False, quantized=quantized,
                           frozen_chain=chain)
    passes = 2 if getattr(getattr(stage, "trainer_class", None), "value_forward", False) else 1
    return estimate_training_memory(model, recipe, stage.data_kind, zero=zero_stage(recipe) or 0, passes=passes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipe")
    parser.add_argument("config", help="the model's config.json")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--chain-rank", type=int, default=None, help="stack a frozen earlier adapter of this rank")
    parser.add_argument("--device-gib", type=float, default=79.2)
    args = parser.parse_args()

    from llmtune.config import load_recipe
    from llmtune.config.load import read_yaml
    from llmtune.core.memory import GB, MemoryEstimate, choose_checkpointing

    recipe = load_recipe(args.recipe, args.overrides, stage=read_yaml(args.recipe).get("stage", "sft"))
    config = json.loads(Path(args.config).read_text())
    layers = config["num_hidden_layers"]
    points = {}
    for n in (2, 3):
        with tempfile.TemporaryDirectory(prefix="llmtune-estimate-") as tmp:
            points[n] = estimate(recipe, build(config, n, Path(tmp) / "model"), args.chain_rank, Path(tmp))
    fields = ("weights", "trainable", "activations", "activations_checkpointed", "head", "tokens")
    full = MemoryEstimate(**{f: getattr(points[2], f) + (getattr(points[3], f) - getattr(points[2], f)) * (layers - 2)
                             for f in fields})
    on, reason = choose_checkpointing(recipe.train.gradient_checkpointing, full, int(args.device_gib * GB))
    print(json.dumps({"recipe": args.recipe, "config": args.config, "layers": layers, **full.summary(),
                      "device_gib": args.device_gib, "gradient_checkpointing": on, "reason": reason}, indent=2))


if __name__ == "__main__":
    main()
