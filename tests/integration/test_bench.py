"""scripts/bench.py --tiny: the side-by-side benchmark runs end to end (same code path as --cpu and --gpu)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_tiny_runs_both_trainers_on_the_same_work(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "--tiny", "--work", str(tmp_path),
                           "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["cases"]) == {"sft", "dpo"}
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
