"""SFT loss masks of tool conversations: every assistant turn (text + tool-call markup + end of turn) trained; the tools
block, tool results and the template's text around them not; the template refused when it cannot render tools."""

from __future__ import annotations

import json
import pytest

from llmtune.data import DataError, build_sft_data, render_labels
from llmtune.data.errors import RowError
from llmtune.data.templates import BUILTIN_TEMPLATES, CHATML_TOOLS, tool_render_problem
from llmtune.data.tokenize import SFTTokenizer

from tool_fixture import CALC, T3, TWO_ROUNDS, U, A2, AF  # noqa: E402

X = -100
TOOLS_BLOCK = (
    "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
    "provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + json.dumps(CALC) + "\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML "
    "tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
)
# TWO_ROUNDS rendered by chatml_tools, as (text, trained) pieces written out by hand.
PIECES = [
    (TOOLS_BLOCK + "<|im_start|>user\nWhat is 12 * 7 + 3?<|im_end|>\n<|im_start|>assistant\n", False),
    ("<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"e\": \"12 * 7\"}}\n</tool_call>\n"
     "<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"e\": \"1 + 2\"}}\n</tool_call><|im_end|>", True),
    ("\n<|im_start|>user\n<tool_response>\n84\n</tool_response>\n<tool_response>\n3\n</tool_response><|im_end|>\n"
     "<|im_start|>assistant\n", False),
    ("Now add.\n<tool_call>\n{\"name\": \"calc\", \"arguments\": {\"e\": \"84 + 3\"}}\n</tool_call><|im_end|>", True),
    ("\n<|im_start|>user\n<tool_response>\n87\n</tool_response><|im_end|>\n<|im_start|>assistant\n", False),
    ("It is 87.<|im_end|>", True),
    ("\n", False),
]


@pytest.fixture()
def tool_tok(tok):
    tok.chat_template = BUILTIN_TEMPLATES["chatml_tools"]
    return tok


def test_two_round_tool_conversation_exact_ids_and_labels(tool_tok):
    row = SFTTokenizer(tool_tok, 4096)({"messages": TWO_ROUNDS, "tools": [CALC]})
    ids, labels = [], []
    for text, trained in PIECES:
        piece = tool_tok(text, add_special_tokens=False).input_ids
        ids += piece
        labels += piece if trained else [X] * len(piece)
    assert row.input_ids == ids and row.labels == labels
    assert render_labels(row.input_ids, row.labels, tool_tok) == "".join(
        f"«{text}»" if trained else text for text, trained in PIECES)
    trained = tool_tok.decode([i for i, lab in zip(row.input_ids, row.labels) if lab != X])
    assert "\n84\n" not in trained and "tool_response" not in trained and "# Tools" not in trained  # results, tools
    assert trained.count("<tool_call>") == 3 and trained.count("<|im_end|>") == 3  # every assistant turn, its end
    assert "".join(text for text, _ in PIECES) == tool_tok.apply_chat_template(TWO_ROUNDS, tools=[CALC], tokenize=False)


def test_without_the_tools_column_no_tools_block(tool_tok):
    row = SFTTokenizer(tool_tok, 4096)({"messages": TWO_ROUNDS})
    text = render_labels(row.input_ids, row.labels, tool_tok)
    assert text.startswith("<|im_start|>user\nWhat is 12 * 7 + 3?") and "# Tools" not in text
    assert "«It is 87.<|im_end|>»" in text and "«<tool_call>" in text


def test_a_template_that_rewrites_earlier_tool_calls_is_not_prefix_consistent(tool_tok):
    # renders an assistant turn's tool calls only while it is the last message: history is rewritten
    tool_tok.chat_template = CHATML_TOOLS.replace("{%- for call in message.get('tool_calls') or [] %}",
                                                  "{%- for call in ((message.get('tool_calls') or []) if loop.last else []) %}")
    with pytest.raises(RowError, match="chat template is not prefix-consistent at assistant turn 1"):
        SFTTokenizer(tool_tok, 4096)({"messages": [U, A2, T3, AF], "tools": [CALC]})


def test_tool_rows_longer_than_max_length_are_dropped_not_cut(tool_tok, write, cfg):
    path = write("tools.jsonl", [{"messages": [U, A2, T3, AF], "tools": [CALC]},
                                 {"messages": [U, {"role": "assistant", "content": "It is 87."}]}])
    data = build_sft_data(cfg(path, chat_template="chatml_tools", max_length=64), tool_tok)
    assert [(d["row"], d["kind"]) for d in data.report.dropped] == [(0, "longer than max_length")]
    assert "with tools, rows are never cut" in data.report.dropped[0]["reason"]
    assert data.report.train_rows == 1 and data.report.truncated == 0


@pytest.mark.parametrize("template, missing", [
    ("chatml", "the tool schemas and the tool calls"),  # a tool turn renders as an <|im_start|>tool turn
    (None, "the tool schemas and the tool calls"),  # the tiny tokenizer's own ChatML
    (CHATML_TOOLS.replace("{{- tool | tojson }}", ""), "the tool schemas"),
])
def test_a_template_that_cannot_render_tools_is_one_error(tok, write, cfg, template, missing):
    path = write("tools.jsonl", [{"messages": TWO_ROUNDS, "tools": [CALC]}, {"messages": [U, AF]}])
    where = "data.chat_template" if template else "the tokenizer's chat template (data.chat_template: null)"
    with pytest.raises(DataError) as info:
        build_sft_data(cfg(path, chat_template=template, max_length=2048), tok)
    assert str(info.value) == (
        f"{where}: the chat template does not render {missing}, and 1 rows of data.datasets[0] ({path}) are tool "
        "conversations (tool calls, tool results or a tools column); set data.chat_template to a template that renders "
        "tools, tool calls and tool results, e.g. data.chat_template: chatml_tools (ChatML with Hermes/Qwen2.5 "
        "<tool_call> blocks), or the model family's own tool template.")


def test_rows_without_tools_need_no_tool_template(tok, write, cfg):
    path = write("chat.jsonl", [{"messages": [U, AF]}])
    assert build_sft_data(cfg(path, chat_template="chatml"), tok).report.train_rows == 1


def test_tool_render_problem(tok):
    assert tool_render_problem(tok) == "the chat template does not render the tool schemas and the tool calls"
    tok.chat_template = CHATML_TOOLS
    assert tool_render_problem(tok) is None
    tok.chat_template = "{{ raise_exception('no tools here') }}"
    assert tool_render_problem(tok).startswith("the chat template cannot render a conversation with tools")


def test_tool_rows_are_counted_in_the_report(tool_tok, write, cfg):
    path = write("tools.jsonl", [{"messages": TWO_ROUNDS, "tools": [CALC]}, {"messages": [U, AF]}])
    report = build_sft_data(cfg(path, chat_template="chatml_tools", max_length=2048), tool_tok).report
    assert report.sources[0].tool_rows == 1 and "1 valid rows are tool conversations" in report.summary()


def test_cache_key_changes_with_the_tools_column(tool_tok, write, cfg):
    from llmtune.data.cache import cache_key

    a = write("a.jsonl", [{"messages": TWO_ROUNDS, "tools": [CALC]}])
    other = {**CALC, "function": {**CALC["function"], "description": "Compute it."}}
    b = write("b.jsonl", [{"messages": TWO_ROUNDS, "tools": [other]}])
    keys = {cache_key("sft", cfg(p, chat_template="chatml_tools"), tool_tok, ".", {}) for p in (a, b)}
    assert len(keys) == 2 and None not in keys


def test_a_template_that_drops_the_called_tools_name_is_refused(tok, write, cfg):
    """Issue 39: a template that writes a call's arguments but not which tool it calls passed the probe (the name is
    in the schemas anyway); SFT tool data and agent rollouts would train calls the model cannot attribute."""
    nameless = CHATML_TOOLS.replace("""{"name": "' + call['name'] + '", "arguments": """, """{"arguments": """)
    assert nameless != CHATML_TOOLS
    tok.chat_template = nameless
    assert tool_render_problem(tok) == "the chat template does not render the names of the called tools"
    path = write("tools.jsonl", [{"messages": TWO_ROUNDS, "tools": [CALC]}])
    with pytest.raises(DataError, match="does not render the names of the called tools"):
        build_sft_data(cfg(path, max_length=2048), tok)
