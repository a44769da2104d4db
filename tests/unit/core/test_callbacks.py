"""loss.png: one panel per stage metric (train curve + eval points), what practitioners look at per stage."""

import json

import pytest

from llmtune.core.callbacks import metric_panels, plot_losses


def records(stage):
    train = {"sft": {}, "rm": {"accuracy": 0.5, "margin": 0.1, "ties": 0.0},
             "dpo": {"rewards/accuracies": 0.5, "rewards/margins": 0.01, "logps/chosen": -20.0},
             "ppo": {"score_mean": 0.1, "kl": 0.2, "response_length": 30.0, "policy_loss": 0.01}}[stage]
    rows = [{"step": 0, "eval_loss": 0.7, "eval_pairs": 4, "eval_runtime": 0.3,
             **{f"eval_{k}": v for k, v in train.items() if stage != "ppo"},
             **({"eval_score": 0.0, "eval_kl": 0.0, "eval_prompts": 8} if stage == "ppo" else {})}]
    for step in (1, 2):
        rows.append({"step": step, "epoch": 0.5 * step, "loss": 0.7 - step / 10, "learning_rate": 1e-4,
                     "grad_norm": 1.0, "trained_pairs": 4 * step, "tokens_per_s": 100.0, "peak_mem_gb": 1.0,
                     **{k: v * step for k, v in train.items()}})
    rows.append({"step": 2, "train_runtime": 3.0, "train_loss": 0.6, "total_flos": 1.0})
    return rows


@pytest.mark.parametrize(("stage", "expected"), [
    ("sft", ["loss", "learning_rate", "grad_norm"]),
    ("rm", ["loss", "accuracy", "margin", "ties", "learning_rate", "grad_norm"]),
    ("dpo", ["loss", "rewards/accuracies", "rewards/margins", "logps/chosen", "learning_rate", "grad_norm"]),
    ("ppo", ["loss", "score_mean", "kl", "response_length", "policy_loss", "learning_rate", "grad_norm"]),
])
def test_panels_hold_the_stage_metrics_with_their_eval_twins(stage, expected):
    panels = metric_panels(records(stage))
    assert list(panels) == expected  # no step/epoch/throughput/timing/counter panels
    assert panels["loss"]["eval"] == [(0, 0.7)] and [s for s, _ in panels["loss"]["train"]] == [1, 2]
    if stage == "ppo":
        assert panels["score_mean"]["eval"] == [(0, 0.0)] and panels["kl"]["eval"] == [(0, 0.0)]
    if stage == "dpo":
        assert panels["rewards/margins"]["train"] == [(1, 0.01), (2, 0.02)]


def test_plot_writes_one_png_with_a_panel_per_metric(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records("dpo")))
    out = plot_losses(path, tmp_path / "loss.png", title="llmtune dpo: runs/dpo")
    assert out.is_file() and out.stat().st_size > 10_000
    assert plot_losses(tmp_path / "none.jsonl", tmp_path / "x.png") is None
