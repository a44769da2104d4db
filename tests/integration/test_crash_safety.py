"""Crash safety through the CLI on a tiny random Llama: kill -9 at chosen points (inside a checkpoint save too), SIGTERM
during DPO, a full disk during a save, a torn metrics line, a failed set-up attempt.

Every interrupted run is continued by the SAME command (``train.resume_from: auto`` is the default) and must give
exactly the per-step loss / learning rate of an uninterrupted run with the same seed.
"""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from llmtune.commands.cli import main
from llmtune.core import checkpoint as ck
from llmtune.core.callbacks import read_metrics
from llmtune.models.tiny import save_tiny_model

REPO = Path(__file__).resolve().parents[2]
HOOK = Path(__file__).resolve().parent / "crash_hook"
QA = [("What is 2 + 3?", "It is 5.", "It is 7."), ("Say hello.", "Hello! How are you today?", "No."),
      ("What is 12 * 7?", "12 * 7 = 84. #### 84", "12 * 7 = 74."), ("Name a color.", "The sea is blue.", "Dog.")]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    model = save_tiny_model(root / "model")
    chats = [{"messages": [{"role": "user", "content": f"{q} ({i})"}, {"role": "assistant", "content": a}]}
             for i in range(6) for q, a, _ in QA]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    pairs = [{"prompt": f"{q} ({i})", "chosen": c, "rejected": r} for i in range(6) for q, c, r in QA]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    train = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 6, "learning_rate": 1e-2, "save_steps": 2,
             "warmup_steps": 1, "save_total_limit": 2}
    common = {"model": {"name_or_path": str(model)}, "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
              "train": train}
    (root / "sft.yaml").write_text(yaml.safe_dump({"stage": "sft", **common, "data": {
        "datasets": [{"path": str(root / "sft.jsonl")}], "max_length": 64}}))
    (root / "dpo.yaml").write_text(yaml.safe_dump({"stage": "dpo", **common, "data": {
        "datasets": [{"path": str(root / "pairs.jsonl"), "format": "preference"}], "max_length": 64}}))
    return root


def steps(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, loss, learning_rate) of every training record."""
    return [(r["step"], r["loss"], r["learning_rate"]) for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


class Reference(dict):
    """Per-step (step, loss, lr) of an uninterrupted in-process run of each recipe, run when first asked for."""

    def __init__(self, ws):
        super().__init__()
        self.ws = ws

    def __missing__(self, stage):
        assert main([stage, str(self.ws / f"{stage}.yaml"), f"output.dir={self.ws / ('ref_' + stage)}"]) == 0
        self[stage] = steps(self.ws / f"ref_{stage}")
        assert [s for s, _, _ in self[stage]] == [1, 2, 3, 4, 5, 6]
        return self[stage]


@pytest.fixture(scope="module")
def reference(ws):
    return Reference(ws)


def start(ws: Path, stage: str, out: Path, pause: str | None) -> tuple[subprocess.Popen, Path]:
    """``python -m llmtune STAGE RECIPE output.dir=OUT`` in a subprocess, paused where ``pause`` says."""
    flag = out.parent / f"{out.name}.{time.monotonic_ns()}.flag"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HOOK), str(REPO)]), HF_HUB_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("LLMTUNE_TEST_PAUSE", None)
    if pause:  # WHERE:STEP[:SECONDS] -> WHERE:STEP:FLAG[:SECONDS] (crash_hook/sitecustomize.py)
        where, step, *seconds = pause.split(":")
        env["LLMTUNE_TEST_PAUSE"] = ":".join([where, step, str(flag), *seconds])
    proc = subprocess.Popen([sys.executable, "-m", "llmtune", stage, str(ws / f"{stage}.yaml"), f"output.dir={out}"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, flag


def wait_for(flag: Path, proc: subprocess.Popen, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not flag.exists():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (code {proc.returncode}) before the pause:\n{proc.stderr.read()}")
        assert time.monotonic() < end, "the run never reached the pause"
        time.sleep(0.05)


def kill_at(ws: Path, out: Path, pause: str) -> None:
    proc, flag = start(ws, "sft", out, pause)
    wait_for(flag, proc)
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()


@pytest.mark.slow
def test_kill_9_anywhere_then_the_same_command_continues_exactly(ws, reference, monkeypatch):
    out = ws / "killed"
    # 1. SIGKILL inside the save of checkpoint-2, after its adapter and optimizer files (old code: a partial
    #    checkpoint-2 that resume_from=latest picked and failed on)
    kill_at(ws, out, "save:2")
    complete, partial = ck.scan(out / "checkpoints")
    assert complete == [] and [p.name for p, _ in partial if p.parent.name == ck.STAGING] == ["checkpoint-2"]
    assert not (out / "checkpoints" / "checkpoint-2").exists()
    # 2. the same command (nothing complete yet: starts fresh), SIGKILL between checkpoints (in step 3)
    kill_at(ws, out, "step:2")
    assert [p.name for p in ck.scan(out / "checkpoints")[0]] == ["checkpoint-2"]
    # 3. the same command (resumes from checkpoint-2), stopped dead after writing checkpoint-4's marker, before the
    #    rename: simulated in-process by an exception no handler catches (nothing is cleaned up, as with a kill)
    def die(staged, final):
        raise KeyboardInterrupt

    monkeypatch.setattr(ck, "commit", die)
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={out}"]) == 130
    monkeypatch.undo()
    assert [p.name for p in ck.scan(out / "checkpoints")[0]] == ["checkpoint-2"]
    assert (out / "checkpoints" / ck.STAGING / "checkpoint-4" / ck.MARKER).is_file()
    assert not (out / "lineage.json").exists()
    # the same command once more, with no manual step: finishes from checkpoint-2
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={out}"]) == 0
    assert steps(out) == reference["sft"]  # exactly: same loss and learning rate at every step, once each
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in records if "loss" in r) == [1, 2, 3, 4, 5, 6]  # the file itself, no duplicates
    assert [p.name for p in ck.scan(out / "checkpoints")[0]] == ["checkpoint-4", "checkpoint-6"]  # limit 2
    assert not (out / "checkpoints" / ck.STAGING).exists()


@pytest.mark.slow
def test_sigterm_during_dpo_saves_exits_75_and_the_same_command_loses_no_step(ws, reference):
    out = ws / "term"
    proc, flag = start(ws, "dpo", out, "step:2:0.5")  # pause 0.5 s in each micro-batch of step 3, signal lands there
    wait_for(flag, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 75, err
    assert "stopped by SIGTERM after optimizer step 3" in err and "same command" in err and "Traceback" not in err
    assert ck.is_complete(out / "checkpoints" / "checkpoint-3")  # save_steps=2: this one exists only for the signal
    assert [s for s, _, _ in steps(out)] == [1, 2, 3]
    assert main(["dpo", str(ws / "dpo.yaml"), f"output.dir={out}"]) == 0
    assert steps(out) == reference["dpo"]


def test_disk_full_inside_a_save_exits_5_and_keeps_the_previous_checkpoint(ws, reference, monkeypatch, capsys):
    from llmtune.core.trainer import CoreTrainer

    original = CoreTrainer._save_optimizer_and_scheduler

    def full_disk(self, output_dir):
        if self.state.global_step == 4:  # the adapter of checkpoint-4 is already written
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, output_dir)

    monkeypatch.setattr(CoreTrainer, "_save_optimizer_and_scheduler", full_disk)
    out = ws / "full"
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={out}"]) == 5
    err = capsys.readouterr().err
    assert "disk is full" in err and "checkpoint-4" in err and "one checkpoint needs about" in err
    assert "checkpoint-2 is intact" in err and "Traceback" not in err
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["checkpoint-2"]  # its own temp dir is gone
    assert ck.is_complete(out / "checkpoints" / "checkpoint-2")
    monkeypatch.setattr(CoreTrainer, "_save_optimizer_and_scheduler", original)
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={out}"]) == 0  # space freed: the same command continues
    assert steps(out) == reference["sft"]


def test_too_little_free_space_is_refused_before_training(ws, monkeypatch, capsys):
    monkeypatch.setattr(ck, "free_bytes", lambda path: 1000)
    out = ws / "tiny_disk"
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={out}"]) == 5
    err = capsys.readouterr().err
    assert "not enough disk space" in err and "1000 B are free" in err and "optimizer state" in err
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("checkpoints/*"))  # no step was trained


def test_torn_metrics_line_and_resumed_steps_give_one_record_per_step(ws, reference):
    import shutil

    out = ws / "torn"
    expected = reference["sft"]
    shutil.copytree(ws / "ref_sft", out)
    for name in ("lineage.json", "adapter", "checkpoints/checkpoint-6"):  # as if killed after step 5
        shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kept = [r for r in records if r["step"] <= 5 and "train_runtime" not in r]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"step": 6, "lo')  # torn
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={out}"]) == 0  # resumes from checkpoint-4
    assert steps(out) == expected
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(line) for line in lines)  # the torn line is gone and steps 5.. are not doubled
    assert sorted(json.loads(line)["step"] for line in lines if "loss" in json.loads(line)) == [1, 2, 3, 4, 5, 6]
    assert (out / "plots" / "summary.png").is_file() and (out / "plots" / "all_metrics.png").is_file()


def test_a_failed_set_up_does_not_block_its_rerun(ws, capsys):
    out = ws / "bad_data"
    bad = ws / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')  # no assistant turn
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={out}", f"data.datasets.0.path={bad}"]) == 1
    assert (out / "recipe.resolved.yaml").is_file() and not (out / "checkpoints").exists()
    capsys.readouterr()
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={out}", "train.max_steps=2"]) == 0  # fixed: starts fresh
    assert (out / "lineage.json").is_file()
    assert json.loads((out / "data_report.json").read_text())["train_rows"] == 24
    # the finished run is not silently continued or mixed with another recipe
    assert main(["sft", str(ws / "sft.yaml"), f"output.dir={out}", "train.max_steps=2"]) == 1
    assert "already holds a run; it finished" in capsys.readouterr().err


def test_ctrl_c_without_save_steps_writes_a_checkpoint_and_the_same_command_continues(ws, reference, monkeypatch,
                                                                                      capsys):
    from llmtune.core.trainer import CoreTrainer

    original = CoreTrainer.training_step

    def press_ctrl_c(self, *args, **kwargs):
        if self.state.global_step == 2 and not getattr(self, "_pressed", False):
            self._pressed = True
            signal.raise_signal(signal.SIGINT)  # delivered to this (main) thread: the handler sets the stop flag
        return original(self, *args, **kwargs)

    monkeypatch.setattr(CoreTrainer, "training_step", press_ctrl_c)
    out = ws / "ctrl_c"
    args = ["sft", str(ws / "sft.yaml"), f"output.dir={out}", "train.save_steps=null"]
    assert main(args) == 130  # old code: KeyboardInterrupt mid-step, no checkpoint at all without save_steps
    assert "stopped by SIGINT (Ctrl-C) after optimizer step 3" in capsys.readouterr().err
    assert [p.name for p in ck.scan(out / "checkpoints")[0]] == ["checkpoint-3"]
    monkeypatch.setattr(CoreTrainer, "training_step", original)
    assert main(args) == 0
    assert steps(out) == reference["sft"]


def _agree(rank: int, port: int, signals: list[int], result) -> None:
    import torch.distributed as dist
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from llmtune.core.preempt import StopOnSignalCallback, StopRequest

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    args = TrainingArguments(output_dir="/tmp/unused", report_to="none", use_cpu=True)
    request = StopRequest()
    request.signum = signals[rank]
    control, state = TrainerControl(), TrainerState()
    state.global_step = 5
    StopOnSignalCallback(request).on_step_end(args, state, control)
    result[rank] = (control.should_training_stop, control.should_save)
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_agree_to_stop_after_the_same_step_when_only_one_got_the_signal():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = mp.Manager().dict()
    mp.spawn(_agree, args=(port, [0, int(signal.SIGTERM)], result), nprocs=2)
    assert dict(result) == {0: (True, True), 1: (True, True)}  # rank 0 never saw the signal: it saves and stops too
