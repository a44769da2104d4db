"""scripts/bench.py --tiny: the side-by-side benchmark runs end to end (same code path as --cpu and --gpu)."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_tiny_runs_both_trainers_on_the_same_work(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--tiny", "--work", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {"sft", "dpo", "grpo"}
    grpo = report["cases"].pop("grpo")
    g = grpo["case"]["grpo"]
    # every iteration: the same prompts on both sides, each completion exactly max_new_tokens long
    assert grpo["work"]["prompts_per_step"] == [g["rollout_batch_size"]] * grpo["case"]["steps"]
    tokens = g["rollout_batch_size"] * grpo["case"]["rollout"]["max_new_tokens"]
    assert grpo["work"]["completion_tokens_per_step"] == [tokens] * 3
    for side in ("llmtune", "trl"):
        run = grpo["runs"][side][0]
        assert run["s_per_iteration"] > run["generation_s"] > 0 and run["peak_mem_gb"] > 0
    assert "| GRPO | s per iteration |" in proc.stdout
    for name, case in report["cases"].items():
        work = case["work"]
        assert work["trained_tokens_per_step"] and all(n > 0 for n in work["trained_tokens_per_step"])
        # the same data, model and seed: the step-1 losses agree (the work check of the script)
        assert work["step1_loss"]["llmtune"][0] == pytest.approx(work["step1_loss"]["trl"][0], rel=2e-3)
        for side in ("llmtune", "trl"):
            run = case["runs"][side][0]
            assert run["trained_tokens_per_s"] > 0 and run["peak_mem_gb"] > 0
        assert len(case["ratios"]["speed"]) == 1
    assert "| sft | trained tokens per s |" in proc.stdout
    assert "same work" in proc.stdout


def test_bench_fails_when_the_work_differs():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    case = bench.Case("sft", "sft", "m", {}, 1, 1, 2, 0)
    a = {"steps": [{"trained_tokens": 10, "rows": 1}], "losses": [1.0]}
    assert bench.check_same_work(a, a, case) == []
    b = {"steps": [{"trained_tokens": 11, "rows": 1}], "losses": [1.0]}
    assert "differ" in bench.check_same_work(a, b, case)[0]
    c = {"steps": [{"trained_tokens": 10, "rows": 1}], "losses": [1.1]}
    assert "step-1 loss" in bench.check_same_work(a, c, case)[0]


def test_bench_grpo_fails_when_the_prompts_or_tokens_differ():
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench

    case = bench.grpo_case("m", 2, 8)
    step = {"prompt_hash": "ab", "prompts": 16, "prompt_tokens": 900, "completion_tokens": 128, "time_s": 1.0,
            "generation_s": 0.5}
    a = {"steps": [step, step], "losses": [0.1]}
    assert bench.check_same_work(a, {"steps": [step, step], "losses": [-0.3]}, case) == []  # losses not compared
    for key, value in (("prompt_hash", "cd"), ("prompt_tokens", 901), ("completion_tokens", 127)):
        b = {"steps": [step, {**step, key: value}], "losses": [0.1]}
        assert "differ" in bench.check_same_work(a, b, case)[0]
    summary = bench.summarize({"steps": [step, {**step, "time_s": 3.0}, {**step, "time_s": 5.0}],
                               "peak_mem_gb": 1.0, "wall_s": 9.0}, case, None)
    assert summary["s_per_iteration"] == 4.0 and summary["rest_s"] == 3.5  # steady iterations (after the first)
    assert summary["generation_tokens_per_s"] == 128 / 0.5


@pytest.mark.slow
def test_async_rollouts_bench_tiny_runs_both_modes_on_one_server(tmp_path):
    from llmtune.rl.engines.vllm_client import vllm_python

    if vllm_python() is None:
        pytest.skip("vLLM is not installed (bash scripts/setup.sh)")
    out = tmp_path / "async.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_async.py"), "--tiny", "--reps", "1",
                           "--steps", "4", "--engine-core", "-1", "--trainer-core", "-1", "--work", str(tmp_path),
                           "--shape", "balanced", "--passes", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    sync, asynchronous = report["runs"]["sync"][0], report["runs"]["async"][0]
    assert sync["staleness"] == 0 and asynchronous["staleness"] == 2  # one iteration ahead = its 2 optimizer steps
    assert len(sync["iteration_s"]) == len(asynchronous["iteration_s"]) == 3  # iterations 0-2 (the 4th: the end)
    assert sync["staleness_max"] == [] and max(asynchronous["staleness_max"]) == 2.0
    assert len(sync["reward_mean"]) == len(asynchronous["reward_mean"]) == 4
    assert report["speedup"]["pairs"] == [sync["s_per_iteration"] / asynchronous["s_per_iteration"]]
    assert "GRPO s/iteration | sync" in proc.stdout
    # the ideal from the synchronous run: S = its sampling, T = the rest of each iteration (iterations 1-2)
    S = statistics.median(sync["sample_s"][1:3])
    T = statistics.median([i - s for i, s in zip(sync["iteration_s"][1:], sync["sample_s"][1:3])])
    assert (report["S"], report["T"]) == pytest.approx((S, T))
    assert report["ideal_speedup"] == pytest.approx((S + T) / max(S, T)) and 1 <= report["ideal_speedup"] <= 2
    assert report["share_of_ideal"] == pytest.approx(report["speedup"]["median"] / report["ideal_speedup"])
    assert yaml.safe_load((tmp_path / "grpo_async.yaml").read_text())["grpo"]["num_iterations"] == 2  # balanced


@pytest.mark.slow
def test_agent_bench_tiny_runs_both_schedules(tmp_path):
    """scripts/bench_agent.py --tiny: both schedules do the same rollouts (4 turns each, 3 tool calls), and the
    report holds the times, the ideal and the share (behaviour, not speed: the numbers are the docs')."""
    out = tmp_path / "agent.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_agent.py"), "--tiny", "--reps", "1",
                           "--batch", "4", "--latency", "0.05", "--out", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())["results"]
    assert set(report) == {"fixed", "exponential"}
    for r in report.values():
        assert len(r["runs"]["lockstep"]) == len(r["runs"]["overlap"]) == 1
        assert 0 < r["ideal_s"] and 0 < r["share"] and r["engine_calls"] >= 4
