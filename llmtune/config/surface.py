"""Recipe keys handed to transformers' own machinery, checked against what the installed transformers supports.

``output.report_to`` (transformers' logging integrations), ``train.optim`` (``TrainingArguments.optim``),
``train.lr_scheduler`` + ``train.lr_scheduler_kwargs`` (transformers' schedules) and ``train.extra_args`` (any other
``TrainingArguments`` field) are validated here, together with the other recipe problems, before anything loads.
transformers is imported only when one of them is set to something other than its default.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
from typing import Any

from llmtune.utils import dotted_get  # the raw-document lookup (dotted key) shared by the rule checks

# TrainingArguments fields llmtune sets from the recipe (or must own): extra_args may not set them.
OWNED: dict[str, str] = {
    "output_dir": "output.dir", "per_device_train_batch_size": "train.micro_batch_size",
    "per_device_eval_batch_size": "train.eval_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size (accumulation is derived from it)",
    "num_train_epochs": "train.num_epochs", "max_steps": "train.max_steps", "learning_rate": "train.learning_rate",
    "lr_scheduler_type": "train.lr_scheduler", "lr_scheduler_kwargs": "train.lr_scheduler_kwargs",
    "warmup_steps": "train.warmup_steps (or train.warmup_ratio)", "warmup_ratio": "train.warmup_ratio",
    "weight_decay": "train.weight_decay", "adam_beta1": "train.adam_beta1", "adam_beta2": "train.adam_beta2",
    "adam_epsilon": "train.adam_epsilon", "max_grad_norm": "train.max_grad_norm", "optim": "train.optim",
    "seed": "train.seed", "data_seed": "train.seed", "bf16": "precision.bf16", "fp16": "precision.fp16",
    "tf32": "precision.tf32", "eval_strategy": "train.eval_steps", "eval_steps": "train.eval_steps",
    "eval_on_start": "train.eval_at_start", "save_strategy": "train.save_steps", "save_steps": "train.save_steps",
    "save_total_limit": "train.save_total_limit", "logging_steps": "train.logging_steps",
    "report_to": "output.report_to", "dataloader_num_workers": "train.dataloader_num_workers",
    "deepspeed": "distributed.deepspeed / distributed.zero_stage",
    "gradient_checkpointing": "train.gradient_checkpointing (always non-reentrant)",
    "gradient_checkpointing_kwargs": "train.gradient_checkpointing (always non-reentrant)",
    "group_by_length": "train.group_by_length", "train_sampling_strategy": "train.group_by_length",
    "resume_from_checkpoint": "train.resume_from", "push_to_hub": "output.push_to_hub",
    "hub_model_id": "output.hub_model_id", "hub_private_repo": "output.hub_private",
    "metric_for_best_model": "llmtune (eval_loss)", "greater_is_better": "llmtune (eval_loss)",
    "remove_unused_columns": "llmtune (the stage's collator needs every column)",
    "label_names": "llmtune (labels)", "average_tokens_across_devices": "llmtune (exact accumulation)",
    "ddp_find_unused_parameters": "llmtune", "dataloader_pin_memory": "llmtune (on when CUDA is available)",
    "disable_tqdm": "llmtune", "ddp_backend": "llmtune (gloo on CPU, nccl on GPUs)",
    "use_cpu": "llmtune (decided by the launcher)",
    "logging_nan_inf_filter": "llmtune (non-finite steps are skipped and logged: train.max_nonfinite_steps)", "local_rank": "the launcher (--nproc-per-node)",
}
# optimizers that need bitsandbytes (the usual QLoRA choice: 8-bit / paged AdamW)
_BNB_PREFIXES = ("paged_", "lion_")
_BNB = ("adamw_bnb_8bit", "adamw_8bit", "ademamix_8bit", "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit")
# train.lr_scheduler -> transformers' name (the one table: llmtune.core.schedule uses it)
SCHEDULE_NAMES = {"linear": "linear", "cosine": "cosine", "constant": "constant_with_warmup",
                   "cosine_with_min_lr": "cosine_with_min_lr", "warmup_stable_decay": "warmup_stable_decay",
                   "cosine_with_restarts": "cosine_with_restarts", "polynomial": "polynomial",
                   "inverse_sqrt": "inverse_sqrt"}
# arguments transformers passes to every schedule itself
_SCHEDULE_OWN = {"optimizer", "num_warmup_steps", "num_training_steps", "last_epoch"}




def _close(name: str, known: list[str]) -> str:
    close = difflib.get_close_matches(str(name), known, n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}? " if close else ""


def report_to_problems(names: Any) -> list[tuple[str, str]]:
    """Each ``output.report_to`` entry must be a transformers integration that is installed here."""
    if not isinstance(names, list) or not names:
        return []
    from transformers.integrations.integration_utils import (
        INTEGRATION_TO_CALLBACK,
        get_available_reporting_integrations,
    )

    known, installed = sorted(INTEGRATION_TO_CALLBACK), set(get_available_reporting_integrations())
    problems = []
    for i, name in enumerate(names):
        if name not in known:
            problems.append((f"output.report_to.{i}", f"{name!r} is not a logging integration of transformers; "
                             f"{_close(name, known)}known: {', '.join(known)}"))
        elif name not in installed:
            package = {"tensorboard": "tensorboard", "azure_ml": "azureml-core", "flyte": "flytekit",
                       "comet_ml": "comet_ml"}.get(name, name)
            problems.append((f"output.report_to.{i}", f"{name!r} is supported but not installed here; `pip install "
                             f"{package}`, or remove it (metrics.jsonl is always written)"))
    return problems


def optim_problems(optim: Any) -> list[tuple[str, str]]:
    """``train.optim`` must be one of transformers' optimizer names; bitsandbytes ones need bitsandbytes."""
    if not isinstance(optim, str) or optim == "adamw_torch":
        return []
    from transformers.training_args import OptimizerNames

    known = [o.value for o in OptimizerNames]
    if optim not in known:
        return [("train.optim", f"unknown optimizer {optim!r}; {_close(optim, known)}transformers knows: "
                 f"{', '.join(known)}")]
    if (optim.startswith(_BNB_PREFIXES) or optim in _BNB) and importlib.util.find_spec("bitsandbytes") is None:
        return [("train.optim", f"{optim} is a bitsandbytes optimizer and bitsandbytes is not installed; "
                 "`pip install bitsandbytes` or use adamw_torch / adamw_torch_fused")]
    return []


def scheduler_problems(name: Any, kwargs: Any) -> list[tuple[str, str]]:
    """``train.lr_scheduler_kwargs`` must be arguments of the chosen transformers schedule (the required ones of
    cosine_with_min_lr and warmup_stable_decay present)."""
    if not isinstance(name, str) or name not in SCHEDULE_NAMES:
        return []
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    if not kwargs and name in ("linear", "cosine", "constant"):
        return []
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
    from transformers.trainer_utils import SchedulerType

    func = TYPE_TO_SCHEDULER_FUNCTION[SchedulerType(SCHEDULE_NAMES[name])]
    params = {p: v for p, v in inspect.signature(func).parameters.items() if p not in _SCHEDULE_OWN}
    problems = []
    for key in kwargs:
        if key not in params:
            problems.append((f"train.lr_scheduler_kwargs.{key}", f"not an argument of the {name} schedule; "
                             f"{_close(key, list(params))}it takes: {', '.join(params) or 'nothing'}"))
    if name == "cosine_with_min_lr" and ("min_lr" in kwargs) == ("min_lr_rate" in kwargs):
        problems.append(("train.lr_scheduler_kwargs", "cosine_with_min_lr needs exactly one of min_lr (absolute "
                         "learning rate) or min_lr_rate (fraction of train.learning_rate), e.g. {min_lr_rate: 0.1}"))
    if name == "warmup_stable_decay" and "num_decay_steps" not in kwargs:
        problems.append(("train.lr_scheduler_kwargs", "warmup_stable_decay needs num_decay_steps (optimizer steps "
                         "of the final decay), e.g. {num_decay_steps: 100}; optional: min_lr_ratio, decay_type"))
    return problems


def extra_args_problems(extra: Any) -> list[tuple[str, str]]:
    """``train.extra_args`` may set any ``TrainingArguments`` field llmtune does not own."""
    if not isinstance(extra, dict) or not extra:
        return []
    from transformers import TrainingArguments

    fields = [f for f, spec in TrainingArguments.__dataclass_fields__.items() if spec.init]
    problems = []
    for key in extra:
        where = f"train.extra_args.{key}"
        if key in OWNED:
            problems.append((where, f"set by llmtune from {OWNED[key]}; use that recipe key instead"))
        elif key not in fields:
            problems.append((where, f"not a TrainingArguments field; {_close(key, fields)}see "
                             "https://huggingface.co/docs/transformers/main_classes/trainer#transformers.TrainingArguments"))
    return problems


def surface_problems(doc: dict) -> list[tuple[str, str]]:
    """All problems of the keys handed to transformers, plus ``output.push_to_hub`` without a repo."""
    problems = report_to_problems(dotted_get(doc, "output.report_to"))
    problems += optim_problems(dotted_get(doc, "train.optim"))
    problems += scheduler_problems(dotted_get(doc, "train.lr_scheduler", "cosine"), dotted_get(doc, "train.lr_scheduler_kwargs"))
    problems += extra_args_problems(dotted_get(doc, "train.extra_args"))
    if dotted_get(doc, "output.push_to_hub") is True and not dotted_get(doc, "output.hub_model_id"):
        problems.append(("output.hub_model_id", "output.push_to_hub needs the hub repo to upload to, e.g. "
                         "output.hub_model_id: my-org/my-model"))
    return problems
