"""scripts/quickstart_report.py on fabricated pipeline directories: which records are "before"/"after", the
direction of each stage's metric, steps without metrics skipped, the printed table and the exit status."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "quickstart_report.py"
spec = importlib.util.spec_from_file_location("quickstart_report", SCRIPT)
report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(report)


def fake_step(root: Path, name: str, stage: str, records: list[dict]) -> None:
    run = root / name
    run.mkdir(parents=True)
    (run / "recipe.resolved.yaml").write_text(yaml.safe_dump({"stage": stage, "train": {"max_steps": 4}}))
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def fake_pipeline(root: Path) -> Path:
    # SFT: start eval, a mid-run eval, training records carrying a train "loss", the final eval last
    fake_step(root, "sft", "sft", [
        {"step": 0, "eval_loss": 1.50, "eval_runtime": 3.0},
        {"step": 2, "loss": 0.10, "learning_rate": 1e-3},
        {"step": 2, "eval_loss": 1.20},
        {"step": 4, "loss": 0.05},
        {"step": 4, "eval_loss": 1.10},
    ])
    # RM: accuracy went DOWN, margin up
    fake_step(root, "rm", "rm", [
        {"step": 0, "eval_accuracy": 0.60, "eval_margin": 0.00},
        {"step": 4, "accuracy": 0.99, "margin": 3.0},  # training metrics, not held-out: ignored
        {"step": 4, "eval_accuracy": 0.55, "eval_margin": 0.20},
    ])
    # DPO without a start eval (train.eval_at_start: false)
    fake_step(root, "dpo", "dpo", [
        {"step": 4, "eval_rewards/accuracies": 0.70, "eval_rewards/margins": 0.3, "eval_loss": 0.60},
    ])
    # PPO: score up, KL shown but not judged
    fake_step(root, "ppo", "ppo", [
        {"step": 0, "eval_score": 0.25, "eval_kl": 0.0},
        {"step": 4, "score_mean": 0.9},
        {"step": 4, "eval_score": 0.40, "eval_kl": 1.5},
    ])
    (root / "pairs").mkdir()  # the pairs step and the export have no metrics.jsonl
    (root / "pairs" / "pairs.jsonl").write_text("{}\n")
    (root / "merged").mkdir()
    return root


def test_rows_before_after_and_direction(tmp_path):
    rows = report.report_rows(fake_pipeline(tmp_path / "p"))
    got = {(r["step"], r["metric"]): (r["before"], r["after"], r["verdict"]) for r in rows}
    assert [r["step"] for r in rows] == ["sft", "rm", "rm", "dpo", "dpo", "dpo", "ppo", "ppo"]  # stage order
    assert got[("sft", "eval_loss")] == (1.50, 1.10, "yes")  # step-0 record and the LAST eval, not the mid-run one
    assert got[("rm", "eval_accuracy")] == (0.60, 0.55, "NO")  # higher is better: a drop is flagged
    assert got[("rm", "eval_margin")] == (0.00, 0.20, "yes")
    assert got[("dpo", "eval_rewards/accuracies")][:2] == (None, 0.70)
    assert "eval_at_start" in got[("dpo", "eval_rewards/accuracies")][2]
    assert got[("ppo", "eval_score")] == (0.25, 0.40, "yes")
    assert got[("ppo", "eval_kl")] == (0.0, 1.5, "-")
    assert ("ppo", "eval_truncated_fraction") not in got  # absent metrics make no row


def test_lower_is_better_and_interrupted_runs():
    assert report.verdict(1.0, 1.2, report.LOWER) == "NO"
    assert report.verdict(1.0, 1.0, report.HIGHER) == "NO"  # no movement is not learning
    records = [{"step": 0, "eval_loss": 2.0}]  # stopped before the final eval
    assert report.before_after(records, "eval_loss") == (2.0, None)
    assert report.verdict(2.0, None, report.LOWER) == "no eval after training"
    assert report.before_after([{"step": 3, "eval_loss": float("nan")}], "eval_loss") == (None, None)


def test_pair_accuracy_must_beat_chance(tmp_path):
    """DPO's step-0 accuracy is 0 (all ties): a rise to 0.4 is not learning."""
    fake_step(tmp_path, "dpo", "dpo", [
        {"step": 0, "eval_rewards/accuracies": 0.0, "eval_rewards/margins": 0.0, "eval_loss": 0.6931},
        {"step": 8, "eval_rewards/accuracies": 0.40, "eval_rewards/margins": -0.01, "eval_loss": 0.70},
    ])
    got = {r["metric"]: r["verdict"] for r in report.report_rows(tmp_path)}
    assert got == {"eval_rewards/accuracies": "NO (not above chance 0.5)", "eval_rewards/margins": "NO",
                   "eval_loss": "NO"}


def test_cli_prints_the_table_and_fails_on_an_empty_dir(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), str(fake_pipeline(tmp_path / "p"))],
                          capture_output=True, text=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin",
                                                                 "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    assert "1.5" in proc.stdout and "1.1" in proc.stdout and "ln 2 = 0.6931" in proc.stdout
    assert "NO" in proc.stdout and "pairs" not in proc.stdout
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "empty")], capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and "run the pipeline first" in proc.stderr and "Traceback" not in proc.stderr


def test_the_report_reads_each_stages_own_declaration():
    from llmtune.stages import STAGES

    for name in STAGES:
        stage = STAGES[name]
        assert stage.key_metric == stage.held_out_metrics[0].name, name  # one declaration, key metric first
        assert all(m.better in (report.HIGHER, report.LOWER, None) for m in stage.held_out_metrics), name
    assert STAGES["rm"].held_out_metrics[0].chance == 0.5 and STAGES["dpo"].key_metric == "eval_rewards/accuracies"
