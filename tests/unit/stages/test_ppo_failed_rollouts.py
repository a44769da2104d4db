"""PPO's make_experience with rollouts that cannot train (a multi-turn rollout whose environment or tool
infrastructure failed; one beyond rollout.max_staleness): with a stand-in for sampling, the model forwards and the
reward, a batch in which half the rows failed gives exactly the statistics (scores, running score moments, KL and the
adaptive KL controller, lengths, entropy, truncation, advantages) of the good rows alone, and counts the failed ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmtune.config import load_recipe
from llmtune.core.guard import ROW_KEY
from llmtune.rl.types import LENGTH, STOP, RolloutBatch, Trajectory
from llmtune.stages.ppo import ops
from llmtune.stages.ppo.trainer import PPOTrainer

ROWS = [  # (completion ids, finish, infrastructure error, score)
    ([5, 9, 14, 2], STOP, None, 1.0),
    ([7, 3, 8, 11, 6, 4], LENGTH, "tool search: the index is down", 0.0),
    ([12, 6, 2], STOP, None, -0.5),
    ([4, 4, 4, 4, 4, 4, 4], LENGTH, None, 0.25),
    ([8, 2], STOP, "environment Sandbox failed in reset: OSError", 0.0),
    ([3, 13, 9, 10, 2], LENGTH, None, 2.0),
]
GOOD = [b for b, (_, _, error, _) in enumerate(ROWS) if error is None]


def trajectories(rows):
    return [Trajectory({"prompt": f"q{b}", "index": b}, [1, 20 + b], ids, [1] * len(ids), None, 0, finish,
                       info={"infrastructure_error": error}) for b, (ids, finish, error, _) in rows]


def stand_in_forward(batch, **_):
    """Log-probs, values and entropy of each token as functions of the token and its position only (the same in any
    batch), as the model's would be."""
    ids = batch.completion_ids.float()
    pos = torch.arange(ids.shape[1]).float()[None]
    logps = -0.1 * ids - 0.01 * pos
    return SimpleNamespace(logps=logps, ref_logps=logps - 0.03 * (ids % 3), values=0.05 * ids - 0.02 * pos,
                           entropy=0.5 + 0.01 * ids)


class StandInRewards:
    def __init__(self, scores):
        self.scores = scores

    def score_all(self, scored, device, skip=None):
        total = torch.tensor(self.scores)
        return total if skip is None else total.masked_fill(skip.cpu(), 0.0)


def trainer(rows, **ppo):
    recipe = load_recipe(raw={"stage": "ppo", "reward": {"function": "llmtune.rewards:gsm8k_reward"},
                              "ppo": {"rollout_batch_size": 6, "kl_coef": 0.2, "kl_target": 0.05, "kl_horizon": 10,
                                      "normalize_scores": True, "missing_eos_penalty": -1.0, **ppo},
                              "train": {"max_steps": 6, "global_batch_size": 2}})
    t = object.__new__(PPOTrainer)
    batch = RolloutBatch.from_trajectories(trajectories(rows), pad_id=0)
    logged, samples = {}, []
    t.ppo, t.rollout = recipe.ppo, recipe.rollout
    t.kl_ctl = ops.KLController(recipe.ppo.kl_coef, recipe.ppo.kl_target, recipe.ppo.kl_horizon)
    t.score_stats = ops.RunningMoments()
    t.args = SimpleNamespace(world_size=1, seed=0, process_index=0, per_device_train_batch_size=2, device="cpu")
    t.state, t.prefetch, t.agent, t.local_minibatch = SimpleNamespace(global_step=0), None, None, 2
    t.accelerator = SimpleNamespace(gather=lambda x: x, reduce=lambda x, reduction: x)
    t.rollout_batch = lambda iteration: batch
    t.forward = stand_in_forward
    t.scored = lambda b: SimpleNamespace(completions=[f"answer {r['prompt']}" for r in b.rows])
    t.rewards = StandInRewards([score for _, (_, _, _, score) in rows])
    t.engine_correction = lambda *a: None
    t.add_metrics = logged.update
    t.write_samples = lambda iteration, records: samples.extend(records)
    t.conversation = lambda b, i: {}
    return t, batch, logged, samples


def test_failed_rollouts_enter_no_statistic_and_are_counted():
    everything = list(enumerate(ROWS))
    full, full_batch, full_metrics, samples = trainer(everything)
    steps = full.make_experience(0)
    alone, alone_batch, alone_metrics, _ = trainer([everything[b] for b in GOOD])
    alone.make_experience(0)
    assert full_metrics["trained_response_fraction"] == pytest.approx(len(GOOD) / len(ROWS))
    assert alone_metrics["trained_response_fraction"] == 1.0
    for key in ("score_mean", "score_std", "kl", "non_score_reward", "reward_mean", "response_length",
                "truncated_fraction", "entropy", "explained_variance"):
        assert full_metrics[key] == pytest.approx(alone_metrics[key], rel=1e-6, abs=1e-7), key
    # the raw scores' mean is that of the good rows (the failed rows' placeholder 0 is not in it)
    assert full_metrics["score_mean"] == pytest.approx(sum(ROWS[b][3] for b in GOOD) / len(GOOD))
    assert full_metrics["response_length"] == pytest.approx(sum(len(ROWS[b][0]) for b in GOOD) / len(GOOD))
    # the adaptive KL controller followed the good rows' KL, counted as len(GOOD) rollouts; the running score
    # moments (normalize_scores, missing_eos_penalty applied) saw the good rows only
    assert full.kl_ctl.value == pytest.approx(alone.kl_ctl.value) and full.kl_ctl.value != 0.2
    assert full.score_stats.state_dict() == pytest.approx(alone.score_stats.state_dict())
    assert full.score_stats.count == len(GOOD)
    # a failed rollout trains nothing; samples show no score for it
    assert full_batch.loss_mask[[b for b in range(len(ROWS)) if b not in GOOD]].sum() == 0
    assert [s["score"] is None for s in samples] == [b not in GOOD for b in range(len(samples))]
    # every row is in the minibatches (its loss mask says what trains), named by its prompt row's index
    assert sorted(int(i) for step in steps[:len(ROWS) // 2] for micro in step for i in micro[ROW_KEY]) == \
        list(range(len(ROWS)))


def test_a_batch_in_which_nothing_trains_logs_no_mean_and_leaves_the_controller():
    failed = [(b, (ids, finish, "down", score)) for b, (ids, finish, _, score) in enumerate(ROWS)]
    t, _, metrics, _ = trainer(failed)
    t.make_experience(0)
    assert metrics == {"kl_coef": 0.2, "trained_response_fraction": 0.0}
    assert t.kl_ctl.value == 0.2 and t.score_stats.count == 0
