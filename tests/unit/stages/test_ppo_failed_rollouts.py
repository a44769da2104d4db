"""PPO's experience with rollouts that cannot train (a multi-turn rollout whose environment or tool infrastructure
failed; one beyond rollout.max_staleness): with a stand-in for the model forwards and the reward sources, a batch in
which half the rows failed gives exactly the statistics (scores, running score moments, KL and the adaptive KL
controller, lengths, entropy, truncation, advantages) of the good rows alone, and counts the failed ones."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from llmtune.config import load_recipe
from llmtune.core.guard import ROW_KEY
from llmtune.rewards.shaping import Rewards, shape, shaping_from_recipe
from llmtune.rl.rollouts import Ranks
from llmtune.rl.types import LENGTH, STOP, Outcome, RolloutBatch, Trajectory
from llmtune.stages.ppo.trainer import PPO

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
                       outcome=Outcome(infrastructure_error=error)) for b, (ids, finish, error, _) in rows]


def stand_in_forward(batch, mask=None, **_):
    """Log-probs, values and entropy of each token as functions of the token and its position only (the same in any
    batch), as the model's would be."""
    ids = batch.completion_ids.float()
    pos = torch.arange(ids.shape[1]).float()[None]
    logps = -0.1 * ids - 0.01 * pos
    return SimpleNamespace(logps=logps, ref_logps=logps - 0.03 * (ids % 3), values=0.05 * ids - 0.02 * pos,
                           entropy=0.5 + 0.01 * ids)


def trainer(rows, **ppo):
    """PPO's algorithm, a scored batch of ``rows`` (the sources' scores as given; a failed rollout's are discarded by
    the rewards) and a stand-in loop that records metrics and samples."""
    recipe = load_recipe(raw={"stage": "ppo", "reward": {"function": "llmtune.rewards:gsm8k_reward"},
                              "ppo": {"rollout_batch_size": 6, "kl_coef": 0.2, "kl_target": 0.05, "kl_horizon": 10,
                                      "normalize_scores": True, "missing_eos_penalty": -1.0, **ppo},
                              "train": {"max_steps": 6, "global_batch_size": 2}})
    algo = PPO(recipe, [], seed=0, rank=0, world=1)
    batch = RolloutBatch.from_trajectories(trajectories(rows), pad_id=0)
    scores = torch.tensor([score for _, (_, _, _, score) in rows])
    rewards = shape(batch, scores.clone(), {"gsm8k_reward": scores}, shaping_from_recipe(recipe),
                    completions=[f"answer {r['prompt']}" for r in batch.rows])
    logged, samples = {}, []
    loop = SimpleNamespace(forward=stand_in_forward, ranks=Ranks(), log_metrics=logged.update, step=lambda: 0,
                           rewards=Rewards(None, shaping_from_recipe(recipe), None),
                           write_samples=lambda iteration, records: samples.extend(records),
                           engine_correction=lambda *a: None)

    def make_experience():
        experience, order = algo.experience(loop, 0, batch, rewards)
        return experience, experience.minibatches(algo.passes, 2, 2, torch.Generator().manual_seed(0), order)

    algo.make_experience = make_experience
    return algo, batch, logged, samples


def test_failed_rollouts_enter_no_statistic_and_are_counted():
    everything = list(enumerate(ROWS))
    full, full_batch, full_metrics, samples = trainer(everything)
    experience, steps = full.make_experience()
    alone, alone_batch, alone_metrics, _ = trainer([everything[b] for b in GOOD])
    alone.make_experience()
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
    # a failed rollout trains nothing (the experience's one loss mask is empty on it); samples show no score for it
    failed = [b for b in range(len(ROWS)) if b not in GOOD]
    assert experience["loss_mask"][failed].sum() == 0 and full_batch.loss_mask[failed].sum() > 0
    assert [s["score"] is None for s in samples] == [b not in GOOD for b in range(len(samples))]
    # every row is in the minibatches (its loss mask says what trains), named by its prompt row's index
    assert sorted(int(i) for step in steps[:len(ROWS) // 2] for micro in step for i in micro[ROW_KEY]) == \
        list(range(len(ROWS)))


def test_a_batch_in_which_nothing_trains_logs_no_mean_and_leaves_the_controller():
    failed = [(b, (ids, finish, "down", score)) for b, (ids, finish, _, score) in enumerate(ROWS)]
    t, _, metrics, _ = trainer(failed)
    t.make_experience()
    assert {k: v for k, v in metrics.items() if not k.startswith("rewards/")} == {
        "kl_coef": 0.2, "trained_response_fraction": 0.0}
    assert "rewards/task_mean" not in metrics  # every rollout failed: no task reward to average
    assert t.kl_ctl.value == 0.2 and t.score_stats.count == 0
