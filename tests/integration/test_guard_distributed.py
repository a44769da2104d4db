"""Non-finite guard with two processes (gloo on this CPU): NaN activations on rank 1 only.

DDP: both ranks skip the same optimizer step (the flag is summed over ranks; the record lists the rows of both
ranks' batches) and training goes on. DeepSpeed ZeRO-2: the update happens inside the engine's backward, so the run
stops at the first non-finite step on every rank, with exit code 3 and no lineage.json.
Each test starts 2 worker processes (~30-60 s on 2 shared cores): marked slow.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from llmtune.models.tiny import save_tiny_model
from llmtune.utils import read_jsonl

pytestmark = pytest.mark.slow

WORKER = """
import os, sys
import torch
import llmtune.core.runner as runner

original = runner.attach_adapter
calls = {"n": 0}

def hook(module, args, output):
    calls["n"] += 1
    return output * float("nan") if calls["n"] == 2 else output   # the second training forward on this rank

def attach(model, *a, **k):
    model = original(model, *a, **k)
    if os.environ["RANK"] == "1":
        model.get_input_embeddings().register_forward_hook(hook)
    return model

runner.attach_adapter = attach
from llmtune.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard_dist")
    model_dir = save_tiny_model(root / "model")
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                          {"role": "assistant", "content": f"It is {i + 1}."}]} for i in range(24)]
    (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (root / "worker.py").write_text(WORKER)
    recipe = {"stage": "sft", "model": {"name_or_path": str(model_dir)},
              "data": {"datasets": [{"path": str(root / "data.jsonl")}], "max_length": 64},
              "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
              "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 4, "learning_rate": 1e-3}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root


def launch(ws, run, *overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ws / "worker.py"), "sft", str(ws / "recipe.yaml"), f"output.dir={run}", "distributed.nproc_per_node=2",
           *overrides]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def test_ddp_ranks_skip_the_same_step(ws):
    run = ws / "ddp"
    proc = launch(ws, run)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = read_jsonl(run / "metrics.jsonl")
    skipped = [r for r in records if "nonfinite_step" in r]
    assert [r["nonfinite_step"] for r in skipped] == [2]
    assert len(skipped[0]["nonfinite_rows"]) == 4  # micro batch 2 x 2 ranks
    assert [r["step"] for r in records if "loss" in r] == [1, 3, 4]
    assert (run / "lineage.json").is_file()
    assert json.loads((run / "lineage.json").read_text())["summary"]["nonfinite_steps"] == 1


def test_deepspeed_stops_at_the_first_nonfinite_step_on_every_rank(ws):
    run = ws / "zero2"
    proc = launch(ws, run, "distributed.zero_stage=2")
    assert proc.returncode != 0
    assert proc.stderr.count("error: stopped at optimizer step 2") == 2, proc.stderr[-3000:]  # both ranks
    assert "Under DeepSpeed" in proc.stderr
    assert not (run / "lineage.json").exists()
