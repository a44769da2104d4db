"""A finished QLoRA run on a tiny 4-bit Llama, written as the runner leaves it, for the tests of a ``model.from_run``
chain on a quantized base (tests/unit/models/test_stacked_chain.py, tests/unit/stages/test_stacked_reference.py)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from llmtune.config import load_recipe
from llmtune.models import attach_adapter, load_model
from llmtune.models.tiny import save_tiny_model

# compute in fp32: the 4-bit layers' arithmetic is then exact enough to compare models bit for bit
QLORA = {"load_in_4bit": True, "dtype": "fp32", "bnb_4bit_compute_dtype": "fp32"}


def qlora_recipe(model_dir: Path, stage: str = "sft", **sections):
    """A recipe quantizing ``model_dir`` as :data:`QLORA` (LoRA r 4, no dropout), with ``sections`` merged in."""
    model = {"name_or_path": str(model_dir), **QLORA, **sections.pop("model", {})}
    adapter = {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **sections.pop("adapter", {})}
    return load_recipe(raw={"model": model, "adapter": adapter, **sections}, stage=stage)


def qlora_run(root: Path, model_dir: Path | None = None, *, seed: int = 3) -> tuple[Path, torch.nn.Module]:
    """``root/sft``: a QLoRA SFT run of a tiny 4-bit Llama (hidden 64) whose LoRA B is random (a trained adapter
    that moves the logits), its lineage and resolved recipe; and the peft model it saved (eval mode)."""
    model_dir = model_dir or save_tiny_model(root / "model", hidden_size=64)
    recipe = qlora_recipe(model_dir)
    torch.manual_seed(seed)
    peft = attach_adapter(load_model(recipe.model, recipe.precision), recipe.adapter, gradient_checkpointing=False,
                          quantized=True)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    run = root / "sft"
    peft.save_pretrained(run / "adapter")
    lineage = {"stage": "sft", "base_model": {"name_or_path": str(model_dir), "kind": "local", "path": str(model_dir)},
               "previous_adapters": [], "adapter": "adapter", "adapter_type": "lora", "model_head": "causal_lm"}
    (run / "lineage.json").write_text(json.dumps(lineage))
    (run / "recipe.resolved.yaml").write_text(yaml.safe_dump(recipe.model_dump(mode="json")))
    return run, peft.eval()


def chain_of(run: Path) -> list[dict]:
    return [{"stage": "sft", "run_dir": str(run), "path": str(run / "adapter"), "adapter_type": "lora"}]
