"""Learning-rate schedules across a resume: the LR the optimizer applies at each step is the schedule's value.

Expected values are written out from the schedule formulas (step k = the k-th optimizer step, 1-based, runs at
lr(k - 1)), with W warm-up steps and N steps in all:
    warm-up  lr(s) = peak * s / W                                  for s < W
    linear   lr(s) = peak * (N - s) / (N - W)
    cosine   lr(s) = peak * 0.5 * (1 + cos(pi * (s - W) / (N - W)))
    constant lr(s) = peak
"""

import math

import pytest
import torch
from transformers import TrainerCallback

from test_trainer import make_trainer

PEAK = 1e-2


def schedule(kind: str, steps: int, warmup: int) -> list[float]:
    """LR applied at optimizer steps 1..steps of a fresh run."""
    out = []
    for s in range(steps):
        if s < warmup:
            out.append(PEAK * s / warmup)
        elif kind == "linear":
            out.append(PEAK * (steps - s) / (steps - warmup))
        elif kind == "cosine":
            out.append(PEAK * 0.5 * (1 + math.cos(math.pi * (s - warmup) / (steps - warmup))))
        else:
            out.append(PEAK)
    return out


class AppliedLR(TrainerCallback):
    """The LR in the optimizer's param groups right before ``optimizer.step()``: the one that step applies."""

    def __init__(self):
        self.lrs: dict[int, list[float]] = {}

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lrs[state.global_step + 1] = [g["lr"] for g in optimizer.param_groups]


def run(tmp_path, train: dict, resume=None) -> tuple[dict[int, float], dict[int, float]]:
    """Train; return {step: applied LR} (every param group must agree) and {step: logged learning_rate}."""
    trainer = make_trainer(tmp_path, {"learning_rate": PEAK, "save_steps": 5, "save_total_limit": 5, **train},
                           n_rows=2 * train["max_steps"])
    applied = AppliedLR()
    trainer.add_callback(applied)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    for step, lrs in applied.lrs.items():
        assert len(set(lrs)) == 1, (step, lrs)  # decayed and non-decayed groups follow one schedule
    logged = {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}
    return {k: v[0] for k, v in applied.lrs.items()}, logged


WARMUPS = [{}, {"warmup_steps": 3}, {"warmup_ratio": 0.2}]


@pytest.mark.parametrize("kind", ["linear", "cosine", "constant"])
@pytest.mark.parametrize("warmup", WARMUPS, ids=["no_warmup", "warmup_steps", "warmup_ratio"])
def test_resume_with_a_longer_schedule_applies_the_new_schedule_from_the_first_resumed_step(tmp_path, kind, warmup):
    short = {"lr_scheduler": kind, "max_steps": 5, **warmup}
    run(tmp_path / "a", short)
    ckpt = tmp_path / "a" / "checkpoints" / "checkpoint-5"
    applied, logged = run(tmp_path / "b", {**short, "max_steps": 10}, resume=ckpt)
    w = warmup.get("warmup_steps") or math.ceil(warmup.get("warmup_ratio", 0) * 10)
    expected = schedule(kind, 10, w)
    assert sorted(applied) == list(range(6, 11))
    for step in range(6, 11):  # old code: step 6 ran at the finished 5-step schedule's last LR (0 for linear/cosine)
        assert applied[step] == pytest.approx(expected[step - 1], rel=1e-9, abs=1e-15), step
        assert logged[step] == pytest.approx(applied[step], rel=1e-9, abs=1e-15), step  # metrics say what was used


@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_resume_with_the_same_schedule_is_exact(tmp_path, kind):
    train = {"lr_scheduler": kind, "max_steps": 10, "warmup_steps": 2}
    fresh, _ = run(tmp_path / "a", train)
    assert [fresh[k] for k in range(1, 11)] == pytest.approx(schedule(kind, 10, 2), rel=1e-9, abs=1e-15)
    resumed, _ = run(tmp_path / "b", train, resume=tmp_path / "a" / "checkpoints" / "checkpoint-5")
    assert {k: resumed[k] for k in range(6, 11)} == {k: fresh[k] for k in range(6, 11)}


def test_warmup_ratio_one_warms_up_over_every_step(tmp_path):
    # transformers reads a warm-up value >= 1 as a step count: ratio 1.0 became a 1-step warm-up
    applied, _ = run(tmp_path, {"lr_scheduler": "linear", "max_steps": 4, "warmup_ratio": 1.0})
    assert [applied[k] for k in range(1, 5)] == pytest.approx([0.0, PEAK / 4, PEAK / 2, 3 * PEAK / 4])


def test_build_scheduler_passes_the_schedules_own_arguments():
    """train.lr_scheduler_kwargs reach transformers' schedule through llmtune's create_scheduler (cosine_with_min_lr
    without its min_lr_rate would raise; with it the last step runs at 0.1 x the peak LR)."""
    from types import SimpleNamespace

    from llmtune.core.schedule import build_scheduler

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=1.0)
    train = SimpleNamespace(lr_scheduler="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
                            warmup_steps=0, warmup_ratio=0.0)
    sched = build_scheduler(train, opt, total_steps=10)
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(1.0)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)
