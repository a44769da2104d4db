"""`llmtune validate` and `llmtune sft` on tool conversations through the CLI, on a tiny random Llama."""

import json
import math

import pytest
import yaml
from safetensors.torch import load_file

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model
from llmtune.utils import read_jsonl

CALC = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


def _row(a: int, b: int) -> dict:
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}}
    return {"messages": [
        {"role": "user", "content": f"What is {a} * {b} + 1?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": str(a * b)},
        {"role": "assistant", "content": f"{a} * {b} + 1 = {a * b + 1}. #### {a * b + 1}"},
    ], "tools": [CALC]}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft_tools")
    model_dir = save_tiny_model(root / "model")
    rows = [_row(a, b) for a in range(2, 6) for b in range(3, 6)]  # 12 tool conversations
    (root / "tools.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "stage": "sft",
        "model": {"name_or_path": str(model_dir)},
        "data": {"datasets": [{"path": str(root / "tools.jsonl")}], "chat_template": "chatml_tools",
                 "max_length": 2048, "val_size": 2},
        "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2},
        "output": {"dir": str(root / "run")},
    }
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root


def test_validate_shows_a_tool_row_with_its_trained_tokens(workspace, capsys):
    assert main(["validate", str(workspace / "recipe.yaml")]) == 0
    out = capsys.readouterr().out
    assert "12 valid rows are tool conversations" in out
    shown = out[out.index("trained tokens between «»"):]
    assert "«<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": " in shown
    assert "</tool_call><|im_end|>»" in shown  # the call turn, through its end of turn
    assert "\n<|im_start|>user\n<tool_response>\n" in shown and "«<tool_response>" not in shown  # result: context
    assert "<tools>" in shown and "«<tools>" not in shown  # the tools block: context


def test_sft_trains_on_tool_conversations(workspace):
    assert main(["sft", str(workspace / "recipe.yaml")]) == 0
    run = workspace / "run"
    report = json.loads((run / "data_report.json").read_text())
    assert report["sources"][0]["tool_rows"] == 12 and report["train_rows"] == 10 and report["dropped"] == []
    assert 0 < report["trained_tokens"] < report["tokens"]
    losses = [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses)
    weights = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert any(v.abs().sum() > 0 for k, v in weights.items() if "lora_B" in k)  # lora_B starts at zero
    assert "<tool_call>" in (run / "adapter" / "chat_template.jinja").read_text()  # the template that renders tools
