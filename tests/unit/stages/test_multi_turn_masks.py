"""Multi-turn completions interleave the policy's turns with tool results: the loss mask has holes. Every loss path
trains only the policy's tokens: GRPO's token- and sequence-level ratios, aggregations and KL; PPO's per-token
rewards, GAE, whitening, policy and value losses; the masked LM head; the entropy metric. Each test builds the
same rollout twice, with and without the tool tokens in between, and asserts equal numbers (an unmasked path
would train the tool result, or let it move a statistic)."""

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model

from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer
from llmtune.rl.model import PolicyModel
from llmtune.rl.ops import pack_left, unpack_left
from llmtune.rl.types import join
from llmtune.stages.grpo import ops as grpo_ops
from llmtune.stages.ppo import ops as ppo_ops

# a completion of 7 tokens: sampled 0-2, tool result 3-4 (context), sampled 5-6; and a second, single-turn one
MASK = torch.tensor([[1, 1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 0, 0, 0]])
SAMPLED = MASK.bool()


def squeeze(x: torch.Tensor) -> torch.Tensor:
    """The same rollouts without their tool tokens: (B, 7) -> (B, 4) of the sampled positions."""
    index, packed = pack_left(MASK)
    return x.gather(1, index) * packed


def test_pack_left_moves_the_sampled_tokens_together_and_back():
    index, packed = pack_left(MASK)
    assert index.tolist() == [[0, 1, 2, 5, 6], [0, 1, 2, 3, 0]] and packed.tolist() == [[1] * 5, [1, 1, 1, 1, 0]]
    x = torch.arange(14.0).reshape(2, 7)
    assert torch.equal(unpack_left(x.gather(1, index) * packed, index, packed, 7), x * MASK)
    left = torch.tensor([[1, 1, 0], [1, 0, 0]])  # single-turn completions: the identity
    i, p = pack_left(left)
    assert i.tolist() == [[0, 1], [0, 0]] and p.tolist() == [[1, 1], [1, 0]]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "constant"])
def test_grpo_loss_and_kl_ignore_the_tool_tokens(level, aggregation):
    g = torch.Generator().manual_seed(0)
    logps = -torch.rand(2, 7, generator=g) * 2
    old = logps.detach() - 0.05 * torch.randn(2, 7, generator=g)
    ref = logps.detach() - 0.3 * torch.rand(2, 7, generator=g)
    junk = torch.where(SAMPLED, torch.zeros(2, 7), 5 * torch.randn(2, 7, generator=g))  # values at tool positions
    adv = torch.tensor([1.5, -0.5])
    args = dict(epsilon_low=0.2, epsilon_high=0.28, aggregation=aggregation, max_new_tokens=8, beta=0.1,
                importance_sampling_level=level)
    holed = logps.clone().requires_grad_()
    out = grpo_ops.grpo_loss(holed + junk, old + junk, adv, MASK, ref_logps=ref + junk, **args)
    dense = squeeze(logps).requires_grad_()
    want = grpo_ops.grpo_loss(dense, squeeze(old), adv, squeeze(MASK), ref_logps=squeeze(ref), **args)
    assert float(out.loss_sum) == pytest.approx(float(want.loss_sum), rel=1e-6)
    assert float(out.kl_sum) == pytest.approx(float(want.kl_sum), rel=1e-6)
    out.loss_sum.backward()
    want.loss_sum.backward()
    assert holed.grad[~SAMPLED].abs().sum() == 0  # no gradient into a tool token
    torch.testing.assert_close(squeeze(holed.grad), dense.grad)
    assert grpo_ops.count_items(MASK, aggregation) == grpo_ops.count_items(squeeze(MASK), aggregation)


def test_ppo_rewards_gae_and_whitening_walk_the_policys_tokens_only():
    """With the score at the last sampled token and GAE over the actions in order (the tool result between the
    turns is not an action); a GAE over the holed row would end the episode at the hole."""
    g = torch.Generator().manual_seed(1)
    logps, ref = -torch.rand(2, 7, generator=g), -torch.rand(2, 7, generator=g)
    values = torch.randn(2, 7, generator=g) * MASK
    scores = torch.tensor([1.0, -0.5])
    maskf = MASK.float()
    index, packed = pack_left(maskf)

    def take(x):
        return x.gather(1, index) * packed

    rewards, kl = ppo_ops.per_token_rewards(scores, take(logps), take(ref), packed, 0.1)
    adv, ret = ppo_ops.gae(rewards, take(values), packed, 1.0, 0.95)
    adv, ret = unpack_left(adv, index, packed, 7), unpack_left(ret, index, packed, 7)
    dense_rewards, _ = ppo_ops.per_token_rewards(scores, squeeze(logps), squeeze(ref), squeeze(MASK).float(), 0.1)
    dense_adv, dense_ret = ppo_ops.gae(dense_rewards, squeeze(values), squeeze(MASK).float(), 1.0, 0.95)
    torch.testing.assert_close(squeeze(adv), dense_adv)
    torch.testing.assert_close(squeeze(ret), dense_ret)
    assert adv[~SAMPLED].abs().sum() == 0 and ret[~SAMPLED].abs().sum() == 0
    naive, _ = ppo_ops.gae(*ppo_ops.per_token_rewards(scores, logps, ref, maskf, 0.1)[:1], values, maskf, 1.0, 0.95)
    assert not torch.allclose(naive * maskf, adv)  # the naive path: wrong last token and an episode cut at the hole
    w = ppo_ops.masked_whiten(adv, maskf)
    torch.testing.assert_close(squeeze(w), ppo_ops.masked_whiten(dense_adv, squeeze(MASK).float()))


def test_the_masked_head_scores_the_policys_tokens_only_with_the_tool_tokens_as_context():
    tok = make_tiny_tokenizer(pad_equals_eos=False)
    policy = get_peft_model(make_tiny_llama(tok, hidden_size=64, seed=2),
                            LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))
    model = PolicyModel(policy).eval()
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(5, tok.vocab_size, (2, 4), generator=g)
    responses = torch.randint(5, tok.vocab_size, (2, 7), generator=g)
    real = torch.tensor([[1] * 7, [1, 1, 1, 1, 0, 0, 0]])
    inputs = join(prompts, torch.ones(2, 4, dtype=torch.long), responses, real)
    kept = []
    hook = policy.get_base_model().lm_head.register_forward_hook(lambda m, a, out: kept.append(out.shape[0]))
    with torch.no_grad():
        full = model.response_logps(**inputs, responses=responses, response_mask=real, with_entropy=True)
        scored = model.response_logps(**inputs, responses=responses, response_mask=real, with_entropy=True,
                                      score_mask=MASK)
    hook.remove()
    assert kept == [int(real.sum()), int(MASK.sum())]  # the LM head ran at the policy's tokens only
    torch.testing.assert_close(scored.logps[SAMPLED], full.logps[SAMPLED], rtol=1e-5, atol=1e-6)
    assert (scored.logps[~SAMPLED] == 0).all() and (scored.entropy[~SAMPLED] == 0).all()
    # context: the tool tokens are still attended to (changing them changes the later turn's log-probs)
    other = responses.clone()
    other[0, 3:5] = (other[0, 3:5] + 7) % tok.vocab_size
    with torch.no_grad():
        moved = model.response_logps(**join(prompts, torch.ones(2, 4, dtype=torch.long), other, real),
                                     responses=other, response_mask=real, score_mask=MASK)
    assert float((moved.logps[0, 5:] - scored.logps[0, 5:]).abs().max()) > 1e-4
    assert math.isfinite(float(scored.logps.sum()))
