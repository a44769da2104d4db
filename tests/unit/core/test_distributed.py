"""DeepSpeed configs, launcher command lines, ZeRO-3 guards and recipe rules (no processes started here;
tests/integration/test_distributed.py runs 2-process ZeRO-2/ZeRO-3 training)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import yaml

from llmtune.core import launch
from llmtune.commands.cli import build_parser
from llmtune.config import RecipeError, load_recipe
from llmtune.core.distributed import (
    assert_gathered,
    batch_layout,
    deepspeed_config,
    is_zero3_enabled,
    no_zero3_init,
    partitioned_parameters,
    zero_config,
    zero_stage,
)

REPO = Path(__file__).resolve().parents[3]


def recipe(**sections):
    return load_recipe(raw=sections, stage="sft")


@pytest.mark.parametrize("name, stage, offload", [("zero2", 2, False), ("zero3", 3, False), ("zero3_offload", 3, True)])
def test_shipped_configs_equal_zero_config(name, stage, offload):
    shipped = json.loads((REPO / "deepspeed_configs" / f"{name}.json").read_text())
    assert shipped == zero_config(stage, offload=offload)
    assert shipped["zero_optimization"]["stage"] == stage
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert shipped[key] == "auto"  # filled from the recipe by transformers
    if stage == 3:  # without it ZeRO-3 can save an empty adapter (DeepSpeed #4295)
        assert shipped["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    assert ("optimizer" in shipped) == offload  # offload needs DeepSpeed's CPU Adam; else the Trainer's AdamW


def test_auto_values_are_filled_from_the_recipe(tmp_path, monkeypatch):
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from llmtune.core.trainer import build_training_args

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    offload = str(REPO / "deepspeed_configs" / "zero3_offload.json")
    r = recipe(train={"micro_batch_size": 2, "global_batch_size": 8, "max_grad_norm": 0.5, "learning_rate": 3e-4,
                      "weight_decay": 0.01}, distributed={"deepspeed": offload})
    try:
        cfg = build_training_args(r, tmp_path, has_eval=False).hf_deepspeed_config.config
        assert cfg["train_micro_batch_size_per_gpu"] == 2 and cfg["gradient_accumulation_steps"] == 4
        assert cfg["train_batch_size"] == 8 and cfg["gradient_clipping"] == 0.5
        assert cfg["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
        assert cfg["bf16"]["enabled"] is False and cfg["fp16"]["enabled"] is False
        assert json.loads(Path(offload).read_text())["train_batch_size"] == "auto"  # the file itself is untouched
    finally:
        unset_hf_deepspeed_config()


def test_deepspeed_config_sources(tmp_path):
    assert deepspeed_config(recipe()) is None and zero_stage(recipe()) is None
    assert deepspeed_config(recipe(distributed={"zero_stage": 2})) == zero_config(2)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    r = recipe(distributed={"deepspeed": str(path)})
    assert deepspeed_config(r) == {"zero_optimization": {"stage": 1}} and zero_stage(r) == 1
    missing = recipe(distributed={"deepspeed": str(tmp_path / "nope.json")})
    with pytest.raises(RecipeError, match="distributed.deepspeed.*nope.json not found"):
        deepspeed_config(missing)
    path.write_text("{not json")
    with pytest.raises(RecipeError, match="not valid JSON"):
        deepspeed_config(r)


def test_batch_layout_and_error():
    r = recipe(train={"micro_batch_size": 2, "global_batch_size": 16})
    assert batch_layout(r, 4) == {"global_batch_size": 16, "micro_batch_size": 2, "accumulation_steps": 2,
                                  "world_size": 4}
    assert batch_layout(r, 1)["accumulation_steps"] == 8
    with pytest.raises(RecipeError, match="16 is not a multiple of micro_batch_size \\(2\\) x world size \\(3\\)"):
        batch_layout(r, 3)


# ---- launcher -----------------------------------------------------------------------------------------------------

def parse(argv):
    return build_parser().parse_args(argv)


def test_launch_flags_become_recipe_overrides():
    args = parse(["sft", "r.yaml", "train.max_steps=2", "--nproc-per-node", "8", "--nnodes", "2", "--node-rank", "1",
                  "--master-addr", "10.0.0.1", "--master-port", "29501"])
    assert args.overrides == ["train.max_steps=2"]
    assert launch.launch_overrides(args) == ["distributed.nproc_per_node=8", "distributed.nnodes=2",
                                             "distributed.node_rank=1", "distributed.master_addr=10.0.0.1",
                                             "distributed.master_port=29501"]
    assert launch.launch_overrides(parse(["sft", "r.yaml"])) == []
    # the deepspeed launcher puts --local_rank=I before the worker's own arguments
    assert parse(["--local_rank=3", "sft", "r.yaml", "a.b=1"]).overrides == ["a.b=1"]


def test_torchrun_command_single_node():
    r = recipe(distributed={"nproc_per_node": 4})
    cmd = launch.torchrun_command("sft", "r.yaml", ["train.max_steps=2"], r.distributed)
    assert cmd == [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                   "-m", "llmtune.commands.cli", "sft", "r.yaml", "train.max_steps=2", "distributed.nproc_per_node=4",
                   "distributed.nnodes=1"]


def test_torchrun_command_multi_node_keeps_rendezvous_out_of_the_recipe():
    r = recipe(train={"global_batch_size": 32}, distributed={"nproc_per_node": 8, "nnodes": 2, "node_rank": 1,
                                                             "master_addr": "10.0.0.1", "master_port": 29501})
    cmd = launch.torchrun_command("dpo", "r.yaml", [], r.distributed)
    assert cmd[3:13] == ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29501",
                         "--nproc-per-node", "8"]
    # every node resolves the same recipe: node rank and address stay torchrun's business
    assert cmd[-2:] == ["distributed.nproc_per_node=8", "distributed.nnodes=2"]


def test_needs_launch(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    assert not launch.needs_launch(recipe())
    assert launch.needs_launch(recipe(distributed={"nproc_per_node": 2}))
    assert launch.needs_launch(recipe(distributed={"nnodes": 2}))
    assert launch.needs_launch(recipe(distributed={"zero_stage": 3}))  # DeepSpeed wants the launcher's env
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert not launch.needs_launch(recipe(distributed={"nproc_per_node": 2}))  # already under torchrun


def test_node_rank_must_be_below_nnodes():
    with pytest.raises(RecipeError, match="node_rank"):
        recipe(distributed={"nnodes": 2, "node_rank": 2})


def srun_env(ntasks: int, nodes: int, procid: int, **extra: str) -> dict[str, str]:
    """What srun sets in a task of a step of `ntasks` tasks spread evenly over `nodes` nodes gpu[01-0N]."""
    per = ntasks // nodes
    return {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(procid),
            "SLURM_STEP_NUM_TASKS": str(ntasks), "SLURM_NTASKS": str(ntasks), "SLURM_STEP_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes), "SLURM_STEP_TASKS_PER_NODE": f"{per}(x{nodes})",
            "SLURM_LOCALID": str(procid % per), "SLURM_NODEID": str(procid // per),
            "SLURM_STEP_NODELIST": f"gpu[01-{nodes:02d}]", **extra}


ZERO3 = {"deepspeed": "deepspeed_configs/zero3.json", "nproc_per_node": 8, "nnodes": 2}  # recipes/llama7b_zero3.yaml


def test_srun_task_per_gpu_is_one_rank_whatever_nproc_per_node():
    """`srun --ntasks-per-node 8 llmtune sft llama7b_zero3.yaml` on 2 nodes (issue 32): every task is one rank of 16,
    no torchrun (the old code re-launched 8 torchruns per node because the recipe says nproc_per_node: 8)."""
    dist = recipe(train={"micro_batch_size": 4, "global_batch_size": 128}, distributed=ZERO3).distributed
    env, overrides = launch.slurm_launch(dist, srun_env(16, 2, 11))
    assert overrides == []
    assert env == {"RANK": "11", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8",
                   "MASTER_ADDR": "gpu01", "MASTER_PORT": "29500"}  # node 0 = the first host of the step
    assert launch.slurm_launch(dist, srun_env(16, 2, 11, MASTER_ADDR="n0", MASTER_PORT="1234"))[0]["MASTER_ADDR"] == "n0"
    assert launch.slurm_launch(dist, {**srun_env(16, 2, 11), "RANK": "11"}) == ({}, [])  # torchrun already set it


def test_srun_per_gpu_trains_without_relaunch(monkeypatch):
    """What the CLI does with it: the rank variables in the environment, then needs_launch is False (old: True)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(key, raising=False)
    r = recipe(train={"micro_batch_size": 4, "global_batch_size": 128}, distributed=ZERO3)
    env, _ = launch.slurm_launch(r.distributed, srun_env(16, 2, 0))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert not launch.needs_launch(r)
    from llmtune.core.distributed import batch_layout

    assert batch_layout(r)["world_size"] == 16 and batch_layout(r)["accumulation_steps"] == 2


def test_srun_one_task_per_node_is_the_node_launcher():
    """scripts/slurm_zero3.sbatch: one task per node + nproc_per_node 8 -> torchrun per node, node rank/count and
    node 0 from SLURM (whatever the recipe or the flags say)."""
    dist = recipe(distributed={**ZERO3, "nnodes": 1}).distributed
    assert launch.slurm_launch(dist, srun_env(2, 2, 1)) == (
        {}, ["distributed.nnodes=2", "distributed.node_rank=1", "distributed.master_addr=gpu01",
             "distributed.master_port=29500"])
    single = recipe(distributed={"master_addr": "head", "master_port": 29400}).distributed  # 1 process per node
    assert launch.slurm_launch(single, srun_env(2, 2, 1)) == (
        {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "head",
         "MASTER_PORT": "29400"}, [])


def test_no_srun_step_is_no_slurm_launch():
    """The batch script itself has SLURM_PROCID=0 and SLURM_NTASKS=N but is no step: taking it as rank 0 of N would
    wait forever for ranks that never start (the old code did); a step of one task is a plain launch."""
    dist = recipe().distributed
    batch = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0",
             "SLURM_NNODES": "2", "SLURM_TASKS_PER_NODE": "4(x2)"}
    assert launch.slurm_launch(dist, batch) == ({}, [])
    assert launch.slurm_launch(dist, {**srun_env(16, 2, 0), "SLURM_STEP_ID": "4294967294"}) == ({}, [])  # batch step
    assert launch.slurm_launch(dist, srun_env(1, 1, 0)) == ({}, [])
    assert launch.slurm_launch(dist, {}) == ({}, [])


def test_srun_refusals_name_the_fix():
    dist = recipe(train={"global_batch_size": 16}, distributed=ZERO3).distributed
    with pytest.raises(launch.LaunchError, match=r"8 tasks on this node but each sees 1 GPU.*--gpus-per-node"):
        launch.slurm_launch(dist, srun_env(16, 2, 3, CUDA_VISIBLE_DEVICES="3"))  # srun --gpus-per-task 1
    assert launch.slurm_launch(dist, srun_env(16, 2, 3, CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7"))[0]["LOCAL_RANK"] == "3"
    env = srun_env(16, 2, 3)
    del env["SLURM_STEP_NODELIST"]
    with pytest.raises(launch.LaunchError, match=r"node 0's address is unknown.*--master-addr"):
        launch.slurm_launch(dist, env)
    env["SLURM_STEP_NODELIST"] = "gpu[07,09]"
    assert launch.slurm_launch(dist, env)[0]["MASTER_ADDR"] == "gpu07"


@pytest.mark.parametrize("text, expected", [("8(x2)", (8, 8)), ("8(x2),4", (8, 8, 4)), ("1", (1,)), ("2,1", (2, 1))])
def test_parse_tasks_per_node(text, expected):
    assert launch.parse_tasks_per_node(text) == expected


@pytest.mark.parametrize("nodes, first", [("gpu[03-04,07],cpu1", "gpu03"), ("node01", "node01"), ("a1,b2", "a1"),
                                          ("rack[1-2]-n[05-06]", "rack1-n05"), ("gpu[007]", "gpu007")])
def test_first_host(nodes, first):
    assert launch.first_host(nodes) == first


def test_cli_srun_per_gpu_does_not_relaunch(monkeypatch, tmp_path):
    """Through the CLI: under `srun --ntasks-per-node 8` on 2 nodes the stage runs in this task as rank 5 of 16, and
    torchrun is never started."""
    import llmtune.commands.cli as cli
    import llmtune.core.runner as runner

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "CUDA_VISIBLE_DEVICES"):
        monkeypatch.setenv(key, "0")  # recorded, so what run_stage_command sets in os.environ is undone afterwards
        monkeypatch.delenv(key)
    for key, value in srun_env(16, 2, 5).items():
        monkeypatch.setenv(key, value)
    seen = {}

    def fake_run_stage(stage, base_dir):
        import os

        seen.update(rank=os.environ["RANK"], world=os.environ["WORLD_SIZE"], local=os.environ["LOCAL_RANK"])
        raise SystemExit(0)

    monkeypatch.setattr(launch, "relaunch", lambda *a, **k: pytest.fail("torchrun relaunched under srun"))
    monkeypatch.setattr(runner, "run_stage", fake_run_stage)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({"stage": "sft", "train": {"micro_batch_size": 4, "global_batch_size": 128},
                                    "distributed": ZERO3}))
    with pytest.raises(SystemExit):
        cli.run_stage_command("sft", str(path), [])
    assert seen == {"rank": "5", "world": "16", "local": "5"}


def test_stage_help_lists_launch_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        parse(["sft", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--nproc-per-node N" in out and "--master-addr A" in out and "distributed.nproc_per_node" in out


# ---- recipe rules ---------------------------------------------------------------------------------------------------

def problems(**sections) -> list[str]:
    with pytest.raises(RecipeError) as exc:
        load_recipe(raw=sections, stage=sections.pop("stage", "sft"))
    return [path for path, _ in exc.value.problems]


def test_qlora_zero3_needs_the_storage_dtype_to_be_the_training_dtype():
    assert problems(model={"load_in_4bit": True, "dtype": "fp32"}, precision={"bf16": True},
                    distributed={"zero_stage": 3}) == ["model.dtype"]
    load_recipe(raw={"model": {"load_in_4bit": True, "dtype": "bf16"}, "precision": {"bf16": True},
                     "distributed": {"zero_stage": 3}}, stage="sft")  # fine
    load_recipe(raw={"model": {"load_in_4bit": True, "dtype": "fp32"}, "precision": {"bf16": True},
                     "distributed": {"zero_stage": 2}}, stage="sft")  # ZeRO-2 does not partition the weights


def test_zero3_rules_read_the_stage_from_the_config_file(tmp_path):
    path = tmp_path / "z3.json"
    path.write_text(json.dumps(zero_config(3)))
    assert problems(model={"load_in_8bit": True}, distributed={"deepspeed": str(path)}) == ["model.load_in_8bit"]
    assert problems(stage="dpo", dpo={"precompute_ref_logps": True},
                    distributed={"zero_stage": 3}) == ["dpo.precompute_ref_logps"]


def test_global_batch_must_split_over_the_launched_processes():
    assert problems(train={"micro_batch_size": 4, "global_batch_size": 32},
                    distributed={"nproc_per_node": 8, "nnodes": 2}) == ["train.global_batch_size"]


# ---- ZeRO-3 guards ------------------------------------------------------------------------------------------------

def fake_partition(model: torch.nn.Module, name: str) -> None:
    """Make one parameter look like a ZeRO-3 partition: empty local tensor, ``ds_numel`` = the full size."""
    param = dict(model.named_parameters())[name]
    param.ds_numel = param.numel()
    param.data = torch.empty(0)


def test_assert_gathered_refuses_partitions_and_export_refuses_to_merge():
    from llmtune.export.merge import ExportError, refuse_partitioned_merge

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert_gathered(model)
    refuse_partitioned_merge(model)
    fake_partition(model, "1.weight")
    assert partitioned_parameters(model) == ["1.weight"]
    with pytest.raises(RuntimeError, match="1 parameter\\(s\\) are DeepSpeed ZeRO-3 partitions \\(e.g. 1.weight\\)"):
        assert_gathered(model)
    with pytest.raises(ExportError, match="cannot merge the adapter: .*GatheredParameters"):
        refuse_partitioned_merge(model)


@pytest.fixture()
def live_zero3():
    """A ZeRO-3 DeepSpeed config alive in transformers (as while a ZeRO-3 TrainingArguments exists)."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    config = HfDeepSpeedConfig(zero_config(3))
    yield config
    unset_hf_deepspeed_config()


def test_no_zero3_init_loads_whole_weights_then_restores(live_zero3):
    assert is_zero3_enabled()
    with no_zero3_init():
        assert not is_zero3_enabled()
    assert is_zero3_enabled()


def test_qlora_storage_dtype_is_the_model_dtype_under_zero3(live_zero3):
    pytest.importorskip("bitsandbytes")
    from llmtune.config import ModelConfig, PrecisionConfig
    from llmtune.models.load import build_quantization_config

    cfg = ModelConfig(load_in_4bit=True)
    assert build_quantization_config(cfg, PrecisionConfig(bf16=True)).bnb_4bit_quant_storage == torch.bfloat16
    assert build_quantization_config(cfg, PrecisionConfig()).bnb_4bit_quant_storage == torch.float32
    with no_zero3_init():  # no ZeRO-3: bitsandbytes' default packed uint8 storage
        assert build_quantization_config(cfg, PrecisionConfig(bf16=True)).bnb_4bit_quant_storage == torch.uint8


def test_verify_saved_adapter_catches_an_empty_zero3_save(tmp_path):
    """What ZeRO-3 wrote without gathering (DeepSpeed #4295, trl #4416): an adapter file without tensors."""
    from peft import LoraConfig, get_peft_model

    from llmtune.models.tiny import make_tiny_llama
    from llmtune.models.verify import AdapterSaveError, verify_saved_adapter

    model = get_peft_model(make_tiny_llama(), LoraConfig(r=4, target_modules="all-linear"))
    model.save_pretrained(tmp_path / "ok")
    assert verify_saved_adapter(tmp_path / "ok", model) == 28
    model.save_pretrained(tmp_path / "empty", state_dict={})
    assert (tmp_path / "empty" / "adapter_model.safetensors").stat().st_size < 100
    with pytest.raises(AdapterSaveError, match="28 problem\\(s\\).*missing.*gathered before saving"):
        verify_saved_adapter(tmp_path / "empty", model)
