"""builtin:gsm8k-calculator: GSM8K solutions as calculator tool conversations; drops counted with reasons; row ranges."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers.utils import get_json_schema

from llmtune.config.schema import DataConfig, DatasetConfig
from llmtune.data import build_prompt_data, build_sft_data, render_labels
from llmtune.data.cache import code_files
from llmtune.data.errors import RowError
from llmtune.data.gsm8k import BAD_ANNOTATION, NO_ANNOTATION, calculator_conversation, dependency_rounds
from llmtune.data.sources import read_source
from llmtune.tools import calculator

JANET = {
    "question": "Janet's ducks lay 16 eggs per day. How much does she make?",
    "answer": "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day.\n"
              "#### 18",
}


def calls(*expressions: str) -> list[dict]:
    return [{"type": "function", "function": {"name": "calculator", "arguments": {"expression": e}}}
            for e in expressions]


def result(value: str) -> dict:
    return {"role": "tool", "name": "calculator", "content": value}


def test_dependent_steps_are_rounds_with_computed_results():
    row = calculator_conversation(JANET)
    assert row == {
        "messages": [
            {"role": "user", "content": JANET["question"]},
            {"role": "assistant", "content": "", "tool_calls": calls("16-3-4")}, result("9"),
            {"role": "assistant", "content": "", "tool_calls": calls("9*2")}, result("18"),  # needs 9: next round
            {"role": "assistant", "content": "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\nShe makes 9 * 2 = $18 every "
                                             "day.\n#### 18"},
        ],
        "tools": [get_json_schema(calculator)],
    }


def test_independent_steps_share_a_turn_and_results_come_from_the_calculator():
    answer = ("Apples cost 0.1 * 3 = <<0.1*3=0.3>>0.3. Pears cost 4 * 4 = <<4*4=16>>16. Together 0.3 + 16 = "
              "<<0.3+16=16.3>>16.3.\n#### 16.3")
    row = calculator_conversation({"question": "How much?", "answer": answer})
    assert row["messages"][1:6] == [
        {"role": "assistant", "content": "", "tool_calls": calls("0.1*3", "4*4")},
        result("0.30000000000000004"), result("16"),  # what the tool returns, not the annotation's 0.3
        {"role": "assistant", "content": "", "tool_calls": calls("0.3+16")}, result("16.3"),
    ]
    assert row["messages"][-1]["content"] == "Apples cost 0.1 * 3 = 0.3. Pears cost 4 * 4 = 16. Together 0.3 + 16 = " \
                                             "16.3.\n#### 16.3"
    assert dependency_rounds([("2+2", "4", 4.0), ("3*3", "9", 9.0), ("4+9", "13", 13.0), ("13-1", "12", 12.0)]) == [
        1, 1, 2, 3]


@pytest.mark.parametrize("answer, kind, reason", [
    ("She has 3/4 = <<3/4=3/4>>3/4 left.\n#### 0.75", BAD_ANNOTATION,
     "annotation <<3/4=3/4>> is not <<expression=number>> (its value '3/4' is not a number)"),
    ("2 + 2 = <<2+2=5>>5\n#### 5", BAD_ANNOTATION, "annotation <<2+2=5>>: calculator('2+2') = 4, not 5"),
    ("x = <<abs(2)=2>>2\n#### 2", BAD_ANNOTATION, "annotation <<abs(2)=2>>: the calculator cannot evaluate 'abs(2)'"),
    ("No arithmetic here.\n#### 3", NO_ANNOTATION, "the solution has no <<expression=value>> annotation"),
])
def test_rows_that_cannot_become_conversations_are_policy_drops(answer, kind, reason):
    with pytest.raises(RowError) as info:
        calculator_conversation({"question": "Q?", "answer": answer})
    assert info.value.kind == kind and info.value.reason.startswith(reason) and info.value.bad is False


def test_the_shipped_file_gives_1300_conversations_and_names_every_drop():
    src = read_source(DatasetConfig(path="builtin:gsm8k-calculator"), 0)
    assert len(src.rows) == 1300 and src.format == "messages"
    kinds = {}
    for row_id, err in src.bad:
        kinds.setdefault(err.kind, []).append(row_id)
    assert {k: len(v) for k, v in kinds.items()} == {NO_ANNOTATION: 18, BAD_ANNOTATION: 1}
    assert kinds[BAD_ANNOTATION] == [319] and kinds[NO_ANNOTATION][:3] == [24, 88, 136]
    for row in src.rows:
        final = row["messages"][-1]["content"]
        assert "<<" not in final and final.split("#### ")[-1].strip()
        assert row["tools"] == [get_json_schema(calculator)]


def test_build_reports_drops_and_the_prompt_view_has_the_same_rows(tok, cfg):
    data = build_sft_data(cfg({"path": "builtin:gsm8k-calculator", "max_samples": 90}, chat_template="chatml_tools",
                              max_length=4096), tok)
    assert data.report.train_rows == 88 and data.report.sources[0].tool_rows == 88
    assert [(d["row"], d["kind"]) for d in data.report.dropped] == [(24, NO_ANNOTATION), (88, NO_ANNOTATION)]
    shown = render_labels(data.train[0]["input_ids"], data.train[0]["labels"], tok)
    assert "«<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": " in shown
    assert "<tool_response>\n" in shown and "«<tool_response>" not in shown and "#### " in shown.split("«")[-1]
    prompts = build_prompt_data(cfg({"path": "builtin:gsm8k-calculator", "max_samples": 90},
                                    chat_template="chatml_tools", max_length=4096), tok)
    assert prompts.report.train_rows == 88
    row = prompts.train[0]
    assert len(json.loads(row["messages"])) == 1 and row["reference"].split("#### ")[-1].strip().isdigit()


def test_sft_and_grpo_row_ranges_of_gsm8k_share_no_question(tok, cfg):
    sft = read_source(DatasetConfig(path="builtin:gsm8k-calculator", max_samples=1000), 0)
    grpo = build_prompt_data(DataConfig(datasets=[DatasetConfig(path="builtin:gsm8k", skip_rows=1000)],
                                        chat_template="chatml", val_size=100), tok)
    assert grpo.report.sources[0].skipped_rows == 1000 and grpo.report.sources[0].rows_read == 319
    questions = {row["messages"][0]["content"] for row in sft.rows}
    prompts = [json.loads(row["messages"])[-1]["content"] for split in (grpo.train, grpo.eval) for row in split]
    assert len(prompts) == 319 and not questions & set(prompts)


def test_the_calculator_is_part_of_the_data_code_fingerprint():
    """Its results and docstring (the schema) are in builtin:gsm8k-calculator's rows: an edit is a new cache entry."""
    assert Path(calculator.__code__.co_filename).resolve() in [p.resolve() for p in code_files()]
