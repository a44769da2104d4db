"""The rewards of a rollout batch in one typed result (llmtune.rewards.shaping): the shaping steps in their order,
against hand values; which rows train and why not (one mask); the agent shaping (a soft penalty for a rollout cut by
the budget or the turn cap, a per-call cost, a share of well-formed calls, per-turn rewards placed at each turn's last
sampled token for PPO and summed for GRPO). Each test names the naive implementation it would catch."""

import math
from types import SimpleNamespace

import pytest
import torch

from llmtune.config import load_recipe
from llmtune.rewards.shaping import (SHAPING_STEPS, TERM_METRICS, Rewards, Shaping, Skip, overlong_penalty,
                                     reward_metrics, shape, shaping_from_recipe)
from llmtune.rewards.sources import RESERVED_NAMES
from llmtune.rl.rollouts import Ranks
from llmtune.rl.types import ERROR, LENGTH, STOP, TURNS, Outcome, RolloutBatch, Trajectory

NAN = math.nan


def trajectory(n: int, finish: str = STOP, mask: list[int] | None = None, **outcome) -> Trajectory:
    """A rollout of ``n`` completion tokens (all sampled unless ``mask``), with an outcome."""
    mask = [1] * n if mask is None else mask
    return Trajectory({"prompt": "q"}, [1, 2], list(range(3, 3 + n)), mask, None, 0, finish,
                      outcome=Outcome(**outcome))


def scored(trajectories, sources, shaping=Shaping(10), stale=None):
    batch = RolloutBatch.from_trajectories(trajectories, pad_id=0)
    total = torch.tensor(sources, dtype=torch.float32)
    return batch, shape(batch, total, {"fn": total.clone()}, shaping, stale)


def test_dapo_overlong_penalty_by_hand():
    # L_max 10, L_cache 4: free up to 6 tokens, then -factor * (|y| - 6) / 4, -factor at 10
    lengths = torch.tensor([1, 6, 7, 9, 10])
    out = overlong_penalty(lengths, max_new_tokens=10, buffer_tokens=4, factor=0.5)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.125, -0.375, -0.5])
    assert overlong_penalty(torch.tensor([12]), 10, 4, 1.0).tolist() == [-1.0]  # never below -factor


def test_every_step_in_its_order_by_hand():
    """sources 1.0 / 0.5 / abstained; missing EOS -0.2; overlong L_max 10, L_cache 4, factor 1; 0.1 per call; 0.3 x
    the share of well-formed calls."""
    shaping = Shaping(10, missing_eos_penalty=-0.2, overlong_buffer_tokens=4, tool_call_cost=0.1,
                      well_formed_call_reward=0.3)
    rows = [trajectory(5, STOP, tool_calls=2, tool_errors={"raised": 1}),  # a tool raised: still well formed
            trajectory(8, LENGTH, tool_calls=2, tool_errors={"malformed": 1}),
            trajectory(3, TURNS, tool_calls=4)]
    _, r = scored(rows, [1.0, 0.5, NAN], shaping)
    assert list(r.terms) == list(SHAPING_STEPS)
    expected = {"missing_eos": [0.0, -0.2, -0.2], "overlong": [0.0, -0.5, -1.0],  # a turn-cap cut: the full penalty
                "tool_cost": [-0.2, -0.2, -0.4], "well_formed_calls": [0.3, 0.15, 0.3]}
    for name, values in expected.items():
        assert r.terms[name].tolist() == pytest.approx(values), name
    assert r.outcome.tolist() == pytest.approx([1.1, 0.5 - 0.2 - 0.5 - 0.2 + 0.15, -0.2 - 1.0 - 0.4 + 0.3])
    assert torch.equal(r.total, r.outcome)  # no per-turn rewards
    # the task reward is the sources alone: no shaping term in it (what eval_reward reports)
    assert r.task[:2].tolist() == [1.0, 0.5] and math.isnan(r.task[2])
    assert r.skip.tolist() == [Skip.TRAINS, Skip.TRAINS, Skip.ABSTAINED]


def test_a_rollout_cut_by_the_turn_cap_is_penalised_and_stays_in_the_loss():
    """DAPO's length-only penalty gives a short rollout cut by agent.max_turns nothing; here it gets the full
    penalty, like one cut by the budget, and both train (the soft penalty keeps them in the loss)."""
    shaping = Shaping(100, overlong_buffer_tokens=20, overlong_penalty_factor=1.0)
    batch, r = scored([trajectory(10, TURNS), trajectory(100, LENGTH), trajectory(10, STOP)], [0.0, 0.0, 0.0],
                      shaping)
    assert r.terms["overlong"].tolist() == [-1.0, -1.0, 0.0]
    assert r.trains.tolist() == [True, True, True] and torch.equal(r.loss_mask(batch), batch.loss_mask)
    # under mask_truncated_completions the cut ones leave the loss instead (the hard alternative)
    batch, masked = scored([trajectory(10, TURNS), trajectory(100, LENGTH), trajectory(10, STOP)], [0.0] * 3,
                           Shaping(100, overlong_buffer_tokens=20, mask_truncated=True))
    assert masked.skip.tolist() == [Skip.TRUNCATED, Skip.TRUNCATED, Skip.TRAINS]
    assert masked.loss_mask(batch).sum(1).tolist() == [0, 0, 10]


def test_the_well_formed_reward_is_a_share_so_more_calls_never_earn_more():
    """A per-call reward would pay a rollout that calls three times three times as much."""
    shaping = Shaping(50, well_formed_call_reward=0.2)
    rows = [trajectory(5, tool_calls=1), trajectory(5, tool_calls=3),
            trajectory(5, tool_calls=2, tool_errors={"bad_arguments": 1}),
            trajectory(5, tool_calls=2, tool_errors={"unknown_tool": 1, "over_limit": 1}),  # 1 checked, unknown
            trajectory(5)]
    _, r = scored(rows, [0.0] * 5, shaping)
    assert r.terms["well_formed_calls"].tolist() == pytest.approx([0.2, 0.2, 0.1, 0.0, 0.0])


def test_the_tool_cost_is_per_call():
    _, r = scored([trajectory(5, tool_calls=0), trajectory(5, tool_calls=3)], [1.0, 1.0],
                  Shaping(50, tool_call_cost=0.05))
    assert r.terms["tool_cost"].tolist() == pytest.approx([0.0, -0.15])
    assert r.total.tolist() == pytest.approx([1.0, 0.85])


def test_why_a_row_does_not_train_first_reason_first_and_one_mask():
    rows = [trajectory(4, ERROR, infrastructure_error="tool search: down"), trajectory(4, LENGTH),
            trajectory(4, STOP), trajectory(4, LENGTH), trajectory(4, STOP, mask=[1, 0, 0, 1])]
    stale = torch.tensor([True, True, False, False, False])
    batch, r = scored(rows, [1.0, NAN, NAN, 2.0, 3.0], Shaping(10, mask_truncated=True), stale)
    assert r.skip.tolist() == [Skip.INFRASTRUCTURE, Skip.STALE, Skip.ABSTAINED, Skip.TRUNCATED, Skip.TRAINS]
    # the infrastructure's failure abstains whatever the sources said; its reason is kept
    assert math.isnan(r.sources[0]) and math.isnan(r.per_source["fn"][0]) and r.failures[0] == "tool search: down"
    assert r.abstained.tolist() == [True, True, True, False, False]
    mask = r.loss_mask(batch)
    assert mask.tolist() == [[0] * 4, [0] * 4, [0] * 4, [0] * 4, [1, 0, 0, 1]]
    r.exclude(torch.tensor([True, False, False, False, True]), Skip.NO_SIGNAL)  # GRPO's dynamic sampling
    assert r.skip.tolist() == [Skip.INFRASTRUCTURE, Skip.STALE, Skip.ABSTAINED, Skip.TRUNCATED, Skip.NO_SIGNAL]
    assert r.loss_mask(batch).sum() == 0


def test_turn_rewards_grpo_sums_them_ppo_places_each_at_its_turns_last_sampled_token():
    """Three turns (sampled 0-1, tool 2-3, sampled 4-6, tool 7, sampled 8-9), turn rewards 0.5, -0.25, 0."""
    mask = [1, 1, 0, 0, 1, 1, 1, 0, 1, 1]
    t = trajectory(10, STOP, mask=mask, turn_rewards=[0.5, -0.25, 0.0])
    assert t.turn_ends == [1, 6, 9]
    batch, r = scored([t, trajectory(3)], [1.0, 2.0], Shaping(20, missing_eos_penalty=-1.0))
    assert r.turn_return.tolist() == [0.25, 0.0]
    assert r.total.tolist() == [1.25, 2.0] and r.outcome.tolist() == [1.0, 2.0]  # GRPO: the return is added
    assert r.task.tolist() == [1.25, 2.0]  # per-turn rewards are the environment's task signal, not shaping
    placed = r.token_rewards(batch)
    assert placed[0].tolist() == [0, 0.5, 0, 0, 0, 0, -0.25, 0, 0, 0] and placed[1].sum() == 0
    _, plain = scored([trajectory(3)], [2.0])
    assert plain.token_rewards(RolloutBatch.from_trajectories([trajectory(3)], 0)) is None


def test_ppo_advantages_credit_each_turn_with_its_own_reward_by_hand():
    """PPO with gamma = lam = 1, kl_coef 0, zero values, no whitening: the advantage of a sampled token is the sum of
    the rewards at and after it: the turn rewards where their turns end, the score at the last sampled token. All of
    it at the last token (a naive placement) would give every token the same advantage."""
    from llmtune.stages.ppo.trainer import PPO

    recipe = load_recipe(raw={"stage": "ppo", "reward": {"function": "llmtune.rewards:gsm8k_reward"},
                              "ppo": {"rollout_batch_size": 1, "kl_coef": 0.0, "gamma": 1.0, "lam": 1.0,
                                      "whiten_advantages": False, "ppo_epochs": 1},
                              "train": {"max_steps": 1, "global_batch_size": 1}})
    mask = [1, 1, 0, 0, 1, 1, 1, 0, 1, 1]
    t = trajectory(10, STOP, mask=mask, turn_rewards=[0.5, -0.25, 0.0])
    batch, rewards = scored([t], [2.0], shaping_from_recipe(recipe))

    def forward(batch, mask=None, **_):
        zeros = torch.zeros(batch.completion_ids.shape)
        return SimpleNamespace(logps=zeros, ref_logps=zeros, values=zeros, entropy=zeros)

    loop = SimpleNamespace(forward=forward, ranks=Ranks(), log_metrics=lambda m: None, step=lambda: 0,
                           rewards=Rewards(None, shaping_from_recipe(recipe), None),
                           write_samples=lambda i, r: None, engine_correction=lambda *a: None)
    experience, _ = PPO(recipe, [], 0, 0, 1).experience(loop, 0, batch, rewards)
    # rewards by token: 0.5 at 1, -0.25 at 6, the score 2.0 at 9; tool tokens (2, 3, 7) are no actions: 0
    expected = [2.25, 2.25, 0, 0, 1.75, 1.75, 1.75, 0, 2.0, 2.0]
    assert experience["advantages"][0].tolist() == pytest.approx(expected)
    assert experience["returns"][0].tolist() == pytest.approx(expected)


def test_reward_metrics_show_the_task_reward_alone():
    shaping = Shaping(10, missing_eos_penalty=-1.0, tool_call_cost=0.5, well_formed_call_reward=0.25)
    rows = [trajectory(4, STOP, tool_calls=1), trajectory(4, LENGTH, tool_calls=2, turn_rewards=[0.5]),
            trajectory(4, ERROR, infrastructure_error="down")]
    _, r = scored(rows, [1.0, 0.0, 5.0], shaping)
    m = reward_metrics(r)
    assert m["rewards/task_mean"] == pytest.approx((1.0 + 0.5) / 2)  # the failed rollout has none
    assert m["rewards/missing_eos_penalty_mean"] == pytest.approx(-2 / 3)
    assert m["rewards/tool_cost_mean"] == pytest.approx(-1.5 / 3)
    assert m["rewards/well_formed_calls_mean"] == pytest.approx(0.5 / 3)
    assert m["rewards/turns_mean"] == pytest.approx(0.5 / 3)
    assert "rewards/overlong_penalty_mean" not in m  # a step that is off is not logged
    assert {f"{v}" for v in TERM_METRICS.values()} | {"task", "turns"} <= RESERVED_NAMES


def test_the_overlong_penalty_on_rollouts_that_finished_is_measured_and_warned_once(caplog):
    """A budget too tight for a task's normal answers: the penalty hits rollouts that ended on their own (a naive
    metric over every row, or over the cut ones, reads 2/4 or 1/1 here, not 2/3)."""
    shaping = Shaping(10, overlong_buffer_tokens=4)  # free up to 6 tokens
    rows = [trajectory(5, STOP), trajectory(7, STOP), trajectory(9, STOP), trajectory(10, LENGTH)]
    batch, r = scored(rows, [1.0, 1.0, 0.0, 0.0], shaping)
    assert r.ended.tolist() == [True, True, True, False]
    assert reward_metrics(r)["rewards/overlong_on_finished"] == pytest.approx(2 / 3)
    rewards = Rewards(None, shaping, None)
    with caplog.at_level("WARNING", logger="llmtune"):
        rewards.metrics(r, step=3)
        rewards.metrics(r, step=5)
    warned = [m for m in caplog.messages if "overlong penalty hit 67%" in m]
    assert len(warned) == 1 and "= 6 tokens" in warned[0] and "step 3" in warned[0]
    # the metric survives GRPO's resampling merge (rows picked from both batches)
    r.completions = list("abcd")
    merged = r.merge(r, torch.tensor([3, 7, 0, 6]))
    assert merged.ended.tolist() == [False, False, True, True]
    # within the budget's free part: no warning, a 0 share
    _, fine = scored([trajectory(5, STOP), trajectory(6, STOP)], [1.0, 0.0], shaping)
    assert reward_metrics(fine)["rewards/overlong_on_finished"] == 0.0
    assert "rewards/overlong_on_finished" not in reward_metrics(scored(rows, [1.0] * 4, Shaping(10))[1])


def test_shaping_from_a_recipe_and_the_agent_defaults():
    base = {"reward": {"function": "llmtune.rewards:gsm8k_reward"}, "train": {"max_steps": 4}}
    single = load_recipe(raw={"stage": "grpo", **base})
    assert shaping_from_recipe(single) == Shaping(128)  # single turn: nothing on by default
    agent = load_recipe(raw={"stage": "grpo", **base, "agent": {"tools": ["llmtune.tools:calculator"],
                                                                "tool_call_cost": 0.01}})
    # with agent: one budget for the whole rollout, a tool-result cap inside it, DAPO's soft penalty on
    s = shaping_from_recipe(agent)
    assert (agent.rollout.max_new_tokens, agent.agent.max_tool_result_tokens) == (512, 128)
    assert s == Shaping(512, overlong_buffer_tokens=102, tool_call_cost=0.01)
    ppo = load_recipe(raw={"stage": "ppo", **base, "rollout": {"max_new_tokens": 200},
                           "agent": {"tools": ["llmtune.tools:calculator"]}, "ppo": {"overlong_buffer_tokens": 0}})
    assert shaping_from_recipe(ppo) == Shaping(200, overlong_buffer_tokens=0)
    assert ppo.agent.max_tool_result_tokens == 50
