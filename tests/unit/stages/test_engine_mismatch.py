"""The rollout engine's log-prob mismatch (issue 22): truncated importance weights (Yao et al. 2025), their metrics,
the trainer hook that puts them into the experience, and PPO's policy loss weighted by them. Values by hand."""

import math
from types import SimpleNamespace

import pytest
import torch

from llmtune.rl import ops
from llmtune.rl.forward import RolloutForward
from llmtune.rl.iteration import Loop
from llmtune.rl.types import Experience, Layout, RolloutBatch
from llmtune.stages.ppo import ops as ppo_ops

LN2 = math.log(2.0)
# two completions, widths 3 and 2 (+1 padding); engine and trainer disagree by known ratios
TRAINER = torch.tensor([[math.log(0.5), math.log(0.2), math.log(0.9)],
                        [math.log(0.3), math.log(0.3), 123.0]])
ENGINE = torch.tensor([[math.log(0.25), math.log(0.4), math.log(0.9)],
                       [math.log(0.1), math.log(0.3), -7.0]])  # padding values are garbage on purpose
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# ratios trainer/engine: 2, 0.5, 1 | 3, 1 | padding


def test_truncated_weights_by_hand():
    trainer = TRAINER.clone().requires_grad_(True)
    w = ops.truncated_is_weights(trainer, ENGINE, MASK, cap=2.5)
    expected = torch.tensor([[2.0, 0.5, 1.0], [2.5, 1.0, 0.0]])  # 3 capped at 2.5; padding 0
    torch.testing.assert_close(w, expected)
    assert not w.requires_grad and w.dtype == torch.float32
    torch.testing.assert_close(ops.truncated_is_weights(TRAINER, ENGINE, MASK, cap=1.0),
                               torch.tensor([[1.0, 0.5, 1.0], [1.0, 1.0, 0.0]]))


def test_mismatch_stats_and_metrics_by_hand():
    stats = ops.engine_mismatch_stats(TRAINER, ENGINE, MASK, cap=2.5)
    # |delta| = ln2 (0.5 vs 0.25), ln2 (0.2 vs 0.4), 0 | ln3, 0 ; weights 2, .5, 1, 2.5, 1 ; one ratio (3) > 2.5
    torch.testing.assert_close(stats, torch.tensor([2 * LN2 + math.log(3.0), math.log(3.0), 5.0, 7.0, 1.0, 0.0]))
    m = ops.engine_mismatch_metrics(stats[None])
    assert m["rollout/logprob_diff_mean"] == pytest.approx((2 * LN2 + math.log(3.0)) / 5)
    assert m["rollout/logprob_diff_max"] == pytest.approx(math.log(3.0))
    assert m["rollout/is_weight_mean"] == pytest.approx(7.0 / 5)
    assert m["rollout/is_clipped_fraction"] == pytest.approx(1 / 5)
    # two ranks: sums add, the max is the max of the ranks' maxima
    other = torch.tensor([0.5, 0.5, 1.0, 1.0, 0.0, 0.0])
    both = ops.engine_mismatch_metrics(torch.stack([stats, other]))
    assert both["rollout/logprob_diff_mean"] == pytest.approx((2 * LN2 + math.log(3.0) + 0.5) / 6)
    assert both["rollout/logprob_diff_max"] == pytest.approx(math.log(3.0))
    empty = ops.engine_mismatch_stats(TRAINER, ENGINE, torch.zeros_like(MASK), cap=2.0)
    assert empty.tolist() == [0.0] * 6 and ops.engine_mismatch_metrics(empty)["rollout/is_weight_mean"] == 1.0


def test_ppo_policy_loss_is_weighted_per_token():
    old = torch.zeros(1, 3)
    logps = torch.tensor([[0.0, math.log(1.5), math.log(0.5)]], requires_grad=True)  # ratios 1, 1.5, 0.5
    adv = torch.tensor([[2.0, 1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0]])
    w = torch.tensor([[0.5, 2.0, 1.5]])
    out = ppo_ops.policy_loss(logps, old, adv, mask, cliprange=0.2, is_weights=w)
    # per token max(-A r, -A clip(r, .8, 1.2)): -2, max(-1.5, -1.2) = -1.2, max(0.5, 0.8) = 0.8 -> x w
    assert float(out.loss_sum.detach()) == pytest.approx(-2 * 0.5 - 1.2 * 2.0 + 0.8 * 1.5)
    assert float(out.clipped) == 2.0  # the weights change the loss, not the clip statistics
    unweighted = ppo_ops.policy_loss(logps, old, adv, mask, cliprange=0.2)
    assert float(unweighted.loss_sum.detach()) == pytest.approx(-2 - 1.2 + 0.8)
    out.loss_sum.backward()
    # d/dlogp: token 0 unclipped: -A r w = -2 x 1 x 0.5; tokens 1 and 2 take the clipped (constant) branch: 0
    torch.testing.assert_close(logps.grad, torch.tensor([[-1.0, 0.0, 0.0]]))


def _fake_trainer(correction: bool, world_size: int = 1, truncation=None):
    """What Loop.engine_correction reads of an iteration's loop, with a stand-in forward and two equal ranks."""
    logged, forwards = [], []

    def forward(batch, mask=None):
        forwards.append(batch)
        return RolloutForward(logps=TRAINER)

    fake = SimpleNamespace(correction=correction, correction_cap=2.5, log_metrics=logged.append, forward=forward,
                           correction_truncation=lambda batch: truncation if batch.engine_logps is not None else None,
                           ranks=SimpleNamespace(world=world_size, gather=lambda t: torch.cat([t, t])),
                           step=lambda: 0)
    return fake, logged, forwards


def _batch(engine_logps):
    """Two rollouts of 3 and 2 completion tokens (MASK), with these engine log-probs."""
    mask = MASK.long()
    return RolloutBatch(torch.ones(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.long),
                        torch.zeros(2, 3, dtype=torch.long), mask, mask, engine_logps,
                        torch.ones(2, dtype=torch.bool), torch.arange(2), torch.zeros(2, dtype=torch.long), [])


def test_engine_correction_puts_weights_and_metrics():
    fake, logged, forwards = _fake_trainer(correction=True)
    experience = Experience(1)
    experience.add("responses", torch.zeros(2, 3), Layout.TOKEN)
    batch = _batch(ENGINE * MASK)
    Loop.engine_correction(fake, experience, batch)
    assert forwards == [batch]  # trainer log-probs computed when not given
    torch.testing.assert_close(experience["is_weights"], torch.tensor([[2.0, 0.5, 1.0], [2.5, 1.0, 0.0]]))
    assert experience.layouts["is_weights"] is Layout.TOKEN
    assert logged[0]["rollout/is_clipped_fraction"] == pytest.approx(0.2)
    assert logged[0]["rollout/logprob_diff_max"] == pytest.approx(math.log(3.0))

    fake, logged, forwards = _fake_trainer(correction=False, world_size=2)
    experience = Experience(1)
    Loop.engine_correction(fake, experience, _batch(ENGINE * MASK), RolloutForward(logps=TRAINER))
    assert "is_weights" not in experience and forwards == []  # off: measured only; given logps reused
    assert logged[0]["rollout/logprob_diff_mean"] == pytest.approx((2 * LN2 + math.log(3.0)) / 5)  # 2 equal ranks

    fake, logged, forwards = _fake_trainer(correction=True)
    experience = Experience(1)
    Loop.engine_correction(fake, experience, _batch(None))
    assert experience.tensors == {} and logged == [] and forwards == []  # hf: no engine log-probs, nothing to do


# ---- the engine's sampling distribution: top-k / top-p truncation on the trainer's side (issue 30) -------------
@pytest.mark.parametrize("top_k,top_p,temperature", [(0, 1.0, 1.0), (3, 1.0, 1.0), (0, 0.6, 0.7), (4, 0.8, 1.3),
                                                     (1, 1.0, 1.0)])
def test_sampling_logps_equal_transformers_warpers(top_k, top_p, temperature):
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=gen) * 2.0 / temperature  # (M, V), already divided by T
    warped = logits.clone()
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(None, warped)
    # sample tokens the truncated distribution can produce (the argmax is always kept)
    tokens = torch.multinomial(warped.softmax(-1), 1, generator=gen).squeeze(1)
    expected = warped.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    got = ops.sampling_logps(logits, tokens, top_k, top_p, chunk=4)  # chunking splits the rows
    torch.testing.assert_close(got, expected)
    full = logits.log_softmax(-1).gather(1, tokens[:, None]).squeeze(1)
    kept_mass = (warped > -torch.inf).float().mul(logits.softmax(-1)).sum(-1)
    # the bias of issue 30: full-vocabulary log-prob - truncated log-prob = log(kept mass), for every token
    torch.testing.assert_close(full - got, kept_mass.log())
    if not top_k and top_p == 1.0:
        torch.testing.assert_close(got, full)


def test_sampling_logps_keep_the_sampled_token_outside_the_trainer_truncation():
    """A token just outside the trainer's top-k (engine rounding put it inside) is kept: finite log-prob, with the
    support = the trainer's top-k plus that token."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.999, -5.0]])
    got = ops.sampling_logps(logits, torch.tensor([3]), top_k=3)
    support = logits[0, :4]
    assert float(got) == pytest.approx(float(0.999 - torch.logsumexp(support, 0)), rel=1e-6)
    inside = ops.sampling_logps(logits, torch.tensor([0]), top_k=3)
    assert float(inside) == pytest.approx(float(3.0 - torch.logsumexp(logits[0, :3], 0)), rel=1e-6)


def test_engine_correction_uses_the_truncated_side_when_sampling_is_truncated():
    fake, logged, forwards = _fake_trainer(correction=True, truncation=(5, 1.0))
    experience = Experience(1)
    experience.add("responses", torch.zeros(2, 3), Layout.TOKEN)
    # on policy under top-k: the trainer's truncated log-probs equal the engine's, the full ones are lower
    fwd = RolloutForward(logps=ENGINE - 3.0, sampling_logps=ENGINE.clone())
    Loop.engine_correction(fake, experience, _batch(ENGINE * MASK), fwd)
    torch.testing.assert_close(experience["is_weights"], MASK)  # 1 on every real token, not e^-3
    assert logged[0]["rollout/logprob_diff_max"] == 0.0
    with pytest.raises(RuntimeError, match="truncation"):
        Loop.engine_correction(fake, Experience(1), _batch(ENGINE * MASK), RolloutForward(logps=ENGINE))


def test_a_nonfinite_engine_logp_gets_weight_zero_and_is_counted():
    engine = ENGINE.clone()
    engine[0, 1] = float("nan")
    engine[1, 0] = float("-inf")
    w = ops.truncated_is_weights(TRAINER, engine, MASK, cap=2.5)
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))  # never NaN
    stats = ops.engine_mismatch_stats(TRAINER, engine, MASK, cap=2.5)
    # finite tokens: ln2 (0.5 vs 0.25), 0, 0 -> 3 tokens, weights 2 + 1 + 1; 2 non-finite
    torch.testing.assert_close(stats, torch.tensor([LN2, LN2, 3.0, 4.0, 0.0, 2.0]))
    m = ops.engine_mismatch_metrics(stats[None])
    assert m["rollout/engine_logp_nonfinite_fraction"] == pytest.approx(2 / 5)
    assert m["rollout/logprob_diff_mean"] == pytest.approx(LN2 / 3) and math.isfinite(m["rollout/is_weight_mean"])
    assert "rollout/engine_logp_nonfinite_fraction" not in ops.engine_mismatch_metrics(
        ops.engine_mismatch_stats(TRAINER, ENGINE, MASK, cap=2.5)[None])
