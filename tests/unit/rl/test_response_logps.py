"""PolicyModel.response_logps (the LM head at the response tokens only, TokenLogps over the vocabulary) gives the
values and gradients of the full-logits path (policy_logits + response_token_logps), at any temperature, for the
policy and the reference, with padded responses."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer
from llmtune.rl.model import PolicyModel
from llmtune.rl.ops import entropy_from_logits
from llmtune.rl.forward import response_token_logps, rollout_forward
from llmtune.rl.types import join


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(pad_equals_eos=False)


def policy_model(tok):
    policy = get_peft_model(make_tiny_llama(tok, hidden_size=64, seed=0),
                            LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:  # a fresh adapter would equal the reference
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return PolicyModel(policy)


def rollout_batch(vocab: int):
    """(4, 6) left-padded prompts and (4, 5) responses with 5, 3, 1 and 0 real tokens."""
    g = torch.Generator().manual_seed(2)
    query = torch.randint(3, vocab, (4, 6), generator=g)
    query_mask = torch.ones(4, 6, dtype=torch.long)
    query_mask[1, :2] = 0
    query_mask[3, :4] = 0
    responses = torch.randint(3, vocab, (4, 5), generator=g)
    mask = (torch.arange(5)[None] < torch.tensor([5, 3, 1, 0])[:, None]).long()
    return join(query, query_mask, responses, mask), responses, mask


def lora_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("reference", [False, True])
def test_response_logps_match_the_full_logits_path(tok, temperature, reference):
    model = policy_model(tok)
    inputs, responses, mask = rollout_batch(len(tok))
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))

    model.zero_grad()
    logits = (model.reference_logits if reference else model.policy_logits)(**inputs, response_width=5)
    full = response_token_logps(logits, responses, temperature) * mask
    full_entropy = entropy_from_logits(logits.detach() / temperature) * mask
    if not reference:  # the reference is the frozen base: nothing to differentiate
        (full * weights).sum().backward()
    full_grads = lora_grads(model)

    model.zero_grad()
    if reference:
        logps, entropy, _, _ = model.response_logps(**inputs, responses=responses, response_mask=mask,
                                                    temperature=temperature, reference=True, with_entropy=True)
    else:  # through forward, as the GRPO loss calls it
        logps, entropy, _, _ = model(**inputs, responses=responses, response_mask=mask, temperature=temperature,
                                     with_entropy=True)
    if not reference:
        (logps * weights).sum().backward()
    grads = lora_grads(model)

    assert logps.shape == entropy.shape == mask.shape
    assert torch.equal(logps[mask == 0], torch.zeros(int((mask == 0).sum())))  # padding is exactly 0
    torch.testing.assert_close(logps, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, full_entropy, rtol=1e-5, atol=1e-5)
    assert float(full.detach().abs().max()) > 1.0  # real log-probs, not a degenerate batch
    if reference:
        assert not logps.requires_grad and not grads
        policy = model.response_logps(**inputs, responses=responses, response_mask=mask, temperature=temperature).logps
        assert float((policy.detach() - logps).abs().max()) > 1e-2  # the adapter was really disabled
    else:
        assert full_grads.keys() == grads.keys() and len(grads) > 0
        for name in grads:
            torch.testing.assert_close(grads[name], full_grads[name], rtol=1e-4, atol=1e-6)
        assert max(float(g.abs().max()) for g in grads.values()) > 1e-3  # the gradients are not all ~0


def test_temperature_changes_the_log_probs(tok):
    """The temperature is applied (a path that ignored it would pass the test above at T = 1 only)."""
    model = policy_model(tok)
    inputs, responses, mask = rollout_batch(len(tok))
    with torch.no_grad():
        cold = model.response_logps(**inputs, responses=responses, response_mask=mask, temperature=0.5).logps
        warm = model.response_logps(**inputs, responses=responses, response_mask=mask, temperature=1.0).logps
    assert float(((cold - warm) * mask).abs().max()) > 0.1


def test_rollout_forward_without_values_uses_the_masked_head(tok):
    """GRPO's old/reference log-probs (rollout_forward without values or exact KL) go through response_logps in
    chunks of the eval batch size: the full-logits values on real tokens, exactly 0 on padding."""
    model = policy_model(tok)
    inputs, responses, mask = rollout_batch(len(tok))
    model.train()
    out = rollout_forward(model, inputs, responses, temperature=0.7, chunk_rows=3, reference=True)  # 3 + 1 rows
    assert model.training  # the train/eval mode is restored
    model.eval()
    with torch.no_grad():
        logits = model.policy_logits(**inputs, response_width=5)
        ref = model.reference_logits(**inputs, response_width=5)
    want = {"logps": response_token_logps(logits, responses, 0.7) * mask,
            "entropy": entropy_from_logits(logits / 0.7) * mask,
            "ref_logps": response_token_logps(ref, responses, 0.7) * mask}
    assert {k for k, v in vars(out).items() if v is not None} == set(want)
    for key in want:
        torch.testing.assert_close(getattr(out, key), want[key], rtol=1e-5, atol=1e-5)
    assert float((want["logps"] - want["ref_logps"]).abs().max()) > 1e-2


def group_batch(vocab: int):
    """2 prompts (5 and 3 real tokens, left-padded to 6) x 3 completions of 5, 2, 0 / 4, 5, 1 real tokens,
    rows interleaved (the groups need not be adjacent)."""
    g = torch.Generator().manual_seed(4)
    prompts = torch.randint(3, vocab, (2, 6), generator=g)
    pmask = torch.ones(2, 6, dtype=torch.long)
    pmask[0, :1] = 0
    pmask[1, :3] = 0
    order = torch.tensor([0, 1, 0, 1, 0, 1])
    responses = torch.randint(3, vocab, (6, 5), generator=g)
    mask = (torch.arange(5)[None] < torch.tensor([5, 4, 2, 5, 0, 1])[:, None]).long()
    return join(prompts[order], pmask[order], responses, mask), responses, mask


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("reference", [False, True])
def test_shared_prompts_give_the_values_and_gradients_of_separate_rows(tok, attention, reference):
    from llmtune.rl.model import shared_prompt_batch

    model = policy_model(tok)
    model.policy.get_base_model().config._attn_implementation = attention
    inputs, responses, mask = group_batch(len(tok))
    shared = shared_prompt_batch(model.policy, inputs["input_ids"], inputs["attention_mask"], responses, mask)
    assert shared["input_ids"].shape == (2, 3 + 4 + 5 + 1)  # a row per prompt: p + its completions' real tokens
    assert shared["gather"].numel() == int(mask.sum())
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(5))

    model.zero_grad()
    logits = (model.reference_logits if reference else model.policy_logits)(**inputs, response_width=5)
    full = response_token_logps(logits, responses, 0.7) * mask
    if not reference:
        (full * weights).sum().backward()
    full_grads = lora_grads(model)
    model.zero_grad()
    logps, entropy, _, _ = model.response_logps(**inputs, responses=responses, response_mask=mask, temperature=0.7,
                                                reference=reference, with_entropy=True)
    if not reference:
        (logps * weights).sum().backward()
    grads = lora_grads(model)

    torch.testing.assert_close(logps, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, entropy_from_logits(logits.detach() / 0.7) * mask, rtol=1e-5, atol=1e-5)
    assert full_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], full_grads[name], rtol=1e-4, atol=1e-5)  # fp32 sums in another order
    # a completion that could see another one would change its log-probs: the mask keeps them apart
    leaky = dict(shared, attention_mask=None)
    if attention == "sdpa":
        leaky["attention_mask"] = torch.ones_like(shared["attention_mask"]).tril()
        with torch.no_grad():
            from llmtune.core.lm_head import TokenLogps, masked_logits

            wrong = TokenLogps.apply(masked_logits(model.policy, leaky, shared["keep"])[shared["gather"]].float() / 0.7,
                                     responses[mask.bool()])
        assert float((wrong - full.detach()[mask.bool()]).abs().max()) > 1e-3
