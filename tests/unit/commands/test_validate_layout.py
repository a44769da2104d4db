"""`llmtune validate` prints the batch layout of the launch the recipe describes (issue 32): micro x accumulation x
ranks with ranks = distributed.nproc_per_node x nnodes, not the one process validate itself runs in."""

import json

import pytest
import yaml

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model

ROWS = [{"messages": [{"role": "user", "content": f"What is {i} + 2?"},
                      {"role": "assistant", "content": f"It is {i + 2}."}]} for i in range(64)]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    save_tiny_model(root / "model")
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return root


def validate_out(ws, capsys, monkeypatch, distributed: dict, env: dict | None = None) -> str:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    path = ws / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "stage": "sft", "model": {"name_or_path": str(ws / "model")},
        "data": {"datasets": [{"path": str(ws / "data.jsonl")}], "max_length": 64},
        "adapter": {"lora_r": 4, "lora_alpha": 8},
        "train": {"micro_batch_size": 2, "global_batch_size": 32, "max_steps": 2},
        "distributed": distributed, "output": {"dir": str(ws / "run")}}))
    assert main(["validate", str(path)]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("batch:"))


@pytest.mark.parametrize("distributed, layout", [
    ({"nproc_per_node": 4, "nnodes": 2}, "2 micro x 2 accumulation x 8 ranks (4 per node x 2 nodes"),
    ({"nproc_per_node": 8}, "2 micro x 2 accumulation x 8 ranks (8 per node x 1 node:"),
    ({}, "2 micro x 16 accumulation x 1 ranks (1 per node x 1 node:"),
])
def test_validate_prints_the_recipes_layout(ws, capsys, monkeypatch, distributed, layout):
    line = validate_out(ws, capsys, monkeypatch, distributed)
    assert line.startswith(f"batch: 32 samples/optimizer step = {layout}"), line


def test_validate_layout_ignores_the_environment_it_runs_in(ws, capsys, monkeypatch):
    """Run inside some launcher's environment (WORLD_SIZE=4): still the recipe's 8 ranks."""
    line = validate_out(ws, capsys, monkeypatch, {"nproc_per_node": 4, "nnodes": 2},
                        env={"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"})
    assert "2 micro x 2 accumulation x 8 ranks" in line, line
