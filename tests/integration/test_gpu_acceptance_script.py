"""scripts/gpu_acceptance.sh --tiny: the GPU acceptance script's CPU dry run, so the one command prepared for the
H200 cannot rot between GPU runs (SFT + DPO + PPO through the CLI, export verification, reload of the merged model)."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_acceptance_tiny_dry_run_passes(tmp_path):
    out = tmp_path / "acceptance"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_acceptance.sh"), "--tiny", "--only", "dpo,ppo"],
                          cwd=ROOT, env={**os.environ, "OUT": str(out)}, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads((out / "result.json").read_text())
    assert report["passed"] and report["tiny"]
    checks = report["checks"]
    assert sorted(checks) == ["dpo", "ppo", "sft_lora"]  # dpo and ppo continue the sft_lora run, added for them
    for name in ("sft_lora", "dpo"):
        assert checks[name]["loss_decreased"] and checks[name]["losses"][-1] < checks[name]["losses"][0], name
    assert checks["dpo"]["margins"][-1] > checks["dpo"]["margins"][0]
    assert checks["ppo"]["trained"] and all(g > 0 for g in checks["ppo"]["grad_norms"])
    for name, check in checks.items():
        assert check["export_passed"] and check["reload_finite"], name
        assert (out / name / "merged" / "verification.json").is_file(), name
