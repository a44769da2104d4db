"""Recipe keys handed to transformers: report_to integrations, optimizers, schedules with their kwargs, and the
train.extra_args escape hatch, validated against the installed transformers and passed to TrainingArguments."""

import importlib.util

import pytest
import torch

from llmtune.config import RecipeError, load_recipe
from llmtune.config import surface
from llmtune.core.trainer import build_training_args


def problems(raw: dict) -> dict[str, str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(raw=raw)
    return dict(info.value.problems)


def test_report_to_accepts_installed_integrations_and_names_the_missing_ones():
    from transformers.integrations.integration_utils import get_available_reporting_integrations

    installed = get_available_reporting_integrations()
    assert "tensorboard" in installed  # a dev dependency
    assert load_recipe(raw={"output": {"report_to": ["tensorboard"]}}).output.report_to == ["tensorboard"]
    found = problems({"output": {"report_to": ["tensorbaord"]}})
    assert found["output.report_to.0"].startswith("'tensorbaord' is not a logging integration of transformers; "
                                                   "did you mean 'tensorboard'?")
    missing = next(n for n in ("wandb", "mlflow", "trackio", "comet_ml") if n not in installed)
    found = problems({"output": {"report_to": ["tensorboard", missing]}})
    assert list(found) == ["output.report_to.1"] and "supported but not installed" in found["output.report_to.1"]


def test_optimizer_names_come_from_transformers(monkeypatch, tmp_path):
    recipe = load_recipe(raw={"train": {"optim": "paged_adamw_8bit"}})
    assert build_training_args(recipe, tmp_path, False).optim == "paged_adamw_8bit"
    found = problems({"train": {"optim": "adamw_torch_fusd"}})
    assert "did you mean 'adamw_torch_fused'?" in found["train.optim"]
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "bitsandbytes" else real(n, *a))
    assert "bitsandbytes is not installed" in problems({"train": {"optim": "adamw_8bit"}})["train.optim"]


def _final_lr(args, steps=10):
    from transformers import get_scheduler

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    sched = get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=0, num_training_steps=steps,
                          scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    lrs = []
    for _ in range(steps):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def test_cosine_with_min_lr_and_warmup_stable_decay_reach_transformers(tmp_path):
    recipe = load_recipe(raw={"train": {"lr_scheduler": "cosine_with_min_lr", "learning_rate": 1e-3,
                                        "lr_scheduler_kwargs": {"min_lr_rate": 0.1}}})
    lrs = _final_lr(build_training_args(recipe, tmp_path, False))
    assert lrs[-1] == pytest.approx(1e-4)  # plain cosine would end at 0
    recipe = load_recipe(raw={"train": {"lr_scheduler": "warmup_stable_decay", "learning_rate": 1e-3,
                                        "lr_scheduler_kwargs": {"num_decay_steps": 4}}})
    lrs = _final_lr(build_training_args(recipe, tmp_path, False))
    assert lrs[:5] == pytest.approx([1e-3] * 5) and lrs[-1] == pytest.approx(0.0, abs=1e-9)  # stable, then decay
    found = problems({"train": {"lr_scheduler": "cosine_with_min_lr"}})
    assert "exactly one of min_lr" in found["train.lr_scheduler_kwargs"]
    found = problems({"train": {"lr_scheduler": "warmup_stable_decay", "lr_scheduler_kwargs": {"num_decay_step": 4}}})
    assert "did you mean 'num_decay_steps'?" in found["train.lr_scheduler_kwargs.num_decay_step"]
    assert "needs num_decay_steps" in found["train.lr_scheduler_kwargs"]


def test_extra_args_reach_training_arguments_and_owned_or_unknown_fields_are_refused(tmp_path):
    recipe = load_recipe(raw={"train": {"extra_args": {"neftune_noise_alpha": 5.0, "torch_empty_cache_steps": 3}}})
    args = build_training_args(recipe, tmp_path, False)
    assert args.neftune_noise_alpha == 5.0 and args.torch_empty_cache_steps == 3
    found = problems({"train": {"extra_args": {"learning_rate": 1e-3, "torch_compil": True, "optim": "sgd"}}})
    assert found["train.extra_args.learning_rate"] == "set by llmtune from train.learning_rate; use that recipe key " \
                                                      "instead"
    assert "train.optim" in found["train.extra_args.optim"]
    assert "did you mean 'torch_compile'?" in found["train.extra_args.torch_compil"]


def test_every_training_argument_llmtune_sets_is_owned(tmp_path, monkeypatch):
    """extra_args must never collide with a keyword build_training_args passes (a TypeError at run time)."""
    import llmtune.core.trainer as trainer

    seen = {}

    class Recorder:
        __dataclass_fields__ = trainer.TrainingArguments.__dataclass_fields__

        def __init__(self, **kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(trainer, "TrainingArguments", Recorder)
    for raw in ({}, {"train": {"group_by_length": True, "eval_steps": 1}, "data": {"val_size": 2}}):
        build_training_args(load_recipe(raw=raw), tmp_path, True)
    assert set(seen) - set(surface.OWNED) == set()


def test_push_to_hub_needs_a_repo():
    assert "output.hub_model_id" in problems({"output": {"push_to_hub": True}})
