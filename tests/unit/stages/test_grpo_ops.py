"""GRPO arithmetic on hand-built tensors: group advantages (group/batch/none scaling) over the rows that train,
groups by explicit ids, all-equal groups, RLOO and REINFORCE++ baselines, DAPO's overlong penalty, the three loss
aggregations, asymmetric clipping (clip-higher), GSPO's sequence ratio, the (importance-weighted) k3 KL term, the
engine importance weights, and exactness of the step normaliser."""

import math

import pytest
import torch

from llmtune.rl.ops import kl_estimate
from llmtune.stages.grpo import ops


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # G = 4: one mixed group, one all-equal
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    adv, equal = ops.group_advantages(rewards, ids, scale_rewards="group")
    std = math.sqrt(((0.5**2) * 4) / 3)  # unbiased std of [1, 0, 0, 1]
    expected = [0.5 / (std + 1e-4), -0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0.5 / (std + 1e-4), 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert equal.tolist() == [False] * 4 + [True] * 4
    assert torch.equal(adv[4:], torch.zeros(4))  # exactly zero, not 0/eps noise


def test_scale_rewards_batch_and_none():
    rewards = torch.tensor([3.0, 1.0, 5.0, 5.0])  # G = 2
    ids = torch.tensor([0, 0, 1, 1])
    none, equal = ops.group_advantages(rewards, ids, scale_rewards="none")
    assert none.tolist() == [1.0, -1.0, 0.0, 0.0] and equal.tolist() == [False, False, True, True]
    batch, _ = ops.group_advantages(rewards, ids, scale_rewards="batch")
    std = float(torch.tensor([3.0, 1.0, 5.0, 5.0]).std())  # unbiased, over the whole batch
    assert batch.tolist() == pytest.approx([1 / (std + 1e-4), -1 / (std + 1e-4), 0, 0], rel=1e-6)
    given, _ = ops.group_advantages(rewards, ids, scale_rewards="batch", batch_std=2.0)  # gathered over ranks
    assert given.tolist() == pytest.approx([1 / 2.0001, -1 / 2.0001, 0, 0], rel=1e-6)
    with pytest.raises(ValueError, match="scale_rewards"):
        ops.group_advantages(rewards, ids, scale_rewards="std")


# ---- bug 1: rows that do not train never enter a statistic --------------------------------------------------------
def test_a_masked_row_leaves_its_groups_mean_and_std():
    # G = 4; row 3 (reward 5) was truncated and masked. Statistics over [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3).
    # The old code averaged in the masked 5: mean 1.5, so row 0 (reward 1, the best trained row) got a NEGATIVE
    # advantage (1 - 1.5) / std([1, 0, 0, 5]) = -0.2.
    rewards, ids = torch.tensor([1.0, 0.0, 0.0, 5.0]), torch.zeros(4, dtype=torch.long)
    trainable = torch.tensor([True, True, True, False])
    adv, equal = ops.group_advantages(rewards, ids, trainable, "group")
    s = math.sqrt(1 / 3) + 1e-4
    assert adv.tolist() == pytest.approx([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, 0.0], rel=1e-6)
    assert adv[3] == 0 and not equal.any()
    none, _ = ops.group_advantages(rewards, ids, trainable, "none")
    assert none.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, 0.0], rel=1e-6)


def test_a_fully_masked_group_leaves_the_batch_std():
    # group 0 (rewards 3, 1) is entirely masked (e.g. dropped or abstained); batch std over [0, 2] only = sqrt(2)
    rewards, ids = torch.tensor([3.0, 1.0, 0.0, 2.0]), torch.tensor([0, 0, 1, 1])
    trainable = torch.tensor([False, False, True, True])
    adv, equal = ops.group_advantages(rewards, ids, trainable, "batch")
    s = math.sqrt(2) + 1e-4  # the old code: std([3, 1, 0, 2]) = 1.29
    assert adv.tolist() == pytest.approx([0.0, 0.0, -1 / s, 1 / s], rel=1e-6)
    assert equal.tolist() == [True, True, False, False]  # no trainable rows: no signal
    stats = ops.advantage_moments("grpo", "batch", rewards, trainable, torch.ones(4))
    assert stats.tolist() == [2.0, 2.0, 4.0]  # what ranks sum: count, sum, sum of squares of trainable rewards
    assert ops.moments_std(stats, unbiased=True) == pytest.approx(math.sqrt(2))
    for estimator in ops.ADVANTAGE_ESTIMATORS:  # no estimator gives a masked row an advantage
        out = ops.compute_advantages(estimator, rewards, ids, trainable, token_counts=torch.ones(4))
        assert out[:2].tolist() == [0.0, 0.0] and torch.isfinite(out).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_a_group_with_one_trainable_row_gets_zero_advantage_not_nan(scale):
    rewards, ids = torch.tensor([1.0, 0.0, 7.0, 4.0, 2.0]), torch.tensor([0, 0, 0, 1, 1])
    trainable = torch.tensor([True, False, False, True, True])
    adv, equal = ops.group_advantages(rewards, ids, trainable, scale)
    assert torch.isfinite(adv).all() and adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert equal.tolist() == [True, True, True, False, False]
    loo = ops.rloo_advantages(rewards, ids, trainable)
    assert loo.tolist() == [0.0, 0.0, 0.0, 2.0, -2.0]  # the lone row has no one to leave out
    everything_masked = torch.zeros(5, dtype=torch.bool)
    for estimator in ops.ADVANTAGE_ESTIMATORS:
        out = ops.compute_advantages(estimator, rewards, ids, everything_masked, scale if estimator == "grpo"
                                     else "group", token_counts=torch.ones(5))
        assert out.tolist() == [0.0] * 5


# ---- bug 5: groups by explicit ids, never by position --------------------------------------------------------------
def test_a_shuffled_layout_gives_the_same_per_row_advantages():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 4, (12,), generator=g).float()  # 3 groups of G = 4, consecutive
    ids = torch.arange(3).repeat_interleave(4)
    trainable = torch.rand(12, generator=g) > 0.2
    perm = torch.randperm(12, generator=g)
    for estimator in ops.ADVANTAGE_ESTIMATORS:
        for scale in ("group", "batch", "none"):
            tokens = torch.arange(1, 13).float()
            one = ops.compute_advantages(estimator, rewards, ids, trainable, scale, token_counts=tokens)
            two = ops.compute_advantages(estimator, rewards[perm], ids[perm], trainable[perm], scale,
                                         token_counts=tokens[perm])
            assert torch.allclose(two, one[perm], atol=1e-6), (estimator, scale)
    equal = ops.group_all_equal(rewards, ids, trainable)
    assert torch.equal(ops.group_all_equal(rewards[perm], ids[perm], trainable[perm]), equal[perm])


def test_an_interleaved_layout_is_grouped_by_id():
    # prompts 0 and 1 interleaved: group 0 = rewards {1, 3}, group 1 = {5, 9}. The old reshape(-1, 2) paired
    # (1, 5) and (3, 9) and returned [-2, 2, -3, 3].
    rewards, ids = torch.tensor([1.0, 5.0, 3.0, 9.0]), torch.tensor([0, 1, 0, 1])
    adv, equal = ops.group_advantages(rewards, ids, scale_rewards="none")
    assert adv.tolist() == [-1.0, -2.0, 1.0, 2.0] and not equal.any()
    assert ops.group_all_equal(torch.tensor([1.0, 5.0, 1.0, 9.0]), ids).tolist() == [True, False, True, False]


# ---- baselines -------------------------------------------------------------------------------------------------
def test_rloo_leave_one_out_by_hand():
    rewards, ids = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0]), torch.tensor([0, 0, 0, 0, 1, 1])
    adv = ops.rloo_advantages(rewards, ids)
    # row 0: 1 - mean(0, 0, 1) = 2/3; row 1: 0 - mean(1, 0, 1) = -2/3; the all-equal group: exactly 0
    assert adv.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0, 0.0], rel=1e-6)
    masked = ops.rloo_advantages(rewards, ids, torch.tensor([True, True, True, False, True, True]))
    assert masked.tolist() == pytest.approx([1.0, -0.5, -0.5, 0.0, 0.0, 0.0], rel=1e-6)  # row 3 left out


def test_reinforce_plus_plus_whitens_over_the_trainable_tokens():
    rewards = torch.tensor([1.0, 0.0, 2.0, 1.0])
    tokens = torch.tensor([1, 3, 2, 2])
    trainable = torch.tensor([True, True, True, False])
    # reference (OpenRLHF's global normalisation): every trainable token carries its completion's return
    flat = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0])
    mean, var = flat.mean(), ((flat - flat.mean()) ** 2).mean()  # 5/6 and 29/36 (biased)
    expected = ((rewards - mean) / var.clamp(min=1e-8).sqrt()).tolist()[:3] + [0.0]
    stats = ops.advantage_moments("reinforce_plus_plus", "group", rewards, trainable, tokens)
    assert stats.tolist() == pytest.approx([6.0, 5.0, 9.0])
    adv = ops.compute_advantages("reinforce_plus_plus", rewards, torch.tensor([0, 0, 1, 1]), trainable,
                                 stats=stats)
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert float(mean) == pytest.approx(5 / 6) and float(var) == pytest.approx(29 / 36)
    # no per-prompt baseline: an all-equal group still moves (both rewards above the batch mean)
    same = ops.compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]),
                                  torch.ones(4, dtype=torch.bool), token_counts=torch.ones(4))
    assert same.tolist() == pytest.approx([1.0, 1.0, -1.0, -1.0], rel=1e-6)
    with pytest.raises(ValueError, match="advantage_estimator"):
        ops.compute_advantages("ppo", rewards, torch.zeros(4, dtype=torch.long), trainable)


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


# ---- GSPO, the importance-weighted KL, engine importance weights ------------------------------------------------
def test_gspo_sequence_ratio_clip_and_gradient_by_hand():
    old = torch.zeros(3, 3)
    # row 0: log-ratio mean (0.1 + 0.3) / 2 = 0.2 -> s = e^0.2 > 1 + 4e-4, A > 0: clipped, no gradient
    # row 1: mean 2e-4 -> s = e^2e-4 inside [1 - 3e-4, 1 + 4e-4]: gradient -A s / |y| on each of its 2 tokens
    # row 2: one token, log-ratio -1e-3 -> s < 1 - 3e-4, A < 0: clipped
    delta = torch.tensor([[0.1, 0.3, 9.0], [1e-4, 3e-4, 9.0], [-1e-3, 9.0, 9.0]])  # 9.0 = padding garbage
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([1.0, 2.0, -1.0])
    logps = delta.clone().requires_grad_()
    out = ops.grpo_loss(logps, old, adv, mask, 3e-4, 4e-4, "sequence_mean", 3, importance_sampling_level="sequence")
    s1 = math.exp(2e-4)
    expected = -1.0004 + -(s1 * 2.0) + -(0.9997 * -1.0)  # per-sequence -min(s A, clip(s) A), sequence_mean
    assert float(out.loss_sum) == pytest.approx(expected, rel=1e-6)
    out.loss_sum.backward()
    assert logps.grad[1, :2].tolist() == pytest.approx([-2.0 * s1 / 2] * 2, rel=1e-6)
    assert logps.grad[0].abs().sum() == 0 and logps.grad[2].abs().sum() == 0 and logps.grad[1, 2] == 0
    assert float(out.clipped_high) == 2 and float(out.clipped_low) == 1  # tokens of the clipped sequences
    # the token level clips each token on its own: row 1's tokens are inside 0.2, row 0's 0.3 is not
    tok = ops.grpo_loss(delta, old, adv, mask, 0.2, 0.2, "sequence_mean", 3)
    assert float(tok.clipped_high) == 1
    with pytest.raises(ValueError, match="importance_sampling_level"):
        ops.grpo_loss(delta, old, adv, mask, 0.2, 0.2, "sequence_mean", 3, importance_sampling_level="seq")


@pytest.mark.parametrize("level", ops.IMPORTANCE_SAMPLING_LEVELS)
def test_kl_is_importance_weighted_when_the_policy_has_moved(level):
    logps = torch.tensor([[-1.0, -2.0]])
    old = torch.tensor([[-1.2, -2.0]])
    ref = torch.tensor([[-1.5, -2.5]])
    mask = torch.ones(1, 2)
    k3 = torch.exp(ref - logps) - (ref - logps) - 1
    # the KL of token t is weighted by token t's own ratio at BOTH levels (issue 30: GSPO weighted it by the
    # sequence ratio): token 0 by e^0.2, token 1 by e^0 = 1 (the sequence ratio would be e^0.1 for both)
    ratio = torch.exp(logps - old)
    assert ratio.tolist()[0] == pytest.approx([math.exp(0.2), 1.0])
    moved = ops.grpo_loss(logps, old, torch.tensor([0.0]), mask, 0.2, 0.2, "token_mean", 2, beta=0.1,
                          ref_logps=ref, importance_sampling_level=level)
    assert float(moved.kl_sum) == pytest.approx(float((ratio * k3).sum()), rel=1e-6)
    assert float(moved.loss_sum) == pytest.approx(0.1 * float((ratio * k3).sum()), rel=1e-6)
    hand = 0.1 * (math.exp(0.2) * (math.exp(-0.5) + 0.5 - 1) + 1.0 * (math.exp(-0.5) + 0.5 - 1))
    assert float(moved.loss_sum) == pytest.approx(hand, rel=1e-6)
    on_policy = ops.grpo_loss(logps, None, torch.tensor([0.0]), mask, 0.2, 0.2, "token_mean", 2, beta=0.1,
                              ref_logps=ref, importance_sampling_level=level)
    assert float(on_policy.kl_sum) == pytest.approx(float(k3.sum()), rel=1e-6)  # sampled from this policy


def test_is_weights_scale_the_surrogate_not_the_kl():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -2.0]])
    mask = torch.ones(1, 2)
    weights = torch.tensor([[0.5, 2.0]])
    k3 = float((torch.exp(ref - logps) - (ref - logps) - 1).sum())
    out = ops.grpo_loss(logps, None, torch.tensor([1.0]), mask, 0.2, 0.2, "token_mean", 2, beta=0.1, ref_logps=ref,
                        is_weights=weights)
    assert float(out.loss_sum) == pytest.approx(-(0.5 + 2.0) + 0.1 * k3, rel=1e-6)  # on policy: -w_t * A per token
    assert float(out.kl_sum) == pytest.approx(k3, rel=1e-6)
    out.loss_sum.backward()
    # d/dlogp of -w r A (r = 1 in value) = -w A, plus beta * d k3 = beta * (1 - exp(ref - logp))
    expected = [-0.5 + 0.1 * (1 - math.exp(-0.5)), -2.0 + 0.1 * (1 - 1.0)]
    assert logps.grad[0].tolist() == pytest.approx(expected, rel=1e-6)
