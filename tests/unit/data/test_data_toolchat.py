"""Tool conversations as SFT rows and prompts: the canonical form, every bad-row kind, ShareGPT's function_call turns."""

from __future__ import annotations

import json

import pytest

from llmtune.config.schema import DatasetConfig
from llmtune.data import DataError, build_prompt_data, build_sft_data
from llmtune.data.formats import to_canonical
from llmtune.data.sources import read_source

from tool_fixture import A1, A2, AF, CALC, T1, T3, TWO_ROUNDS, U, call  # noqa: E402

U2 = {"role": "user", "content": "And then?"}
GOOD = {"messages": TWO_ROUNDS, "tools": [CALC]}
# Every kind of bad tool row (row index = position), with the exact reason it gets.
BAD_TOOL_ROWS = [
    (GOOD, None),
    ({"messages": [U, {"role": "assistant", "content": "Hmm."}, T1, AF]},
     "tool result without a tool call: turn 2 is a tool result, but the turn before it (1) is an assistant turn "
     "without tool_calls; a tool turn answers a call of the assistant turn just before it (or follows another result "
     "of it): give that assistant turn its tool_calls, or remove the tool turn"),
    ({"messages": [U, T1, AF]},
     "tool result without a tool call: turn 1 is a tool result, but the turn before it (0) is user;"),
    ({"messages": [U, A2, T1, T3, AF]},
     "more tool results than calls: assistant turn 1 makes 1 call(s) but turn 3 is tool result 2; give one tool "
     "turn per call"),
    ({"messages": [U, A1, T1, AF]},
     "fewer tool results than calls: assistant turn 1 makes 2 call(s) but 1 tool turn(s) follow it (turn 3 is "
     "assistant); give one tool turn per call, in order"),
    ({"messages": [U, A2, U2, AF]},
     "fewer tool results than calls: assistant turn 1 makes 1 call(s) but 0 tool turn(s) follow it (turn 2 is user)"),
    ({"messages": [U, {"role": "assistant", "content": "", "tool_calls": {"name": "calc"}}, T1, AF]},
     "turn 1 (assistant) 'tool_calls' must be a list of calls, got an object"),
    ({"messages": [U, {"role": "assistant", "content": "", "tool_calls": [{"function": {"arguments": {}}}]}, T1, AF]},
     "turn 1 (assistant) tool call 0 lacks a 'name' (a non-empty string naming the tool)"),
    ({"messages": [U, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": "e=1"}}]}, T1, AF]},
     "turn 1 (assistant) tool call 0 'arguments' is a string but not JSON"),
    ({"messages": [U, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calc", "arguments": ["1"]}}]}, T1, AF]},
     "turn 1 (assistant) tool call 0 'arguments' must be an object of argument name -> value (or a JSON string of "
     "one), got an array"),
    ({"messages": [U, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "search", "arguments": {}}}]}, T1, AF], "tools": [CALC]},
     "unknown tool: assistant turn 1 calls 'search', which is not in the row's 'tools' ('calc'); add its schema to "
     "'tools' or fix the call's name"),
    ({"messages": [U, A2, T3, AF], "tools": [{"type": "function", "function": {"description": "x"}}]},
     "field 'tools' item 0 has no 'name' (a non-empty string)"),
    ({"messages": [U, A2, T3, AF], "tools": {"name": "calc"}},
     "field 'tools' must be a list of JSON schemas, got an object"),
    ({"messages": [U, A2, {"role": "tool", "content": {"v": 87}}, AF]},
     "turn 2 (tool) field 'content' must be a string, got an object; write a structured result as its JSON text"),
    ({"messages": [U, A2, T3]}, "roles out of order: the last turn (2) is tool; expected assistant"),
    ({"messages": [U, {"role": "assistant", "content": "", "tool_calls": [call("1", id="c1")]},
                   {"role": "tool", "tool_call_id": "c2", "content": "1"}, AF]},
     "turn 2 (tool) answers tool_call_id 'c2', but the calls of assistant turn 1 have the ids 'c1'"),
    ({"messages": [{**U, "tool_calls": [call("1")]}, AF]}, "turn 0 is user but has 'tool_calls'"),
    ({"messages": [U, A2, T3, U2, AF]},
     "roles out of order: turn 3 is user, but the tool results before it (turns 2-2) must be answered by an "
     "assistant turn"),
    ({"messages": [U, {"role": "assistant", "content": " "}, AF]}, "roles out of order: two assistant turns in a row"),
]


@pytest.fixture()
def tool_cfg(cfg):
    return lambda *sources, **kw: cfg(*sources, chat_template="chatml_tools", max_length=2048, **kw)


def test_every_bad_tool_row_is_named_with_file_row_and_fix(tok, write, tool_cfg):
    path = write("tools.jsonl", [row for row, _ in BAD_TOOL_ROWS])
    with pytest.raises(DataError) as info:
        build_sft_data(tool_cfg(path), tok)
    msg = str(info.value)
    bad = [(i, reason) for i, (_, reason) in enumerate(BAD_TOOL_ROWS) if reason]
    assert msg.startswith(f"{len(bad)} bad row(s) (data.bad_rows: error)")
    lines = msg.splitlines()
    for index, reason in bad[:10]:  # the first 10 are listed, the rest counted
        assert any(line.startswith(f"  {path} row {index}: ") and reason in line for line in lines), (index, msg)
    assert f"... and {len(bad) - 10} more" in msg


def test_bad_tool_rows_are_counted_by_kind_under_skip(tok, write, tool_cfg):
    path = write("tools.jsonl", [row for row, _ in BAD_TOOL_ROWS])
    report = build_sft_data(tool_cfg(path, bad_rows="skip"), tok).report
    reasons = {d["row"]: d["reason"] for d in report.dropped}
    for index, (_, reason) in enumerate(BAD_TOOL_ROWS):
        assert (reason is None) == (index not in reasons)
        if reason:
            assert reason in reasons[index], index
    assert report.drop_counts() == {
        "malformed tool_calls": 5, "roles out of order": 3, "tool results do not match the calls": 3,
        "tool result without a tool call": 2, "malformed tools": 2, "unknown tool": 1, "non-string content": 1,
        "unknown tool_call_id": 1,
    }
    assert report.train_rows == 1 and report.sources[0].tool_rows == 1


def _canonical(write, rows, fmt="auto", kind="sft", **columns):
    path = write("rows.jsonl", rows)
    ds = DatasetConfig(path=str(path), format=fmt, columns=columns)
    _, valid, bad = to_canonical(read_source(ds, 0), ds, kind)
    assert not bad, bad
    return [row for _, row in valid]


def test_openai_and_bare_call_forms_read_into_transformers_form(write):
    openai = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{\"e\": \"12 * 7\"}"}}]}
    bare = {"role": "assistant", "content": "", "tool_calls": [{"name": "calc", "arguments": {"e": "12 * 7"}}]}
    result = {"role": "tool", "tool_call_id": "c1", "name": "calc", "content": "84"}
    rows = _canonical(write, [{"messages": [U, openai, result, AF], "tools": json.dumps([CALC["function"]])},
                              {"messages": [U, bare, result, AF]}])
    want_call = {"type": "function", "function": {"name": "calc", "arguments": {"e": "12 * 7"}}}
    assert rows[0] == {"messages": [U, {"role": "assistant", "content": "", "tool_calls": [{**want_call, "id": "c1"}]},
                                    result, AF],
                       "tools": [CALC]}  # a bare schema in a JSON string: the transformers form
    assert rows[1] == {"messages": [U, {"role": "assistant", "content": "", "tool_calls": [want_call]}, result, AF]}


def test_a_conversation_may_end_with_the_calls(write):
    rows = _canonical(write, [{"messages": [U, A2], "tools": [CALC]}])
    assert rows == [{"messages": [U, A2], "tools": [CALC]}]


def test_sharegpt_function_call_and_observation_turns(write):
    conversation = [
        {"from": "human", "value": U["content"]},
        {"from": "function_call", "value": json.dumps([{"name": "calc", "arguments": {"e": "12 * 7"}},
                                                       {"name": "calc", "arguments": {"e": "1 + 2"}}])},
        {"from": "observation", "value": "84"},
        {"from": "tool", "value": "3"},
        {"from": "gpt", "value": AF["content"]},
    ]
    rows = _canonical(write, [{"conversations": conversation, "functions": json.dumps([CALC])}], tools="functions")
    assert rows == [{"messages": [U, {**A1}, {"role": "tool", "content": "84"}, {"role": "tool", "content": "3"}, AF],
                     "tools": [CALC]}]


def test_sharegpt_function_call_that_is_not_json_is_a_bad_row(tok, write, tool_cfg):
    path = write("sg.jsonl", [{"conversations": [{"from": "human", "value": "hi"},
                                                 {"from": "function_call", "value": "calc(1)"},
                                                 {"from": "observation", "value": "1"},
                                                 {"from": "gpt", "value": "1"}]}])
    with pytest.raises(DataError, match=r"row 0: turn 1 \(function_call\) value is not JSON"):
        build_sft_data(tool_cfg(path), tok)


def test_tool_turns_in_preference_data_are_a_bad_row(tok, write, cfg):
    from llmtune.data import build_preference_data

    path = write("pairs.jsonl", [{"chosen": [U, A2, T3, AF], "rejected": [U, A2, T3, {**AF, "content": "88"}]}])
    with pytest.raises(DataError, match=r"row 0: 'chosen' turn 1 is a tool call or result \(role 'assistant'\); tool "
                                        r"conversations are read from formats messages and sharegpt \(SFT rows, "
                                        r"prompts\), not here"):
        build_preference_data(cfg(path), tok)


def test_prompt_view_of_a_tool_conversation(tok, write, cfg):
    """A tool conversation as a prompt ends with its last user turn; its final answer is the reference."""
    path = write("tools.jsonl", [GOOD, {"messages": [U, A2, T3, AF, U2, A2, T3, {**AF, "content": "Then 90."}]}])
    data = build_prompt_data(cfg(path, chat_template="chatml_tools", max_length=2048), tok, tools=[CALC])
    assert data.report.dropped == []
    prompts = {row["reference"]: json.loads(row["messages"]) for row in data.train}  # (shuffled by data.seed)
    assert prompts == {"It is 87.": [U], "Then 90.": [U, A2, T3, AF, U2]}
