"""plots/: the stage's summary figure (Stage.plot_metrics, with eval twins) and the full figure without constant
series (llmtune.core.plots), on metrics.jsonl records with the keys each stage logs."""

import json
import math

import pytest
from PIL import Image

from llmtune.core.plots import (
    agent_panels,
    is_constant,
    metric_panels,
    panel_figure,
    plot_run,
    summary_panels,
    varying_panels,
)
from llmtune.stages.dpo import DPOStage
from llmtune.stages.grpo import GRPOStage
from llmtune.stages.kto import KTOStage
from llmtune.stages.orpo import ORPOStage
from llmtune.stages.ppo import PPOStage
from llmtune.stages.rm import RMStage
from llmtune.stages.sft import SFTStage
from llmtune.stages.simpo import SimPOStage

PREFS = {"rewards/accuracies": 0.5, "rewards/margins": 0.01, "rewards/chosen": 0.02, "rewards/rejected": 0.01,
         "logps/chosen": -20.0, "logps/rejected": -25.0}
# training metrics each stage logs (names as in its loss()/rollout metrics), eval metrics (without eval_)
TRAIN = {
    "sft": {},
    "rm": {"accuracy": 0.5, "margin": 0.1, "chosen": 0.2, "rejected": 0.1},
    "dpo": PREFS, "orpo": {**PREFS, "nll_loss": 2.0, "log_odds_ratio": -0.7}, "simpo": PREFS,
    "kto": {k: v for k, v in PREFS.items() if k != "rewards/accuracies"} | {"kl": 0.3},  # accuracy: eval only
    "ppo": {"score_mean": 0.1, "score_std": 0.3, "kl": 0.2, "response_length": 30.0, "truncated_fraction": 0.5,
            "clipfrac": 0.1, "value_loss": 5.0, "policy_loss": 0.01, "entropy": 5.9},
    "grpo": {"reward_mean": 0.1, "reward_std": 0.2, "rewards/gsm8k_reward_mean": 0.1, "completion_length": 32.0,
             "truncated_fraction": 0.5, "clip_fraction_low": 0.01, "clip_fraction_high": 0.02, "kl": 0.001,
             "entropy": 0.9, "policy_loss": 0.01},
}
EVAL = {
    "sft": {"loss": 2.0, "ppl": 7.4}, "rm": {"loss": 0.7, "accuracy": 0.5, "margin": 0.1, "chosen": 0.2,
                                             "rejected": 0.1},
    "dpo": {"loss": 0.69, **PREFS}, "orpo": {"loss": 2.7, **PREFS}, "simpo": {"loss": 0.69, **PREFS},
    "kto": {"loss": 0.5, **PREFS, "kl": 0.3},
    "ppo": {"score": 0.0, "score_std": 0.0, "kl": 0.4, "response_length": 20.0, "truncated_fraction": 0.5},
    "grpo": {"reward": 0.0, "reward_std": 0.1, "kl": 0.5, "completion_length": 30.0, "truncated_fraction": 0.7},
}
# logged by every stage but constant in these runs: no curve in the full figure
CONSTANT = {"nonfinite_steps": 0, "kl_coef": 0.05, "rollout/is_clipped_fraction": 0.0, "ties": 0.0}
BOOKKEEPING = {"epoch", "step", "trained_pairs", "tokens_per_s", "peak_mem_gb", "eval_pairs", "eval_prompts",
               "eval_runtime", "train_runtime", "train_loss", "total_flos", "train_samples_per_second"}


def records(stage, steps=4, eval_steps=(0, 4)):
    """metrics.jsonl of a run: eval before training and at the end, one training record per step, the
    end-of-training summary; every stage metric varies over steps."""
    rows = []
    for step in range(steps + 1):
        if step in eval_steps:
            rows.append({"step": step, "epoch": step / steps, "eval_pairs": 8, "eval_prompts": 8.0,
                         "eval_runtime": 0.3, **{f"eval_{k}": v + step for k, v in EVAL[stage].items()}})
        if step:
            rows.append({"step": step, "epoch": step / steps, "loss": 1 / step,
                         "learning_rate": 1e-4 * math.cos(step / steps), "grad_norm": 1.0 + step % 2,
                         "trained_pairs": 4 * step, "tokens_per_s": 100.0 + step, "peak_mem_gb": 1.0 + step,
                         **CONSTANT, **{k: v * step for k, v in TRAIN[stage].items()}})
    rows.append({"step": steps, "epoch": 1.0, "train_runtime": 3.0, "train_samples_per_second": 2.0,
                 "train_loss": 0.6, "total_flos": 1.0, "nonfinite_steps": 0})
    return rows


PREF_SUMMARY = ["loss", "rewards/accuracies", "rewards/margins", "rewards/chosen, rewards/rejected"]


@pytest.mark.parametrize(("stage", "expected"), [
    (SFTStage, ["loss"]),
    (RMStage, ["loss", "accuracy", "margin"]),
    (DPOStage, PREF_SUMMARY), (ORPOStage, PREF_SUMMARY), (SimPOStage, PREF_SUMMARY), (KTOStage, PREF_SUMMARY),
    (PPOStage, ["score_mean", "kl", "response_length", "clipfrac", "value_loss"]),
    (GRPOStage, ["reward_mean", "kl", "completion_length", "clip_fraction_low, clip_fraction_high",
                 "truncated_fraction"]),
])
def test_summary_holds_the_stage_s_chosen_series_with_their_eval_twins(stage, expected):
    panels = summary_panels(metric_panels(records(stage.name)), stage.plot_metrics)
    assert list(panels) == expected  # no constants, bookkeeping, optimiser or secondary metrics
    first = panels[expected[0]]
    if stage.name in ("ppo", "grpo"):  # the greedy eval's eval_score / eval_reward join score_mean / reward_mean
        assert first["eval"] == [(0, 0.0), (4, 4.0)]
        assert first["train"] == [(s, pytest.approx(0.1 * s)) for s in (1, 2, 3, 4)]
    else:
        assert [s for s, _ in first["train"]] == [1, 2, 3, 4] and [s for s, _ in first["eval"]] == [0, 4]
    if stage.name == "kto":  # KTO logs its reward accuracy at eval only
        assert panels["rewards/accuracies"]["train"] == [] and len(panels["rewards/accuracies"]["eval"]) == 2
    if stage.name == "dpo":  # chosen and rejected rewards share a panel, each with its eval twin
        group = panels["rewards/chosen, rewards/rejected"]
        assert list(group) == ["rewards/chosen", "eval_rewards/chosen", "rewards/rejected", "eval_rewards/rejected"]
        assert group["rewards/rejected"] == [(s, pytest.approx(0.01 * s)) for s in (1, 2, 3, 4)]


def test_a_chosen_metric_the_run_did_not_log_is_skipped():
    rows = [{k: v for k, v in r.items() if k not in ("kl", "eval_kl", "clip_fraction_high")} for r in records("grpo")]
    panels = summary_panels(metric_panels(rows), GRPOStage.plot_metrics)  # GRPO with beta 0 logs no KL
    assert list(panels) == ["reward_mean", "completion_length", "clip_fraction_low", "truncated_fraction"]
    assert list(panels["clip_fraction_low"]) == ["clip_fraction_low"]
    assert summary_panels(metric_panels([]), GRPOStage.plot_metrics) == {}


def test_the_summary_keeps_a_flat_chosen_series():
    rows = [{**r, **({"reward_mean": 0.0} if "reward_mean" in r else {})} for r in records("grpo")]
    panels = metric_panels(rows)
    assert "reward_mean" in summary_panels(panels, GRPOStage.plot_metrics)  # a reward stuck at 0 is the news
    assert "reward_mean" in varying_panels(panels)  # its eval points vary
    rows = [{k: v for k, v in r.items() if k != "eval_reward"} for r in rows]
    assert "reward_mean" not in varying_panels(metric_panels(rows))
    assert "reward_mean" in summary_panels(metric_panels(rows), GRPOStage.plot_metrics)


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "kto", "ppo", "grpo"])
def test_full_figure_has_every_varying_series_and_no_constant_or_bookkeeping(stage):
    panels = varying_panels(metric_panels(records(stage)))
    twins = {"score": "score_mean", "reward": "reward_mean"}
    expected = ({"loss", "learning_rate", "grad_norm"} | set(TRAIN[stage])
                | {twins.get(k, k) for k in EVAL[stage]}) - set(CONSTANT)
    assert set(panels) == expected
    names = list(panels)
    assert names[0] == "loss" and names[-2:] == ["learning_rate", "grad_norm"]
    assert not set(panels) & (set(CONSTANT) | BOOKKEEPING)


def test_a_constant_learning_rate_is_left_out_and_one_eval_point_is_kept():
    rows = [{**r, "learning_rate": 1e-4} if "loss" in r else r for r in records("sft", eval_steps=(4,))]
    rows.append({"step": 4, "eval_accuracy": 0.25})  # an eval-only metric, evaluated once
    panels = metric_panels(rows)
    assert is_constant(panels["learning_rate"]) and "learning_rate" not in varying_panels(panels)
    assert not is_constant(panels["accuracy"]) and varying_panels(panels)["accuracy"] == {
        "train": [], "eval": [(4, 0.25)]}
    assert varying_panels(panels)["loss"]["eval"] == [(4, 6.0)]  # the lone eval_loss beside the training curve
    assert is_constant({"train": [(1, math.nan), (2, math.nan)], "eval": []})
    assert not is_constant({"train": [(1, 1.0)], "eval": [(2, 2.0)]})


def test_plot_run_writes_a_small_summary_and_the_full_figure(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records("ppo", steps=40, eval_steps=(0, 20, 40))))
    written = plot_run(path, tmp_path / "plots", PPOStage.plot_metrics, title="llmtune ppo: runs/ppo")
    assert [p.name for p in written] == ["summary.png", "all_metrics.png"]
    with Image.open(written[0]) as summary, Image.open(written[1]) as full:
        summary.load(), full.load()
        assert summary.size == (1080, 565)  # 5 panels: 2 rows of 3 (3.6 x 2.5 in at 100 dpi) + title
        assert full.size == (1440, 815)  # 12 varying series: 3 rows of 4
        assert summary.convert("L").getextrema()[0] < 100  # something dark was drawn
    assert plot_run(tmp_path / "none.jsonl", tmp_path / "none", PPOStage.plot_metrics) == []
    assert not (tmp_path / "none").exists()


def test_a_lone_eval_point_is_a_labelled_marker_and_a_flat_panel_says_constant():
    panels = {"loss": {"train": [(1, 2.0), (2, 1.0), (3, 0.5)], "eval": [(3, 1.234)]},
              "reward_mean": {"train": [(1, 0.0), (2, 0.0)], "eval": []}}
    fig = panel_figure(panels, title="llmtune sft: runs/sft", cols=3)
    loss, flat = fig.axes[:2]
    (train, lone) = loss.get_lines()
    assert lone.get_marker() == "D" and lone.get_markersize() >= 6 and list(lone.get_xydata()[0]) == [3, 1.234]
    assert [t.get_text() for t in loss.texts] == ["1.234"]
    assert len(train.get_xdata()) == 3 and not flat.texts
    assert "constant 0" in flat.get_title() and "constant" not in loss.get_title()
    assert len(fig.axes) == 2  # two panels: one row of two


def agent_records(iterations=6):
    """metrics.jsonl of a multi-turn GRPO run: the agent metrics of each rollout batch on its training record, a
    greedy eval at the start and the end."""
    rows = [{"step": 0, "eval_reward": 0.1, "eval_rewards/gsm8k_reward": 0.1, "eval_rewards/format_reward": 0.5,
             "eval_truncated_fraction": 0.4, "eval_prompts": 8.0}]
    for step in range(1, iterations + 1):
        rows.append({"step": step, "loss": 0.1, "reward_mean": 0.1 * step, "rewards/gsm8k_reward_mean": 0.05 * step,
                     "rewards/format_reward_mean": 0.5, "rewards/abstained": 0.0, "truncated_fraction": 0.5 / step,
                     "agent/tool_calls": 1.0 + step % 2, "agent/turns": 2.0, "agent/tool_error_rate": 0.2 / step,
                     "agent/finish_stop": 1 - 0.5 / step, "agent/finish_length": 0.5 / step,
                     "agent/finish_turns": 0.0, "agent/finish_error": 0.0, "agent/infrastructure_failures": 0.0})
    rows.append({"step": iterations, "eval_reward": 0.6, "eval_rewards/gsm8k_reward": 0.6,
                 "eval_rewards/format_reward": 1.0, "eval_truncated_fraction": 0.0, "eval_prompts": 8.0})
    return rows


def test_agent_panels_show_each_reward_source_calls_and_truncation_of_every_iteration():
    panels = metric_panels(agent_records())
    agent = agent_panels(panels)
    assert list(agent) == ["rewards/gsm8k_reward_mean", "rewards/format_reward_mean", "agent/tool_calls",
                           "truncated_fraction", "agent/finish_* (share of rollouts)", "agent/tool_error_rate",
                           "agent/turns"]
    task = agent["rewards/gsm8k_reward_mean"]  # the task reward alone, with its eval before -> after
    assert task["train"] == [(s, pytest.approx(0.05 * s)) for s in range(1, 7)]
    assert task["eval"] == [(0, 0.1), (6, 0.6)]
    assert [v for _, v in agent["agent/tool_calls"]["train"]] == [2.0, 1.0, 2.0, 1.0, 2.0, 1.0]
    assert agent["truncated_fraction"]["eval"] == [(0, 0.4), (6, 0.0)]
    assert set(agent["agent/finish_* (share of rollouts)"]) == {
        "agent/finish_stop", "agent/finish_length", "agent/finish_turns", "agent/finish_error"}
    # a single-turn run has no agent figure
    assert agent_panels(metric_panels(records("grpo"))) == {}


def test_plot_run_draws_the_agent_figure_for_a_multi_turn_run_only(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in agent_records()))
    written = plot_run(path, tmp_path / "plots", GRPOStage.plot_metrics, title="llmtune grpo: runs/agent")
    assert [p.name for p in written] == ["summary.png", "all_metrics.png", "agent.png"]
    with Image.open(written[2]) as agent:
        assert agent.size == (1080, 815)  # 7 panels: 3 rows of 3 + title
    single = tmp_path / "single.jsonl"
    single.write_text("".join(json.dumps(r) + "\n" for r in records("grpo")))
    assert [p.name for p in plot_run(single, tmp_path / "p2", GRPOStage.plot_metrics)] == ["summary.png",
                                                                                         "all_metrics.png"]
