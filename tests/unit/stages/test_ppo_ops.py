"""PPO arithmetic against hand-computed values: GAE (terminal step, masked tail), clipped losses (both branches),
per-token rewards, whitening, the adaptive KL controller and running score statistics."""

import math

import pytest
import torch

from llmtune.stages.ppo import ops


def test_gae_hand_computed_with_terminal_step_and_masked_tail():
    rewards = torch.tensor([[0.1, -0.2, 1.0, 5.0], [0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.4, 0.3, 9.0], [0.2, 0.4, 0.6, 0.8]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    adv, ret = ops.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: t=2 is terminal (V_3 = 0, the pad's reward 5.0 and value 9.0 never enter)
    a2 = 1.0 - 0.3
    a1 = (-0.2 + 0.9 * 0.3 - 0.4) + 0.72 * a2
    a0 = (0.1 + 0.9 * 0.4 - 0.5) + 0.72 * a1
    assert adv[0].tolist() == pytest.approx([a0, a1, a2, 0.0], abs=1e-6)
    assert ret[0].tolist() == pytest.approx([a0 + 0.5, a1 + 0.4, a2 + 0.3, 0.0], abs=1e-6)
    adv1, _ = ops.gae(rewards[1:], values[1:], mask[1:], gamma=1.0, lam=1.0)  # Monte Carlo: sum of rewards - V
    assert adv1[0].tolist() == pytest.approx([0.8, 0.6, 0.4, 0.2], abs=1e-6)


def test_policy_loss_hand_computed_both_branches():
    old = torch.zeros(1, 4)
    logps = torch.log(torch.tensor([[1.5, 0.5, 0.5, 100.0]]))
    adv = torch.tensor([[1.0, 1.0, -2.0, 10.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    out = ops.policy_loss(logps, old, adv, mask, cliprange=0.2)
    # ratio 1.5, A=1: max(-1.5, -1.2) = -1.2 (clipped); ratio 0.5, A=1: max(-0.5, -0.8) = -0.5 (unclipped);
    # ratio 0.5, A=-2: max(1.0, 1.6) = 1.6 (clipped); the pad is excluded
    assert float(out.loss_sum) == pytest.approx(-1.2 - 0.5 + 1.6, abs=1e-6)
    assert float(out.clipped) == 2
    assert float(out.approx_kl_sum) == pytest.approx(0.5 * (math.log(1.5) ** 2 + 2 * math.log(0.5) ** 2), abs=1e-6)


def test_policy_loss_gradient_is_zero_in_the_clipped_branch():
    logps = torch.log(torch.tensor([[1.5, 0.9]])).requires_grad_(True)
    out = ops.policy_loss(logps, torch.zeros(1, 2), torch.tensor([[1.0, 1.0]]), torch.ones(1, 2), cliprange=0.2)
    out.loss_sum.backward()
    # token 0 is clipped (ratio 1.5 > 1.2 with A > 0): no gradient; token 1: d(-A r)/dlogp = -r = -0.9
    assert logps.grad.tolist()[0] == pytest.approx([0.0, -0.9], abs=1e-6)


def test_value_loss_hand_computed():
    values = torch.tensor([[0.5, -0.1, 1.5, 7.0]])
    old = torch.zeros(1, 4)
    returns = torch.ones(1, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, clipped = ops.value_loss(values, old, returns, mask, cliprange_value=0.2)
    # 0.5 -> clipped 0.2: max(0.25, 0.64); -0.1 inside the range: 1.21; 1.5 -> 0.2: max(0.25, 0.64)
    assert float(loss) == pytest.approx(0.5 * (0.64 + 1.21 + 0.64), abs=1e-6)
    assert float(clipped) == 2


def test_per_token_rewards_score_at_last_real_token_and_kl_elsewhere():
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.5, -2.0, -9.0], [-2.0, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards, kl = ops.per_token_rewards(torch.tensor([2.0, -1.0]), logps, ref, mask, kl_coef=0.1)
    assert torch.allclose(kl, torch.tensor([[0.5, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert torch.allclose(rewards, torch.tensor([[-0.05, 2.0, 0.0], [-0.1, 0.0, -1.0]]))


def test_masked_whiten_ignores_padding():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    out = ops.masked_whiten(values, mask)
    real = torch.tensor([1.0, 2.0, 3.0, 4.0])
    expected = (real - real.mean()) / real.std()  # unbiased, as TRL
    assert out[:, :2].flatten().tolist() == pytest.approx(expected.tolist(), abs=1e-5)
    assert out[:, 2].tolist() == [0.0, 0.0]
    # the same statistics passed in (as summed over ranks) give the same result
    stats = (10.0, 30.0, 4.0)
    assert torch.equal(ops.masked_whiten(values, mask, stats=stats), out)


def test_adaptive_kl_controller_follows_ziegler():
    ctl = ops.KLController(0.1, target=6.0, horizon=10000)
    ctl.update(12.0, n_rollouts=100)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 10000))
    ctl.update(5.4, n_rollouts=100)  # error -0.1
    assert ctl.value == pytest.approx(0.1 * (1 + 0.002) * (1 - 0.1 * 0.01))
    fixed = ops.KLController(0.1)
    fixed.update(100.0, 100)
    assert fixed.value == 0.1


def test_running_moments_match_the_full_history_and_never_identity():
    torch.manual_seed(0)
    a, b = torch.randn(7) * 3 + 2, torch.randn(5) - 1
    moments = ops.RunningMoments()
    first = moments.normalize(a)  # first batch: its own statistics, not mean 0 / std 1 (OpenRLHF #693)
    assert first.mean().abs() < 1e-6 and first.std().item() == pytest.approx(1.0, abs=1e-5)
    moments.update(b)
    both = torch.cat([a, b]).double()
    assert moments.mean == pytest.approx(float(both.mean()), abs=1e-9)
    assert moments.std == pytest.approx(float(both.std()), abs=1e-9)
    restored = ops.RunningMoments()
    restored.load_state_dict(moments.state_dict())
    assert (restored.mean, restored.var, restored.count) == (moments.mean, moments.var, moments.count)


def test_explained_variance():
    targets = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert ops.explained_variance(targets, targets, mask) == pytest.approx(1.0)
    assert ops.explained_variance(torch.zeros(1, 4), targets, mask) == pytest.approx(0.0, abs=1e-6)
