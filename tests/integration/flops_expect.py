"""Model FLOPs per token of the tiny test Llama counted by hand from its config.json, to check the ``mfu`` every
stage writes into metrics.jsonl (llmtune.core.flops: PaLM appendix B convention)."""

import json
from pathlib import Path

import pytest

PEAK = 0.5  # TFLOP/s, LLMTUNE_PEAK_TFLOPS of the runs that check the MFU


def tiny_flops_per_token(model_dir: Path, seq_len: float, lora_r: int, adapters: int = 1, reference: bool = False,
                         value: bool = False) -> float:
    """Training FLOPs per processed token of a LoRA (all linear layers, ``adapters`` adapters) tiny Llama."""
    c = json.loads((Path(model_dir) / "config.json").read_text())
    d, L, i, V = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    kv = d // c["num_attention_heads"] * c["num_key_value_heads"]
    base = L * (2 * d * d + 2 * d * kv + 3 * d * i) + V * d  # q, o; k, v; gate, up, down; untied lm_head
    lora = L * lora_r * (2 * (d + d) + 2 * (d + kv) + 2 * (d + i) + (i + d)) * adapters  # r x (in + out)
    head = d if value else 0  # the value head (hidden -> 1)
    n, trainable = base + lora + head, lora + head
    forward = 2 * n + 4 * L * seq_len * d
    out = 2 * forward + 2 * trainable + (forward if reference else 0)
    return out + (2 * (forward - 2 * V * d) if value else 0)


def check_mfu(records: list[dict], model_dir: Path, tokens_key: str, **kwargs) -> None:
    """Every training record has flops_per_token = the hand count at its mean_seq_len, model_tflops_per_s =
    flops_per_token x tokens/s and mfu = that / PEAK; tokens/s and peak memory are logged."""
    train = [r for r in records if "loss" in r and "train_runtime" not in r]
    assert train
    for r in train:
        expected = tiny_flops_per_token(model_dir, r["mean_seq_len"], **kwargs)
        assert r["flops_per_token"] == pytest.approx(expected, rel=1e-9)
        assert r["model_tflops_per_s"] == pytest.approx(expected * r[tokens_key] / 1e12, rel=1e-6)
        assert r["mfu"] == pytest.approx(expected * r[tokens_key] / 1e12 / PEAK, rel=1e-6)
        assert r["tokens_per_s"] > 0 and r["peak_mem_gb"] > 0 and r["mean_seq_len"] > 1
