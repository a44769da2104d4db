"""The hf rollout engine samples from a merged LoRA adapter (llmtune.rl.generation.merged_lora): the same
completions and log-probs as the unmerged adapter up to fp32 rounding, the frozen base restored bit for bit, and no
merge where it is unsafe (ZeRO-3, FSDP, DoRA, tied weights). forward_chunks' memory-lean arithmetic gives the
whole-batch values."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model

from llmtune.models.adapters import adapter_scope
from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer
from llmtune.rl import ops
from llmtune.rl import trainer as rl_trainer
from llmtune.rl.generation import HFGenerationBackend, _can_merge, merged_lora, mergeable_lora_layers
from llmtune.rl.model import POLICY, PolicyModel
from llmtune.rl.rollout import join, response_token_logps, split_generation

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")


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


def prompts(tok, texts=("What is 2 + 3?", "Hi", "Tell me a long story about the sea, please.", "Why?")):
    ids = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) for t in texts]
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[tok.pad_token_id] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    return input_ids, mask


def fake_trainer(model):
    from accelerate import Accelerator

    return SimpleNamespace(model_wrapped=model, accelerator=Accelerator(cpu=True), state=SimpleNamespace(global_step=0),
                           compute_loss_context_manager=contextlib.nullcontext)


def sample(backend, input_ids, mask, seed, greedy=False):
    torch.manual_seed(seed)
    out = backend.generate(input_ids, mask, max_new_tokens=12, greedy=greedy)
    return out[0] if isinstance(out, tuple) else out  # (sequences, engine_logps) after the engine protocol


def policy_logps(policy, input_ids, mask, sequences, eos, pad):
    responses, rmask, _ = split_generation(sequences, input_ids.shape[1], eos, pad)
    inputs = join(input_ids, mask, responses, rmask)
    with torch.no_grad(), adapter_scope(policy, POLICY):
        logits = policy(**inputs, use_cache=False, logits_to_keep=responses.shape[1] + 1).logits[:, :-1]
    return response_token_logps(logits, responses, 0.8), rmask


def test_merged_sampling_matches_the_unmerged_adapter_and_restores_the_base_exactly(tok):
    policy = trained_policy(tok)
    model = PolicyModel(policy).eval()
    eos, pad = [tok.eos_token_id], tok.pad_token_id
    backend = HFGenerationBackend(fake_trainer(model), eos, pad, temperature=0.8, top_p=1.0, top_k=0)
    assert backend.merge and mergeable_lora_layers(policy, POLICY) is not None
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    input_ids, mask = prompts(tok)
    merged = [sample(backend, input_ids, mask, seed) for seed in range(3)] + [sample(backend, input_ids, mask, 0, True)]

    # the frozen base and the adapter are the very same tensors again, bit for bit, and nothing counts as merged
    for n, p in policy.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not any(getattr(m, "merged", False) for m in policy.modules())

    backend.merge = False  # the unmerged adapter, as before this change: same seeds -> same completions
    unmerged = [sample(backend, input_ids, mask, seed) for seed in range(3)] + [sample(backend, input_ids, mask, 0, True)]
    for a, b in zip(merged, unmerged):
        assert torch.equal(a, b)

    # the sampling distribution: log-probs of the sampled tokens, merged weights vs the adapter path (what the
    # trainer computes); fp32 rounding only
    logps, rmask = policy_logps(policy, input_ids, mask, merged[0], eos, pad)
    layers = mergeable_lora_layers(policy, POLICY)
    with merged_lora(layers, POLICY):
        assert all(layer.merged for layer in layers)
        merged_logps, _ = policy_logps(policy, input_ids, mask, merged[0], eos, pad)
    delta = ((merged_logps - logps).abs() * rmask).max()
    assert 0 < float(rmask.sum()) and float(delta) < 1e-5
    # and the adapter matters (a zero adapter would pass the checks above trivially)
    with torch.no_grad(), adapter_scope(policy, None):
        responses, rm, _ = split_generation(merged[0], input_ids.shape[1], eos, pad)
        inputs = join(input_ids, mask, responses, rm)
        base = response_token_logps(policy(**inputs, use_cache=False).logits[:, input_ids.shape[1] - 1:-1],
                                    responses, 0.8)
    assert float(((base - logps).abs() * rmask).max()) > 1e-2


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

    def trainer(stage=None, fsdp=False):
        plugin = None if stage is None else SimpleNamespace(zero_stage=stage)
        return SimpleNamespace(is_fsdp_enabled=fsdp, is_deepspeed_enabled=stage is not None,
                               accelerator=SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin)))
    assert _can_merge(trainer()) and _can_merge(trainer(stage=2))
    assert not _can_merge(trainer(stage=3)) and not _can_merge(trainer(fsdp=True))


def test_forward_chunks_row_wise_equals_whole_batch_arithmetic(tok, monkeypatch):
    policy = trained_policy(tok, seed=3)
    model = PolicyModel(policy)
    input_ids, mask = prompts(tok)
    g = torch.Generator().manual_seed(0)
    responses = torch.randint(5, tok.vocab_size, (4, 7), generator=g)
    rmask = torch.ones_like(responses)
    rmask[1, 3:] = 0
    inputs = join(input_ids, mask, responses, rmask)
    me = SimpleNamespace(model=model, args=SimpleNamespace(per_device_eval_batch_size=4),
                         compute_loss_context_manager=contextlib.nullcontext)
    vocab = model.config.vocab_size
    monkeypatch.setattr(rl_trainer, "LOGITS_CHUNK_BYTES", 2 * 8 * vocab * 4)  # 2 rows of 7 + 1 positions per forward
    out = rl_trainer.OnlineRLTrainer.forward_chunks(me, inputs, responses, with_values=False, reference=True,
                                                    temperature=0.7, exact_kl=True)
    model.eval()
    with torch.no_grad():  # the whole batch at once, as before
        logits = model.policy_logits(**inputs, response_width=7)
        ref = model.reference_logits(**inputs, response_width=7)
        logp, ref_logp = torch.log_softmax(logits, -1), torch.log_softmax(ref, -1)
        want = {"logps": response_token_logps(logits, responses, 0.7),
                "entropy": ops.entropy_from_logits(logits / 0.7),
                "ref_logps": response_token_logps(ref, responses, 0.7),
                "kl_exact": (logp.exp() * (logp - ref_logp)).sum(-1)}
    assert set(out) == set(want)
    for key in want:
        torch.testing.assert_close(out[key], want[key], rtol=0, atol=1e-6)
    assert float(want["kl_exact"].abs().max()) > 1e-3  # the adapter makes policy and reference differ


def test_repeated_prompts_are_prefilled_once_with_the_same_completions(tok):
    """GRPO's groups: every prompt G times. The shared prefill runs the distinct prompts only (all tokens but the
    last), and sampling from its cache draws the very same completions as the plain prefill, sampled and greedy."""
    policy = trained_policy(tok)
    model = PolicyModel(policy).eval()
    backend = HFGenerationBackend(fake_trainer(model), [tok.eos_token_id], tok.pad_token_id, temperature=0.8,
                                  top_p=1.0, top_k=0)
    input_ids, mask = prompts(tok)
    input_ids, mask = input_ids.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)  # (12, P): 4 prompts x 3
    shapes = []
    hook = policy.get_base_model().model.register_forward_pre_hook(
        lambda module, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    try:
        for seed, greedy in ((0, False), (1, False), (0, True)):
            backend.share = True
            shared = sample(backend, input_ids, mask, seed, greedy)
            assert shapes[0] == (4, input_ids.shape[1] - 1) and shapes[1] == (12, 1)  # prefill once, then row by row
            shapes.clear()
            backend.share = False
            plain = sample(backend, input_ids, mask, seed, greedy)
            assert shapes[0] == tuple(input_ids.shape)
            shapes.clear()
            assert torch.equal(shared, plain)
        # distinct prompts: nothing to share, no extra forward
        backend.share = True
        unique_ids, unique_mask = prompts(tok)
        sample(backend, unique_ids, unique_mask, 0)
        assert shapes[0] == tuple(unique_ids.shape)
    finally:
        hook.remove()
