"""ZeRO-3 LoRA and ZeRO-3 QLoRA SFT of a random-init ~1B Llama for a few steps; the saved adapter must be whole.

Usage (see scripts/gpu_zero3_check.sh):
    python scripts/gpu_zero3_check.py [--out DIR] [--steps 3] [--nproc N]      # on GPUs: ~1.1B model, bf16
    python scripts/gpu_zero3_check.py --tiny [--out DIR]                        # CPU dry run: 2-layer model, fp32, gloo

For each variant (lora, qlora) it runs ``llmtune sft`` through the CLI with ``distributed.zero_stage=3`` (the CLI
re-launches itself through torchrun), then checks the saved ``adapter/adapter_model.safetensors``: every lora_A /
lora_B tensor present with its expected shape and non-zero size (llmtune.models.verify; DeepSpeed #4295 saved a
40-byte adapter), lora_B trained away from zero, and the losses finite. Results go to ``DIR/result.json``.
Exit code 0 only if every variant passed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

# the shape of TinyLlama-1.1B: 22 layers, hidden 2048, MLP 5632, 32 heads, 4 KV heads, 32k vocabulary
ONE_B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048)


def build_model(root: Path, tiny: bool) -> Path:
    """Save a random-init Llama (+ the offline tiny tokenizer) as a local HF directory; returns it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtune.models.tiny import make_tiny_tokenizer, save_tiny_model

    path = root / ("tiny-llama" if tiny else "llama-1b-random")
    if (path / "config.json").is_file():
        return path
    if tiny:
        return save_tiny_model(path)
    tokenizer = make_tiny_tokenizer()
    config = LlamaConfig(**ONE_B, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    print(f"random Llama: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters", flush=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    del model
    return path


def write_data(root: Path, rows: int = 64) -> Path:
    words = "the sea is wide and blue and the waves come in and out of the bay all day".split()
    data = []
    for i in range(rows):
        answer = " ".join(words[(i + j) % len(words)] for j in range(20 + 7 * (i % 9)))
        data.append({"messages": [{"role": "user", "content": f"Write about the sea ({i})."},
                                  {"role": "assistant", "content": answer}]})
    path = root / "sea.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in data) + "\n")
    return path


def write_recipe(root: Path, model: Path, data: Path, variant: str, tiny: bool, steps: int, nproc: int) -> Path:
    precision = {} if tiny else {"bf16": True}  # transformers refuses bf16 on CPU unless DeepSpeed is off
    recipe = {
        "stage": "sft",
        "model": {"name_or_path": str(model), "load_in_4bit": variant == "qlora"},
        "data": {"datasets": [{"path": str(data)}], "max_length": 64 if tiny else 512},
        "adapter": {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"},
        "train": {"micro_batch_size": 2, "global_batch_size": 4 * nproc, "max_steps": steps,
                  "learning_rate": 1e-3, "gradient_checkpointing": not tiny, "save_steps": steps},
        "precision": precision,
        "distributed": {"zero_stage": 3, "nproc_per_node": nproc},
        "output": {"dir": str(root / f"run_{variant}"), "overwrite": True},
    }
    path = root / f"{variant}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def check_adapter(run: Path, model_dir: Path) -> dict:
    """Shapes of every saved lora_A/lora_B against a meta-device copy of the model with the same adapter."""
    from accelerate import init_empty_weights
    from peft import PeftConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmtune.models.verify import verify_saved_adapter

    adapter = run / "adapter"
    with init_empty_weights():
        base = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    peft_model = get_peft_model(base, PeftConfig.from_pretrained(adapter))
    checked = verify_saved_adapter(adapter, peft_model)  # raises AdapterSaveError if anything is missing/empty
    weights = load_file(str(adapter / "adapter_model.safetensors"))
    lora_b_zero = [k for k, v in weights.items() if "lora_B" in k and float(v.float().abs().sum()) == 0]
    return {
        "adapter_bytes": (adapter / "adapter_model.safetensors").stat().st_size,
        "tensors": len(weights),
        "lora_tensors_checked": checked,
        "min_numel": min(v.numel() for v in weights.values()),
        "lora_B_still_zero": len(lora_b_zero),
    }


def run_variant(root: Path, model: Path, data: Path, variant: str, args) -> dict:
    recipe = write_recipe(root, model, data, variant, args.tiny, args.steps, args.nproc)
    log = root / f"{variant}.log"
    start = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.call([sys.executable, "-m", "llmtune.commands.cli", "sft", str(recipe)], stdout=fh,
                             stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    result: dict = {"variant": variant, "returncode": rc, "wall_s": round(time.perf_counter() - start, 1),
                    "log": str(log)}
    run = root / f"run_{variant}"
    if rc != 0:
        result["passed"] = False
        result["log_tail"] = log.read_text()[-4000:]
        return result
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    summary = json.loads((run / "lineage.json").read_text())["summary"]
    result.update(losses=[r["loss"] for r in train], peak_mem_gb=max(r["peak_mem_gb"] for r in train),
                  zero_stage=summary["zero_stage"], batch=summary["batch"])
    try:
        result.update(check_adapter(run, model))
        ok = True
    except Exception as exc:  # noqa: BLE001 - reported in the result
        result["adapter_error"] = f"{type(exc).__name__}: {exc}"
        ok = False
    result["passed"] = bool(ok and result["zero_stage"] == 3 and len(train) == args.steps
                            and all(math.isfinite(x) for x in result["losses"]) and result["lora_B_still_zero"] == 0
                            and result["min_numel"] > 0)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2-layer model, fp32, for a CPU dry run")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_zero3_check"), help="work/result directory")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per variant")
    parser.add_argument("--nproc", type=int, default=None, help="processes (default: GPUs, or 2 on CPU)")
    parser.add_argument("--variants", default="lora,qlora", help="comma-separated: lora, qlora")
    args = parser.parse_args()
    args.nproc = args.nproc or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    root = Path(args.out)
    root.mkdir(parents=True, exist_ok=True)
    model = build_model(root, args.tiny)
    data = write_data(root)
    results = []
    for variant in args.variants.split(","):
        results.append(run_variant(root, model, data, variant, args))
        print(json.dumps(results[-1], indent=2), flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report = {"device": device, "nproc": args.nproc, "tiny": args.tiny, "results": results,
              "passed": all(r["passed"] for r in results)}
    (root / "result.json").write_text(json.dumps(report, indent=2) + "\n")
    print(("PASSED" if report["passed"] else "FAILED") + f": {root / 'result.json'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
