"""Model FLOPs per token (the MFU of metrics.jsonl) against hand-counted values."""

import torch
from peft import LoraConfig, get_peft_model

from llmtune.core.flops import linear_weights, peak_tflops, train_flops_per_token
from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer


def test_linear_weights_and_flops_of_a_lora_llama():
    tok = make_tiny_tokenizer()
    base = make_tiny_llama(tok, hidden_size=32, num_layers=2)  # untied: embedding lookup is not a matmul
    V, d, i, kv = len(tok), 32, 64, 16  # 4 heads of 8, 2 kv heads
    per_layer = d * d * 2 + d * kv * 2 + d * i * 3  # q, o; k, v; gate, up, down
    n = 2 * per_layer + V * d  # + lm_head
    assert linear_weights(base) == (n, n)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear"))
    lora = 2 * (4 * (d + d) * 2 + 4 * (d + kv) * 2 + 4 * (d + i) * 2 + 4 * (i + d))  # r * (in + out) per module
    assert linear_weights(model) == (n + lora, lora)
    T = 10
    forward = 2 * (n + lora) + 4 * 2 * T * d
    assert train_flops_per_token(model, T) == 2 * forward + 2 * lora
    assert train_flops_per_token(model, T, reference_forward=True) == 3 * forward + 2 * lora
    # PPO: the value adapter's pass through the body (no LM head), forward and backward
    assert train_flops_per_token(model, T, value_forward=True) == 2 * forward + 2 * lora + 2 * (forward - 2 * V * d)


def test_peak_from_environment(monkeypatch):
    monkeypatch.setenv("LLMTUNE_PEAK_TFLOPS", "12.5")
    assert peak_tflops() == 12.5
    monkeypatch.delenv("LLMTUNE_PEAK_TFLOPS")
    if not torch.cuda.is_available():
        assert peak_tflops() is None  # a CPU has no table entry: no MFU, only model TFLOP/s
