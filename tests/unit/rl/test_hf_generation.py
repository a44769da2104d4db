"""The hf rollout engine (llmtune.rl.engines.hf) samples from a merged LoRA adapter (merged_lora): the same
completions and log-probs as the unmerged adapter up to fp32 rounding, the frozen base restored bit for bit, and no
merge where it is unsafe (ZeRO-3, FSDP, DoRA, tied weights); token ids in, completions cut at the stop set out.
rollout_forward's memory-lean arithmetic gives the whole-batch values."""

from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model

from llmtune.models.adapters import adapter_scope
from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer
from llmtune.rl import forward as rl_forward
from llmtune.rl import ops
from llmtune.rl.engines import Policy
from llmtune.rl.engines.hf import HFEngine, cut_completions, merged_lora, mergeable_lora_layers
from llmtune.rl.forward import response_token_logps, rollout_forward
from llmtune.rl.model import POLICY, PolicyModel
from llmtune.rl.trainer import OnlineRLTrainer
from llmtune.rl.types import LENGTH, STOP, RolloutBatch, SamplingParams, Trajectory, join

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
TEXTS = ("What is 2 + 3?", "Hi", "Tell me a long story about the sea, please.", "Why?")


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(pad_equals_eos=False)


def trained_policy(tok, seed=0, **lora):
    """A tiny Llama with a LoRA adapter whose B is not zero (a fresh adapter would equal the base)."""
    policy = get_peft_model(make_tiny_llama(tok, hidden_size=64, seed=seed), LoraConfig(**{**LORA, **lora}))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return policy


def prompt_ids(tok, texts=TEXTS):
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                    return_dict=False) for t in texts]


def prompts(tok, texts=TEXTS):
    """(B, P) left-padded ids and mask."""
    ids = prompt_ids(tok, texts)
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return input_ids, mask


def engine_for(policy, tok):
    return HFEngine(Policy(policy, POLICY, lambda: 0), tok.pad_token_id)


def sample(engine, prompt_lists, stop, seed, greedy=False):
    torch.manual_seed(seed)
    return engine.generate(prompt_lists, SamplingParams(12, tuple(stop), temperature=0.8, greedy=greedy))


def as_batch(prompt_lists, completions, pad):
    return RolloutBatch.from_trajectories([Trajectory.single_turn({}, p, c) for p, c in zip(prompt_lists, completions)],
                                          pad)


def policy_logps(policy, batch):
    inputs, responses = batch.model_inputs(), batch.completion_ids
    with torch.no_grad(), adapter_scope(policy, POLICY):
        logits = policy(**inputs, use_cache=False, logits_to_keep=responses.shape[1] + 1).logits[:, :-1]
    return response_token_logps(logits, responses, 0.8), batch.completion_mask


def test_merged_sampling_matches_the_unmerged_adapter_and_restores_the_base_exactly(tok):
    policy = trained_policy(tok).eval()
    eos, pad = [tok.eos_token_id], tok.pad_token_id
    engine = engine_for(policy, tok)
    assert engine.merge and mergeable_lora_layers(policy, POLICY) is not None
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    ids = prompt_ids(tok)
    merged = [sample(engine, ids, eos, seed) for seed in range(3)] + [sample(engine, ids, eos, 0, True)]

    # the frozen base and the adapter are the very same tensors again, bit for bit, and nothing counts as merged
    for n, p in policy.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not any(getattr(m, "merged", False) for m in policy.modules())

    engine.merge = False  # the unmerged adapter: same seeds -> same completions
    unmerged = [sample(engine, ids, eos, seed) for seed in range(3)] + [sample(engine, ids, eos, 0, True)]
    for a, b in zip(merged, unmerged):
        assert [c.token_ids for c in a] == [c.token_ids for c in b]

    # the sampling distribution: log-probs of the sampled tokens, merged weights vs the adapter path (what the
    # trainer computes); fp32 rounding only
    batch = as_batch(ids, merged[0], pad)
    logps, rmask = policy_logps(policy, batch)
    layers = mergeable_lora_layers(policy, POLICY)
    with merged_lora(layers, POLICY):
        assert all(layer.merged for layer in layers)
        merged_logps, _ = policy_logps(policy, batch)
    delta = ((merged_logps - logps).abs() * rmask).max()
    assert 0 < float(rmask.sum()) and float(delta) < 1e-5
    # and the adapter matters (a zero adapter would pass the checks above trivially)
    with torch.no_grad(), adapter_scope(policy, None):
        P = batch.prompt_ids.shape[1]
        logits = policy(**batch.model_inputs(), use_cache=False).logits[:, P - 1:-1]
        base = response_token_logps(logits, batch.completion_ids, 0.8)
    assert float(((base - logps).abs() * rmask).max()) > 1e-2


def test_completions_are_cut_right_after_the_first_stop_token():
    generated = torch.tensor([[5, 2, 9, 2], [5, 6, 7, 8], [2, 1, 1, 1], [3, 1, 4, 1]])  # stops {1, 2}; 1 is the pad too
    out = cut_completions(generated, (1, 2), version=7)
    assert [c.token_ids for c in out] == [[5, 2], [5, 6, 7, 8], [2], [3, 1]]
    assert [c.finish_reason for c in out] == [STOP, LENGTH, STOP, STOP]
    assert all(c.version == 7 and c.logprobs is None for c in out)


def test_merge_is_restored_when_generation_fails(tok):
    policy = trained_policy(tok)
    layers = mergeable_lora_layers(policy, POLICY)
    weights = [layer.get_base_layer().weight.detach().clone() for layer in layers]
    storage = [layer.get_base_layer().weight.data_ptr() for layer in layers]
    with pytest.raises(RuntimeError, match="boom"), merged_lora(layers, POLICY):
        assert all(layer.merged for layer in layers)
        assert not torch.equal(layers[0].get_base_layer().weight.data, weights[0])
        raise RuntimeError("boom")
    for layer, w, ptr in zip(layers, weights, storage):  # the original tensors are back, untouched
        assert layer.get_base_layer().weight.data_ptr() == ptr and torch.equal(layer.get_base_layer().weight, w)
    assert not any(layer.merged for layer in layers)


def test_no_merge_where_it_is_unsafe(tok):
    assert mergeable_lora_layers(trained_policy(tok, use_dora=True), POLICY) is None  # DoRA: peft's own path
    tied = get_peft_model(make_tiny_llama(tok, hidden_size=64, tie_word_embeddings=True),
                          LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"]))
    assert mergeable_lora_layers(tied, POLICY) is None  # the LM head's weight is the input embedding's
    assert mergeable_lora_layers(trained_policy(tok), "other") is None
    assert mergeable_lora_layers(trained_policy(tok).to(torch.bfloat16), POLICY) is None  # the delta would round away

    def can_merge(stage=None, fsdp=False):
        plugin = None if stage is None else SimpleNamespace(zero_stage=stage)
        trainer = SimpleNamespace(is_fsdp_enabled=fsdp, is_deepspeed_enabled=stage is not None,
                                  accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)))
        return OnlineRLTrainer._can_merge(trainer)

    assert can_merge() and can_merge(stage=2)
    assert not can_merge(stage=3) and not can_merge(fsdp=True)
    engine = HFEngine(Policy(trained_policy(tok), POLICY, lambda: 0, can_merge=False), 0)
    assert not engine.merge and not engine.share  # under ZeRO-3/FSDP: neither the merge nor the shared prefill


def test_rollout_forward_row_wise_equals_whole_batch_arithmetic(tok, monkeypatch):
    policy = trained_policy(tok, seed=3)
    model = PolicyModel(policy)
    input_ids, mask = prompts(tok)
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(5, tok.vocab_size, (4, 7), generator=g)
    rmask = torch.ones_like(responses)
    rmask[1, 3:] = 0
    inputs = join(input_ids, mask, responses, rmask)
    vocab = model.config.vocab_size
    monkeypatch.setattr(rl_forward, "LOGITS_CHUNK_BYTES", 2 * 8 * vocab * 4)  # 2 rows of 7 + 1 positions per forward
    out = rollout_forward(model, inputs, responses, temperature=0.7, chunk_rows=4, reference=True, exact_kl=True)
    model.eval()
    with torch.no_grad():  # the whole batch at once
        logits = model.policy_logits(**inputs, response_width=7)
        ref = model.reference_logits(**inputs, response_width=7)
        logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
        want = {"logps": response_token_logps(logits, responses, 0.7),
                "entropy": ops.entropy_from_logits(logits / 0.7),
                "ref_logps": response_token_logps(ref, responses, 0.7),
                "kl_exact": (logp.exp() * (logp - ref_logp)).sum(-1)}
    assert {k for k, v in vars(out).items() if v is not None} == set(want)
    for key in want:
        torch.testing.assert_close(getattr(out, key), want[key], rtol=0, atol=1e-6)
    assert float(want["kl_exact"].abs().max()) > 1e-3  # the adapter makes policy and reference differ


def test_repeated_prompts_are_prefilled_once_with_the_same_completions(tok):
    """GRPO's groups: every prompt G times. The shared prefill runs the distinct prompts only (all tokens but the
    last), and sampling from its cache draws the very same completions as the plain prefill, sampled and greedy."""
    policy = trained_policy(tok).eval()
    engine = engine_for(policy, tok)
    ids = [p for p in prompt_ids(tok) for _ in range(3)]  # 4 prompts x 3
    width = max(map(len, ids))
    eos = [tok.eos_token_id]
    shapes = []
    hook = policy.get_base_model().model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        for seed, greedy in ((0, False), (1, False), (0, True)):
            engine.share = True
            shared = sample(engine, ids, eos, seed, greedy)
            assert shapes[0] == (4, width - 1) and shapes[1] == (12, 1)  # prefill once, then row by row
            shapes.clear()
            engine.share = False
            plain = sample(engine, ids, eos, seed, greedy)
            assert shapes[0] == (12, width)
            shapes.clear()
            assert [c.token_ids for c in shared] == [c.token_ids for c in plain]
        # distinct prompts: nothing to share, no extra forward
        engine.share = True
        unique = prompt_ids(tok)
        sample(engine, unique, eos, 0)
        assert shapes[0] == (4, max(map(len, unique)))
    finally:
        hook.remove()


def test_both_engines_stop_where_the_trainer_stops(tok, tmp_path):
    """Issue 30: the stop set includes the model's generation-config EOS list, and the hf engine, given it, stops at
    such an id (generate(eos_token_id=...) with the explicit set; nothing else stops it)."""
    from transformers import GenerationConfig

    from llmtune.data.templates import stop_token_ids

    policy = trained_policy(tok, seed=5).eval()
    ids = prompt_ids(tok)[:1]
    free = sample(engine_for(policy, tok), ids, [tok.eos_token_id], 0, greedy=True)[0].token_ids
    other = next(t for i, t in enumerate(free) if i > 0 and t not in free[:i] and t != tok.eos_token_id)
    at = free.index(other)
    stops = stop_token_ids(tok, GenerationConfig(eos_token_id=[tok.eos_token_id, other]))
    cut = sample(engine_for(policy, tok), ids, stops, 0, greedy=True)[0]
    assert cut.token_ids == free[:at + 1] and cut.finish_reason == STOP
