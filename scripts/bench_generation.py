#!/usr/bin/env python
"""Rollout generation speed: transformers' ``generate`` (the ``hf`` engine, adapter unmerged, as the RL stages sample)
beside the vLLM rollout engine (``llmtune.rl.engines.vllm_engine``, the adapter as a LoRA request), on the same model, LoRA
adapter, prompts, sampling settings and max tokens.

    python scripts/bench_generation.py --cpu            # SmolLM2-135M (builtin), LoRA r16, 16 GSM8K prompts x 128
    python scripts/bench_generation.py --tiny           # tiny random Llama: the same path in about a minute
    python scripts/bench.py --generation [--cpu|--tiny] # the same, from the side-by-side benchmark

Prints ``generation | tokens/s | hf <x> | vllm <y>`` (real completion tokens, up to and including EOS, per second
of sampling; vLLM's start-up is reported apart). CPU numbers are for reference only: vLLM is meant for GPUs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _setup(tiny: bool, work: Path, n_prompts: int):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmtune.config.schema import ModelConfig
    from llmtune.models import resolve_model_source

    if tiny:
        from llmtune.models.tiny import save_tiny_model

        model_dir = save_tiny_model(work / "model", hidden_size=128)
        questions = [f"What is {a} + {b}?" for a in range(8) for b in range(8)][:n_prompts]
    else:
        model_dir = resolve_model_source(ModelConfig(name_or_path="builtin:smollm2-135m-instruct")).path
        from llmtune.config.schema import DatasetConfig
        from llmtune.data.sources import read_source

        rows = read_source(DatasetConfig(path="builtin:gsm8k", max_samples=n_prompts), 0).rows
        questions = [r["question"] for r in rows]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in questions]
    rows = [list(r["input_ids"]) if isinstance(r, dict) else list(r) for r in rows]
    width = max(map(len, rows))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.01)
    from llmtune.data.templates import template_eos_ids

    return model_dir, policy.eval(), ids, mask, template_eos_ids(tokenizer), pad


def generation_rates(tiny: bool = False, n_prompts: int = 16, max_new_tokens: int = 128,
                     temperature: float = 1.0) -> dict[str, float]:
    """Completion tokens per second of sampling with each engine (see the module docstring)."""
    import torch

    from llmtune.rl.engines import Policy
    from llmtune.rl.engines.hf import HFEngine
    from llmtune.rl.engines.vllm_client import _stop, start_colocated
    from llmtune.rl.engines.vllm_engine import VLLMEngine, VLLMSettings
    from llmtune.rl.types import SamplingParams

    work = Path(tempfile.mkdtemp(prefix="llmtune-bench-gen-"))
    model_dir, policy, ids, mask, eos_ids, pad = _setup(tiny, work, n_prompts)
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    sampling = SamplingParams(max_new_tokens, tuple(eos_ids), temperature=temperature)
    handle = Policy(policy, "default", lambda: 0)
    out = {}
    hf = HFEngine(handle, pad)
    hf.generate(prompts[:1], SamplingParams(4, tuple(eos_ids)))  # warm-up, as for vLLM below
    torch.manual_seed(0)
    start = time.perf_counter()
    completions = hf.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    out["hf"] = sum(len(c.token_ids) for c in completions) / seconds
    settings = VLLMSettings(max_model_len=ids.shape[1] + max_new_tokens, max_lora_rank=16, dtype="float32",
                            temperature=temperature, startup_timeout_s=900)
    start = time.perf_counter()
    client = start_colocated(Path(model_dir), settings, work)
    out["vllm_startup_s"] = time.perf_counter() - start
    try:
        engine = VLLMEngine(client, handle, settings)
        engine.sync(0)
        engine.generate(prompts[:1], SamplingParams(4, tuple(eos_ids)))  # first request: kernels, LoRA slots
        start = time.perf_counter()
        completions = engine.generate(prompts, sampling)
        seconds = time.perf_counter() - start
        out["vllm"] = sum(len(c.token_ids) for c in completions) / seconds
    finally:
        _stop(client.process)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny random Llama instead of SmolLM2-135M")
    ap.add_argument("--cpu", action="store_true", help="SmolLM2-135M on the CPU (default)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args, _ = ap.parse_known_args(argv)
    sys.path.insert(0, str(ROOT))
    r = generation_rates(args.tiny, args.prompts, args.max_new_tokens)
    print(f"generation | tokens/s | hf {r['hf']:.1f} | vllm {r['vllm']:.1f} | vllm/hf {r['vllm'] / r['hf']:.2f}x "
          f"(vLLM start-up {r['vllm_startup_s']:.0f} s, not counted)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
