"""Data-parallel and DeepSpeed ZeRO runs: the DeepSpeed config, process-group setup, ZeRO-3 guards.

Everything here leans on the libraries: ``torchrun`` (or accelerate / the deepspeed launcher / srun) starts the
processes (see :mod:`llmtune.core.launch`), ``accelerate`` sets up the process group, transformers fills the ``"auto"``
values of the DeepSpeed config from ``TrainingArguments`` and saves/loads ZeRO checkpoints, DeepSpeed shards.

Units: ``micro_batch_size`` samples per rank per forward; ``global_batch_size`` samples per optimizer step over all
ranks; accumulation = global / (micro x world size) micro-steps per rank (see :func:`batch_layout`).

ZeRO stages (Rajbhandari et al. 2020): 1 partitions the optimizer states over the ranks, 2 also the gradients,
3 also the parameters (each rank holds 1/world of every weight and gathers a layer just before using it).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from llmtune.config import Recipe, RecipeError

if TYPE_CHECKING:
    import torch

# "auto" = filled by transformers from TrainingArguments (HfTrainerDeepSpeedConfig.trainer_config_process/finalize):
# micro batch, accumulation, global batch, clipping, bf16/fp16, bucket sizes from the model's hidden size.
_AUTO_COMMON: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "bf16": {"enabled": "auto"},
    "fp16": {"enabled": "auto"},
}
# DeepSpeed's own AdamW with the recipe's lr/betas/eps/weight decay; needed with optimizer offload (DeepSpeedCPUAdam).
# Without an "optimizer" section (zero2/zero3) the Trainer's torch AdamW is used, exactly as in one-process runs.
_AUTO_OPTIMIZER = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}


def zero_config(stage: int, offload: bool = False) -> dict[str, Any]:
    """A DeepSpeed config for ZeRO ``stage`` whose ``"auto"`` values transformers fills from the recipe.

    The shipped ``deepspeed_configs/zero2.json``, ``zero3.json`` and ``zero3_offload.json`` are exactly
    ``zero_config(2)``, ``zero_config(3)`` and ``zero_config(3, offload=True)`` (a unit test keeps them equal).

    Args:
        stage: ZeRO stage 0-3 (0 = DeepSpeed without partitioning).
        offload: keep optimizer states and (stage 3) parameters in CPU memory; uses DeepSpeed's AdamW
            (DeepSpeedCPUAdam, compiled on first use) with the recipe's hyper-parameters.

    Returns:
        A fresh dict (the caller may modify it).

    Raises:
        ValueError: a stage outside 0-3, or ``offload`` with stage 0.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3; got {stage!r}")
    if offload and stage == 0:
        raise ValueError("offload needs ZeRO stage >= 1")
    zero: dict[str, Any] = {"stage": stage}
    if stage >= 1:
        zero.update({"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto"})
    if stage == 2:
        zero["allgather_bucket_size"] = 5e8
    if stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
            # gather the (16-bit or fp32) weights when saving: without it a LoRA adapter is saved empty
            # (DeepSpeed #4295, trl #4416); transformers then gathers only the trainable ones.
            "stage3_gather_16bit_weights_on_model_save": True,
        })
    config = copy.deepcopy(_AUTO_COMMON)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        config["optimizer"] = copy.deepcopy(_AUTO_OPTIMIZER)
    config["zero_optimization"] = zero
    return config


def deepspeed_config(recipe: Recipe) -> dict[str, Any] | None:
    """The DeepSpeed config of a recipe: ``distributed.deepspeed`` (a JSON file) or ``zero_config(zero_stage)``.

    Returns:
        A fresh dict, or ``None`` when the recipe does not use DeepSpeed.

    Raises:
        RecipeError: the file does not exist, is not JSON, or has no ``zero_optimization.stage``-compatible content
            (a mapping is required).
    """
    dist = recipe.distributed
    if dist.deepspeed is None:
        return zero_config(dist.zero_stage) if dist.zero_stage is not None else None
    path = Path(dist.deepspeed).expanduser()
    if not path.is_file():
        raise RecipeError([("distributed.deepspeed", f"DeepSpeed config {path} not found (looked at {path.resolve()}); "
                            "paths are relative to the working directory, e.g. deepspeed_configs/zero3.json, or set "
                            "distributed.zero_stage instead")])
    def no_duplicates(pairs: list) -> dict:
        keys = [k for k, _ in pairs]
        dup = next((k for k in keys if keys.count(k) > 1), None)
        if dup is not None:
            raise ValueError(f"duplicate key {dup!r} in one object (JSON would silently keep the last); delete one")
        return dict(pairs)

    try:
        config = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=no_duplicates)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise RecipeError([("distributed.deepspeed", f"{path} is not valid JSON (UTF-8): {exc}")]) from None
    if not isinstance(config, dict):
        raise RecipeError([("distributed.deepspeed", f"{path} must hold a JSON object, got {type(config).__name__}")])
    return config


def zero_stage(recipe: Recipe) -> int | None:
    """ZeRO stage the recipe trains with (``None`` without DeepSpeed). A missing config file counts as ``None``."""
    if recipe.distributed.deepspeed is None:
        return recipe.distributed.zero_stage
    try:
        config = deepspeed_config(recipe)
    except RecipeError:
        return None
    return int((config or {}).get("zero_optimization", {}).get("stage", 0))


def launched_world_size() -> int:
    """Processes of this job as the launcher (torchrun, accelerate, deepspeed, mapped srun) set them; 1 if none."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def recipe_world_size(recipe: Recipe) -> int:
    """Processes the recipe's own launch starts: ``distributed.nproc_per_node`` (1 when unset) x ``distributed.nnodes``.

    What ``llmtune <stage> RECIPE`` starts through torchrun; an outer launcher (torchrun, srun) may start another
    number, and then its world size counts (:func:`launched_world_size`).
    """
    return (recipe.distributed.nproc_per_node or 1) * recipe.distributed.nnodes


def batch_layout(recipe: Recipe, world: int | None = None) -> dict[str, int]:
    """How the global batch is split: ``{global_batch_size, micro_batch_size, accumulation_steps, world_size}``.

    ``global_batch_size = micro_batch_size x accumulation_steps x world_size`` (samples per optimizer step).

    Args:
        recipe: the recipe.
        world: processes (ranks) over all nodes; default: the launched world size (``WORLD_SIZE``, 1 without a
            launcher). ``llmtune validate`` passes :func:`recipe_world_size` (the launch the recipe describes).

    Raises:
        RecipeError: the global batch is not a multiple of micro batch x world size.
    """
    world = world or launched_world_size()
    micro, glob = recipe.train.micro_batch_size, recipe.train.global_batch_size
    if glob % (micro * world):
        raise RecipeError([("train.global_batch_size", f"{glob} is not a multiple of micro_batch_size ({micro}) x "
                            f"world size ({world}) = {micro * world}; pick a multiple, or change the process count")])
    return {"global_batch_size": glob, "micro_batch_size": micro, "accumulation_steps": glob // (micro * world),
            "world_size": world}


def process_setup_kwargs(recipe: Recipe) -> dict[str, Any]:
    """Extra ``TrainingArguments`` keywords that make accelerate set up this process's distributed state.

    On GPUs nothing is needed (NCCL; DeepSpeed initialises it). Without CUDA, accelerate only goes distributed when
    told to run on CPU, and then never with DeepSpeed; so for a multi-process CPU run:

    * without DeepSpeed: ``use_cpu=True`` (accelerate's MULTI_CPU with the gloo backend);
    * with DeepSpeed: accelerate's ``PartialState`` is created here with the gloo backend and DeepSpeed flagged
      (DeepSpeed's CPU accelerator falls back to gloo when oneCCL is not installed), and ``TrainingArguments`` is
      told to reuse it (``accelerator_config.use_configured_state``).

    A DeepSpeed run in one process gets the same set-up (it is started through torchrun too, see
    :func:`llmtune.core.launch.needs_launch`).

    Returns:
        ``{}`` on CUDA, or without a launcher's environment; else the keywords above.
    """
    import torch

    if torch.cuda.is_available() or "LOCAL_RANK" not in os.environ:
        return {}
    if deepspeed_config(recipe) is None:
        return {"use_cpu": True} if launched_world_size() > 1 else {}
    from accelerate import PartialState

    previous = os.environ.get("ACCELERATE_USE_DEEPSPEED")
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    try:
        PartialState(backend="gloo")
    finally:
        if previous is None:
            os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = previous
    return {"accelerator_config": {"use_configured_state": True}}


def is_zero3_enabled() -> bool:
    """Whether transformers currently loads models partitioned (a ZeRO-3 ``TrainingArguments`` is alive)."""
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover - transformers without the integration
        return False
    return bool(is_deepspeed_zero3_enabled())


@contextlib.contextmanager
def no_zero3_init() -> Iterator[None]:
    """Load models whole (not ZeRO-3 partitioned) inside this block, even while a ZeRO-3 config is alive.

    Merging earlier adapters into a base (``model.from_run``) needs the full weights in memory; DeepSpeed partitions
    the merged model afterwards, when the trainer starts. Outside the block transformers' ZeRO-3 state is restored.
    """
    from transformers.integrations import deepspeed as hf_ds

    ref = hf_ds._hf_deepspeed_config_weak_ref
    config = ref() if ref is not None else None
    if config is None:
        yield
        return
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds.set_hf_deepspeed_config(config)


def partitioned_parameters(model: torch.nn.Module) -> list[str]:
    """Names of parameters that DeepSpeed ZeRO-3 holds partitioned on this rank (local tensor smaller than
    ``ds_numel``, the full size; usually empty)."""
    return [name for name, p in model.named_parameters()
            if getattr(p, "ds_numel", 0) and p.numel() != p.ds_numel]


def assert_gathered(model: torch.nn.Module, action: str = "merge the adapter") -> None:
    """Refuse to read or change weights that ZeRO-3 has partitioned (their local tensors are empty placeholders).

    Raises:
        RuntimeError: some parameters are partitioned; the message names one and how to get whole weights.
    """
    names = partitioned_parameters(model)
    if names:
        raise RuntimeError(
            f"cannot {action}: {len(names)} parameter(s) are DeepSpeed ZeRO-3 partitions (e.g. {names[0]}), whose "
            "local tensors are empty placeholders. Gather them first (deepspeed.zero.GatheredParameters), or load "
            "the model outside ZeRO-3: run `llmtune export` as a single process, without torchrun/deepspeed and "
            "without a live ZeRO-3 TrainingArguments"
        )
