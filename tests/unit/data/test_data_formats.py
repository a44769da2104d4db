"""Format adapters, column mapping, auto detection and bad-row reporting (LLaMA-Factory #4249)."""

from __future__ import annotations

import pytest

from llmtune.data import DataError, build_sft_data

X = -100
U = {"role": "user", "content": "Hello!"}
A = {"role": "assistant", "content": "I am fine."}

# Every kind of bad chat row, with its 0-based row index and the reason's kind.
BAD_CHAT = [
    ({"messages": [U, A]}, None),
    ({"conversation": [U, A]}, "missing field 'messages'"),
    ({"messages": [U, {"role": "assistant", "content": {"text": "hi"}}]}, "non-string content"),
    ({"messages": [U, {"role": "assistant", "content": "  "}]}, "empty response"),
    ({"messages": [U, U, A]}, "roles out of order"),
    ({"messages": [A, U, A]}, "roles out of order"),
    ({"messages": [U, A, U]}, "roles out of order"),
    ({"messages": [U, {"role": "bot", "content": "hi"}]}, "unknown role"),
    ({"messages": [U, {"role": "assistant"}]}, "missing field 'content'"),
    ({"messages": []}, "empty conversation"),
    ({"messages": [U, A, {"role": "system", "content": "late"}, A]}, "roles out of order"),
    ({"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]}, None),
]
REASONS = {
    1: "missing field 'messages'",
    2: "turn 1 (assistant) field 'content' must be a string, got an object",
    3: "empty response: assistant turn 1 is empty",
    4: "roles out of order: two user turns in a row (turns 0 and 1)",
    5: "roles out of order: the conversation starts with assistant (turn 0); expected user",
    6: "roles out of order: the last turn (2) is user; expected assistant",
    7: "turn 1 has unknown role 'bot' in field 'role'",
    8: "turn 1 lacks field 'content'",
    9: "field 'messages' is an empty list",
    10: "roles out of order: system message at turn 2; only turn 0 may be system",
}


def test_every_bad_row_kind_is_named_with_its_row_index(tok, write, cfg):
    path = write("chat.jsonl", [row for row, _ in BAD_CHAT])
    with pytest.raises(DataError) as info:
        build_sft_data(cfg(path), tok)
    msg = str(info.value)
    assert msg.startswith("10 bad row(s) (data.bad_rows: error)")
    for index, reason in REASONS.items():
        assert f"{path} row {index}: {reason}" in msg
    assert "data.bad_rows: skip" in msg


def test_skip_policy_counts_bad_rows_with_reasons(tok, write, cfg):
    path = write("chat.jsonl", [row for row, _ in BAD_CHAT])
    data = build_sft_data(cfg(path, bad_rows="skip"), tok)
    r = data.report
    assert r.train_rows == 2 and r.sources[0].rows_read == 12 and r.sources[0].rows_valid == 2
    assert [(d["row"], d["kind"]) for d in r.dropped] == [(i, kind) for i, (_, kind) in enumerate(BAD_CHAT) if kind]
    assert r.drop_counts() == {
        "roles out of order": 4, "missing field 'messages'": 1, "non-string content": 1, "empty response": 1,
        "unknown role": 1, "missing field 'content'": 1, "empty conversation": 1,
    }
    assert all(d["source"] == str(path) for d in r.dropped)


def test_alpaca_bad_rows(tok, write, cfg):
    rows = [
        {"instruction": "Add 2 and 3.", "output": "5"},
        {"instruction": "Add 2 and 3.", "output": {"answer": 5}},  # output is a JSON object
        {"instruction": "Add 2 and 3."},
        {"instruction": "Add 2 and 3.", "output": ""},
        {"instruction": 7, "output": "5"},
    ]
    path = write("alpaca.json", rows)
    with pytest.raises(DataError) as info:
        build_sft_data(cfg(path), tok)
    msg = str(info.value)
    assert "4 bad row(s)" in msg
    assert f"{path} row 1: field 'output' must be a string, got an object" in msg
    assert f"{path} row 2: missing field 'output'" in msg
    assert f"{path} row 3: empty response: field 'output' is empty" in msg
    assert f"{path} row 4: field 'instruction' must be a string, got a number" in msg


def test_more_than_ten_bad_rows_are_summarised(tok, write, cfg):
    path = write("a.jsonl", [{"instruction": "Hi", "output": ""}] * 25 + [{"instruction": "Hi", "output": "Hello"}])
    with pytest.raises(DataError) as info:
        build_sft_data(cfg(path), tok)
    msg = str(info.value)
    assert msg.startswith("25 bad row(s)") and "row 9: empty response" in msg and "row 10:" not in msg
    assert "... and 15 more" in msg


def test_all_rows_invalid_names_the_schema_problem(tok, write, cfg):
    path = write("x.json", [{"q": f"question {i}", "a": "answer"} for i in range(50)])
    with pytest.raises(DataError) as info:
        build_sft_data(cfg({"path": str(path), "format": "alpaca"}, bad_rows="skip"), tok)
    assert str(info.value).startswith(
        f"all 50 rows of {path} lack field 'instruction' (format alpaca) — columns found: q, a; map them with "
        "data.datasets[0].columns, e.g. {instruction: <your column>}"
    )
    path = write("y.json", [{"instruction": "question", "answer": "a"}] * 5)
    with pytest.raises(DataError, match=r"all 5 rows of .*y.json lack field 'output' \(format alpaca\) — columns found: instruction, answer"):
        build_sft_data(cfg({"path": str(path), "format": "alpaca"}), tok)


def test_undetectable_format_lists_columns(tok, write, cfg):
    path = write("x.json", [{"q": "question", "a": "answer"}])
    with pytest.raises(DataError, match=r"cannot detect the format of .*x.json from its first row \(columns: q, a\)"):
        build_sft_data(cfg(path), tok)


def test_a_misspelled_columns_key_is_named_not_undetectable(tok, write, cfg):
    """A DataConfig built without the recipe check (pipeline pairs steps): the data layer names the key too."""
    path = write("qa.jsonl", [{"question": "What is 2 + 3?", "answer": "It is 5."}])
    with pytest.raises(DataError) as info:
        build_sft_data(cfg({"path": str(path), "columns": {"instrution": "question", "output": "answer"}}), tok)
    assert str(info.value).startswith("data.datasets[0].columns.instrution: 'instrution' is not a canonical field; "
                                      "did you mean 'instruction' ({instruction: question})?")


def test_column_mapping_alpaca(tok, write, cfg):
    path = write("qa.jsonl", [{"question": "What is 2 + 3?", "answer": "It is 5."}])
    data = build_sft_data(cfg({"path": str(path), "columns": {"instruction": "question", "output": "answer"}}), tok)
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 5."}], tokenize=False
    )
    assert data.train[0]["input_ids"] == tok(expected, add_special_tokens=False).input_ids
    assert data.report.sources[0].format == "alpaca"


def test_column_mapping_messages_and_reversed_mapping_hint(tok, write, cfg):
    convo = [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "I am fine."}]
    path = write("c.jsonl", [{"conversations": convo}])
    mapped = build_sft_data(
        cfg({"path": str(path), "format": "messages", "columns": {"messages": "conversations", "role": "from", "content": "value"}}), tok
    )
    auto = build_sft_data(cfg(path), tok)  # detected as sharegpt
    assert auto.report.sources[0].format == "sharegpt"
    assert mapped.train[0] == auto.train[0]
    with pytest.raises(DataError, match=r"'question' not a field of format 'alpaca'.*e.g. \{instruction: question\}"):
        build_sft_data(cfg({"path": str(path), "format": "alpaca", "columns": {"question": "instruction"}}), tok)


def test_alpaca_input_and_system_and_system_prompt(tok, write, cfg):
    rows = [
        {"instruction": "Add.", "input": "2 + 3", "output": "5", "system": "Be exact."},
        {"instruction": "Add.", "input": "", "output": "5"},
    ]
    path = write("a.json", rows)
    data = build_sft_data(cfg({"path": str(path), "system_prompt": "Be nice."}, val_size=0), tok)
    texts = sorted(tok.decode(r["input_ids"]) for r in data.train)
    assert texts == [
        "<|im_start|>system\nBe exact.<|im_end|>\n<|im_start|>user\nAdd.\n\n2 + 3<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n",
        "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nAdd.<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n",
    ]


def test_prompt_completion_and_text_detected(tok, write, cfg):
    pc = write("pc.jsonl", [{"prompt": "2 + 3 =", "completion": " 5"}])
    text = write("t.jsonl", [{"text": "The sea is wide."}])
    data = build_sft_data(cfg(pc, text), tok)
    assert [s.format for s in data.report.sources] == ["prompt_completion", "text"]
    rows = {tuple(r["input_ids"]): r["labels"] for r in data.train}
    pc_ids = tok("2 + 3 =", add_special_tokens=False).input_ids
    c_ids = tok(" 5", add_special_tokens=False).input_ids
    assert rows[tuple(pc_ids + c_ids + [1])] == [X] * len(pc_ids) + c_ids + [1]
    with pytest.raises(DataError, match="system_prompt applies to chat formats"):
        build_sft_data(cfg({"path": str(text), "system_prompt": "Be nice."}), tok)
