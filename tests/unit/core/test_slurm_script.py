"""scripts/slurm_zero3.sbatch carries the preemption settings docs/troubleshooting.md recommends (issue 32): a signal
llmtune stops on, sent to the tasks (not only the batch shell) before the time limit, and a requeue when the stage
exits 75. The script runs here with stand-ins for srun and scontrol (no SLURM needed)."""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
from pathlib import Path

import pytest

from llmtune.core.preempt import STOP_SIGNALS, exit_code
from llmtune.errors import EXIT_PREEMPTED

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "slurm_zero3.sbatch"
DOC = ROOT / "docs" / "troubleshooting.md"
SIGNAL = re.compile(r"^#SBATCH --signal=(\S+)", re.M)


def directives(text: str) -> set[str]:
    return {line.split("#", 2)[1].strip().split()[1] for line in text.splitlines() if line.startswith("#SBATCH ")}


def test_script_and_troubleshooting_page_ask_for_the_same_signal():
    script, doc = SCRIPT.read_text(), DOC.read_text()
    (spec,) = SIGNAL.findall(script)
    assert SIGNAL.findall(doc) == [spec]  # the page's example is the script's setting
    name, _, seconds = spec.partition("@")
    assert ":" not in name, "B:/R: would signal the batch shell only, not the tasks that train"
    assert getattr(signal, f"SIG{name}") in STOP_SIGNALS and exit_code(getattr(signal, f"SIG{name}")) == 75
    assert int(seconds) >= 120  # one optimizer step plus a checkpoint save
    assert {"--requeue", "--open-mode=append"} <= directives(script) & directives(doc)
    assert "--kill-on-bad-exit=0 --wait=" in script and "--kill-on-bad-exit=0 --wait=" in doc


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.mark.parametrize("stage_exit, requeued", [(EXIT_PREEMPTED, True), (0, False), (1, False)])
def test_script_requeues_exactly_on_exit_75(tmp_path, stage_exit, requeued):
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    bin_dir.mkdir()
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "activate").write_text("")
    log = tmp_path / "calls.log"
    _stub(bin_dir / "srun", f'{{ printf srun; for a in "$@"; do printf " [%s]" "${{a//$\'\\n\'/ }}"; done; echo; }} >> {log}\n'
                            f'exit {stage_exit}\n')  # one line per call, each argument in [...]
    _stub(bin_dir / "scontrol", f'echo "scontrol $*" >> {log}\n[ "$1" = show ] && echo gpu01\nexit 0\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LLMTUNE_VENV": str(venv),
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_NNODES": "2", "SLURM_SUBMIT_DIR": str(ROOT)}
    done = subprocess.run(["bash", str(SCRIPT), "recipes/llama7b_zero3.yaml", "train.max_steps=2"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == stage_exit, done.stderr
    calls = log.read_text().splitlines()
    assert calls[0] == "scontrol show hostnames gpu[01-02]"
    assert calls[1].startswith("srun [--kill-on-bad-exit=0] [--wait=120] [bash] [-c] [exec llmtune ")
    assert calls[1].endswith("[sft] [recipes/llama7b_zero3.yaml] [train.max_steps=2]")
    assert ("scontrol requeue 4242" in calls) == requeued and len(calls) == 2 + requeued
