"""GRPO arithmetic on hand-built tensors: group advantages (group/batch/none scaling), all-equal groups, the three
loss aggregations, asymmetric clipping (clip-higher), the k3 KL term, and exactness of the step normaliser."""

import math

import pytest
import torch

from llmtune.rl.ops import kl_estimate
from llmtune.stages.grpo import ops


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # G = 4: one mixed group, one all-equal
    adv, equal = ops.group_advantages(rewards, 4, "group")
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert equal.tolist() == [False, True]
    assert torch.equal(adv[4:], torch.zeros(4))  # exactly zero, not 0/eps noise


def test_scale_rewards_batch_and_none():
    rewards = torch.tensor([3.0, 1.0, 5.0, 5.0])  # G = 2
    none, equal = ops.group_advantages(rewards, 2, "none")
    assert none.tolist() == [1.0, -1.0, 0.0, 0.0] and equal.tolist() == [False, True]
    batch, _ = ops.group_advantages(rewards, 2, "batch")
    std = float(torch.tensor([3.0, 1.0, 5.0, 5.0]).std())  # unbiased, over the whole batch
    assert batch.tolist() == pytest.approx([1 / (std + 1e-4), -1 / (std + 1e-4), 0, 0], rel=1e-6)
    given, _ = ops.group_advantages(rewards, 2, "batch", batch_std=2.0)  # gathered over ranks by the caller
    assert given.tolist() == pytest.approx([1 / 2.0001, -1 / 2.0001, 0, 0], rel=1e-6)
    with pytest.raises(ValueError, match="whole groups"):
        ops.group_advantages(rewards, 3)


# two completions: lengths 3 and 1; on policy (ratio 1) the per-token loss is -A
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])
ADV = torch.tensor([1.0, -2.0])
ZERO = torch.zeros(2, 3)


@pytest.mark.parametrize("aggregation, loss_sum, items", [
    ("token_mean", -1 * 3 + 2 * 1, 4),       # sum over tokens / 4 tokens = -0.25
    ("sequence_mean", -1 + 2, 2),            # per-sequence means (-1, +2), / 2 completions = 0.5
    ("constant", (-3 + 2) / 8, 2),           # token sum / L (max_new_tokens = 8), / 2 completions
])
def test_loss_aggregations_by_hand(aggregation, loss_sum, items):
    out = ops.grpo_loss(ZERO, ZERO, ADV, MASK, 0.2, 0.2, aggregation, max_new_tokens=8)
    assert float(out.loss_sum) == pytest.approx(loss_sum)
    assert int(ops.count_items(MASK, aggregation)) == items


def test_clip_higher_is_asymmetric():
    old = torch.zeros(4, 1)
    ratios = torch.tensor([[1.25], [1.25], [0.75], [0.75]])
    logps = torch.log(ratios)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    mask = torch.ones(4, 1)
    # symmetric 0.2: r = 1.25 > 1.2 is clipped for A > 0; r = 0.75 < 0.8 is clipped for A < 0
    sym = ops.grpo_loss(logps.clone().requires_grad_(), old, adv, mask, 0.2, 0.2, "token_mean", 1)
    assert float(sym.clipped_high) == 1 and float(sym.clipped_low) == 1
    # clip-higher 0.28: 1.25 < 1.28 is no longer clipped above; the lower side is unchanged
    lp = logps.clone().requires_grad_()
    dapo = ops.grpo_loss(lp, old, adv, mask, 0.2, 0.28, "token_mean", 1)
    assert float(dapo.clipped_high) == 0 and float(dapo.clipped_low) == 1
    # values: -min(rA, clip(r)A) per row
    expected = -(1.25 * 1) + -(-1.25) + -(0.75) + -(-0.8)
    assert float(dapo.loss_sum) == pytest.approx(expected)
    dapo.loss_sum.backward()
    # gradient flows through rows 0,1,2 (unclipped branch) and not through the clipped row 3
    assert lp.grad[3, 0] == 0 and all(lp.grad[i, 0] != 0 for i in range(3))


def test_k3_kl_term_and_zero_at_the_reference():
    logps = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -2.0]])
    k3 = kl_estimate(logps, ref, "k3")
    assert k3[0, 0] == pytest.approx(math.exp(-0.5) + 0.5 - 1) and k3[0, 1] == 0
    assert kl_estimate(logps, ref, "k1")[0, 0] == pytest.approx(0.5)
    assert kl_estimate(logps, ref, "k2")[0, 0] == pytest.approx(0.125)
    mask = torch.ones(1, 2)
    with_kl = ops.grpo_loss(logps, logps, torch.tensor([0.0]), mask, 0.2, 0.2, "token_mean", 2, beta=0.1,
                            ref_logps=ref)
    assert float(with_kl.loss_sum) == pytest.approx(0.1 * float(k3.sum()))
    same = ops.grpo_loss(logps, logps, torch.tensor([1.0]), mask, 0.2, 0.2, "token_mean", 2, beta=0.1,
                         ref_logps=logps.clone())
    assert float(same.kl_sum) == 0.0
    with pytest.raises(ValueError, match="reference"):
        ops.grpo_loss(logps, logps, torch.tensor([1.0]), mask, 0.2, 0.2, "token_mean", 2, beta=0.1)


@pytest.mark.parametrize("aggregation", ops.AGGREGATIONS)
def test_step_loss_does_not_depend_on_the_micro_batch_split(aggregation):
    g = torch.Generator().manual_seed(0)
    B, N = 8, 5
    logps = torch.randn(B, N, generator=g)
    old = logps + 0.3 * torch.randn(B, N, generator=g)
    adv = torch.randn(B, generator=g)
    lengths = torch.tensor([5, 1, 3, 2, 5, 4, 1, 2])
    mask = (torch.arange(N)[None] < lengths[:, None]).long()

    def step(split):
        total = sum(ops.count_items(mask[i:i + split], aggregation) for i in range(0, B, split))
        return sum(ops.grpo_loss(logps[i:i + split], old[i:i + split], adv[i:i + split], mask[i:i + split],
                                 0.2, 0.28, aggregation, N).loss_sum / total for i in range(0, B, split))

    one = step(B)
    assert float(step(1)) == pytest.approx(float(one), rel=1e-6)
    assert float(step(2)) == pytest.approx(float(one), rel=1e-6)
    assert float(step(3)) == pytest.approx(float(one), rel=1e-6)  # a group of 4 spans micro-batches


def test_format_reward():
    from llmtune.rewards import format_reward

    texts = ["5 + 3 = 8. #### 8", "#### $1,234.50.", "#### 8 apples", "The answer is 8", "#### 8 #### 9", "####"]
    assert format_reward([""] * 6, texts) == [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]
