"""Preference pairs: formats, HH prompts, bad pairs, shared prompt ids, truncation, collation (issue 3;
trl #2054, #1073, #3382, #976; LLaMA-Factory #4402)."""

from __future__ import annotations

import json

import pytest

from llmtune.config.schema import DatasetConfig
from llmtune.data import (
    DataError,
    PreferenceCollator,
    build_preference_data,
    build_sft_data,
    render_pair,
)
from llmtune.data.errors import RowError
from llmtune.data.formats import to_canonical
from llmtune.data.preference import PairTokenizer, TokenizedPair
from llmtune.data.sources import read_source
from llmtune.data.tokenize import RowTokenizer
from llmtune.models.tiny import make_tiny_tokenizer

X = -100
# "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n" with the tiny ChatML tokenizer (19 tokens).
PROMPT = [0, 90, 88, 267, 204, 45, 305, 84, 6, 1, 204, 0, 70, 88, 88, 386, 265, 89, 204]
FINE = [46, 262, 82, 282, 316, 74, 19, 1]  # I am fine.<|im_end|>   (trained)
FIVE = [46, 89, 286, 226, 26, 19, 1]  # It is 5.<|im_end|>
NL = 204  # the "\n" ChatML renders after <|im_end|>: in the sequence (the template's exact output), not trained
EXPECTED = {
    "chosen_input_ids": PROMPT + FINE + [NL], "chosen_labels": [X] * 19 + FINE + [X],
    "rejected_input_ids": PROMPT + FIVE + [NL], "rejected_labels": [X] * 19 + FIVE + [X],
    "prompt_length": 19,
}
U = {"role": "user", "content": "Hello!"}
A_FINE = {"role": "assistant", "content": "I am fine."}
A_FIVE = {"role": "assistant", "content": "It is 5."}
PAIR = {"prompt": "Hello!", "chosen": "I am fine.", "rejected": "It is 5."}


def _raw_tok(**kwargs):
    """Tiny tokenizer without a chat template: raw prompt + completion + EOS."""
    tok = make_tiny_tokenizer(**kwargs)
    tok.chat_template = None
    return tok


@pytest.mark.parametrize(
    ("fmt", "row", "columns"),
    [
        ("preference", PAIR, {}),
        ("preference", {"question": "Hello!", "good": "I am fine.", "bad": "It is 5."},
         {"prompt": "question", "chosen": "good", "rejected": "bad"}),
        ("preference_messages", {"chosen": [U, A_FINE], "rejected": [U, A_FIVE]}, {}),
        ("preference_messages", {"prompt": [U], "chosen": [A_FINE], "rejected": [A_FIVE]}, {}),
        ("preference_messages", {"prompt": "Hello!", "chosen": [A_FINE], "rejected": [A_FIVE]}, {}),
        ("hh", {"chosen": "\n\nHuman: Hello!\n\nAssistant: I am fine.", "rejected": "\n\nHuman: Hello!\n\nAssistant: It is 5."}, {}),
    ],
)
def test_each_format_gives_exact_ids_and_labels(tok, write, cfg, fmt, row, columns):
    data = build_preference_data(cfg({"path": str(write("p.jsonl", [row])), "columns": columns}), tok)
    assert data.report.sources[0].format == fmt  # auto-detected
    assert data.train[0] == EXPECTED
    assert data.report.kind == "preference" and data.report.tokens == 2 * 19 + 9 + 8 and data.report.trained_tokens == 15


def test_raw_strings_without_template_end_with_eos(write, cfg):
    tok = _raw_tok()
    row = build_preference_data(cfg(write("p.jsonl", [{"prompt": "What is 2 + 3?", "chosen": " 5", "rejected": " It is 5."}])), tok).train[0]
    assert row["chosen_input_ids"] == [368, 289, 286, 294, 330, 332, 36, 226, 26, 1]
    assert row["rejected_labels"] == [X] * 7 + [335, 89, 286, 226, 26, 19, 1]
    assert row["prompt_length"] == 7


def test_hh_prompt_extraction(assets):
    raw = read_source(DatasetConfig(path=str(assets / "hh_sample.jsonl")), 0)
    fmt, valid, bad = to_canonical(raw, DatasetConfig(path="x"), "preference")
    rows = dict(valid)
    assert fmt == "hh" and sorted(rows) == [0, 1, 3, 4, 5, 7]
    assert rows[4] == {
        "prompt": [
            {"role": "user", "content": "Why can’t you speak English?"},
            {"role": "assistant", "content": "I’m afraid I can’t. What’s English?"},
            {"role": "user", "content": "Exactly"},
        ],
        "chosen": "I don’t understand what you mean by this. Is there anything else I can help you with",
        "rejected": "Excuse me?",
    }
    assert rows[5]["chosen"] == "" and rows[5]["rejected"] == "Ok"  # an empty answer is a legitimate choice
    assert [(r, e.kind) for r, e in bad] == [(2, "prompt mismatch"), (6, "prompt mismatch")]


def test_hh_turns_of_one_speaker_are_joined(write, cfg, tok):
    text = "\n\nHuman: Hi\n\nAssistant: One.\n\nAssistant:  Two.\n\nHuman: And?\n\nAssistant: "
    raw = read_source(DatasetConfig(path=str(write("h.jsonl", [{"chosen": text + "Yes.", "rejected": text + "No."}]))), 0)
    _, valid, _ = to_canonical(raw, DatasetConfig(path="x"), "preference")
    assert valid == [(0, {
        "prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "One.\n\nTwo."},
                   {"role": "user", "content": "And?"}],
        "chosen": "Yes.", "rejected": "No.",
    })]


def test_empty_hh_answer_keeps_its_end_of_turn_token(assets, tok, cfg):
    data = build_preference_data(cfg(assets / "hh_sample.jsonl", bad_rows="skip", val_size=0), tok)
    p = tok("<|im_start|>user\nlist of profane bad words<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False).input_ids
    row = next(r for r in data.train if r["chosen_input_ids"][: len(p)] == p)
    assert row["chosen_input_ids"] == p + [1, NL] and row["chosen_labels"] == [X] * len(p) + [1, X]  # <|im_end|>
    assert row["prompt_length"] == len(p)


def test_bad_pairs_reported_with_row_index_under_both_policies(tok, assets, write, cfg):
    rows = [json.loads(line) for line in (assets / "hh_sample.jsonl").read_text().splitlines()]
    rows.append({"chosen": rows[0]["chosen"], "rejected": rows[0]["chosen"]})  # row 8: chosen == rejected
    path = write("hh.jsonl", rows)
    with pytest.raises(DataError) as info:
        build_preference_data(cfg(path), tok)
    msg = str(info.value)
    assert msg.startswith("3 bad row(s) (data.bad_rows: error)")
    assert (
        f"{path} row 2: chosen and rejected do not share a prompt: the transcripts before their last "
        "'\\n\\nAssistant:' differ from char 130 on" in msg
    )
    assert f"{path} row 6: chosen and rejected do not share a prompt" in msg and "differ from char 187 on" in msg
    assert f"{path} row 8: chosen equals rejected: the two completions are identical" in msg
    data = build_preference_data(cfg(path, bad_rows="skip"), tok)
    r = data.report
    assert [(d["row"], d["kind"]) for d in r.dropped] == [(2, "prompt mismatch"), (6, "prompt mismatch"), (8, "chosen equals rejected")]
    assert r.sources[0].rows_read == 9 and r.sources[0].rows_valid == 6 and r.train_rows == 6


def test_bad_pairs_in_message_and_string_formats(tok, write, cfg):
    other = {"role": "assistant", "content": "Hi."}
    rows = [
        {"chosen": [U, A_FINE], "rejected": [U, A_FIVE]},
        {"chosen": [U, A_FINE, U, A_FINE], "rejected": [U, other, U, A_FIVE]},
        {"chosen": [U, A_FINE], "rejected": [U, A_FINE]},
        {"chosen": [U, A_FINE], "rejected": [U]},
    ]
    data = build_preference_data(cfg(write("m.jsonl", rows), bad_rows="skip"), tok)
    assert [(d["row"], d["kind"], d["reason"]) for d in data.report.dropped] == [
        (1, "prompt mismatch", "chosen and rejected do not share a prompt: the turns before their final assistant "
                               "turn differ from turn 1 on (3 prompt turns in 'chosen', 3 in 'rejected')"),
        (2, "chosen equals rejected", "chosen equals rejected: the two completions are identical, so the pair prefers nothing"),
        (3, "roles out of order", "roles out of order: the last turn of 'rejected' is user; expected the assistant completion"),
    ]
    strings = [PAIR, {"prompt": "Hello!", "chosen": "Same.", "rejected": "Same."}]
    with pytest.raises(DataError, match=r"s.jsonl row 1: chosen equals rejected"):
        build_preference_data(cfg(write("s.jsonl", strings)), tok)


def test_prompt_ids_identical_and_first_trained_index_is_prompt_length(tok, assets, cfg):
    data = build_preference_data(cfg(assets / "hh_sample.jsonl", bad_rows="skip", val_size=2), tok)
    assert len(data.train) == 4 and len(data.eval) == 2
    for row in [*data.train, *data.eval]:
        p = row["prompt_length"]
        assert row["chosen_input_ids"][:p] == row["rejected_input_ids"][:p]
        for side in ("chosen", "rejected"):
            labels = row[f"{side}_labels"]
            ids = row[f"{side}_input_ids"]
            assert labels[:p] == [X] * p and labels[p] != X and labels[p:] == ids[p:-1] + [X] and ids[-1] == NL


def test_boundary_merge_raw_prompt_is_tokenized_once(write, cfg):
    tok = _raw_tok()
    path = write("raw.jsonl", [{"prompt": "The sea is ", "chosen": "wide.", "rejected": "It is 5."}])
    row = build_preference_data(cfg(path), tok).train[0]
    naive = tok("The sea is wide.", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(naive) == ["The", "Ġsea", "Ġis", "Ġw", "ide", "."]  # "Ġw" merges across (trl #2054)
    assert row["chosen_input_ids"] == [287, 350, 286, 226, 92, 387, 19, 1]  # "The sea is " + "wide." + EOS
    assert row["chosen_input_ids"][:-1] != naive
    assert row["prompt_length"] == 4 and row["rejected_input_ids"][:4] == row["chosen_input_ids"][:4] == [287, 350, 286, 226]
    assert row["chosen_labels"] == [X] * 4 + [92, 387, 19, 1]


def test_boundary_merge_with_a_template_whose_generation_prompt_ends_in_a_space(tok):
    """The sequence is the template's output tokenized whole (as apply_chat_template does): "A: The" merges into
    "ĠThe", so the shared prompt ends before the space and the merged token is the first trained one."""
    tok.chat_template = BOUNDARY_MERGE
    pair = PairTokenizer(tok, 64)({"prompt": "How many?", "chosen": "The answer is 42.", "rejected": "Ten."})
    whole = tok("Q: How many?\nA: The answer is 42.<|im_end|>\n", add_special_tokens=False).input_ids
    assert pair.prompt_ids + pair.chosen_ids == whole
    assert pair.prompt_ids == tok("Q: How many?\nA:", add_special_tokens=False).input_ids
    assert tok.convert_ids_to_tokens(pair.chosen_ids) == ["ĠThe", "Ġa", "nswer", "Ġis", "Ġ4", "2", ".", "<|im_end|>",
                                                          "Ċ"]
    assert (pair.chosen_tail, pair.rejected_tail) == (1, 1)


@pytest.mark.parametrize(
    ("mode", "prompt"),
    [("keep_end", [0, 70, 88, 88, 386, 265, 89, 204]), ("keep_start", [0, 90, 88, 267, 204, 45, 305, 84])],
)
def test_truncation_modes_exact(tok, mode, prompt):
    fn = PairTokenizer(tok, 12, max_prompt_length=8, truncation_mode=mode)
    # 19 prompt tokens cut to 8; chosen 8 -> 4 and rejected 7 -> 3 tokens: 11 prompt and 7 completion tokens cut
    # 19 prompt tokens cut to 8; chosen 9 -> 4 and rejected 8 -> 4 tokens ("\n" tails cut first): 11 + 9 cut
    assert fn(PAIR) == TokenizedPair(prompt, [46, 262, 82, 282], [46, 89, 286, 226], truncated=True,
                                     prompt_tokens_cut=11, response_tokens_cut=9)
    row = fn(PAIR).to_row()
    assert len(row["chosen_input_ids"]) == len(row["rejected_input_ids"]) == 12 and row["prompt_length"] == 8
    assert PairTokenizer(tok, 40, max_prompt_length=8, truncation_mode=mode)(PAIR) == TokenizedPair(
        prompt, FINE + [NL], FIVE + [NL], True, 11, 0, 1, 1)
    assert PairTokenizer(tok, 40, max_prompt_length=19)(PAIR) == TokenizedPair(PROMPT, FINE + [NL], FIVE + [NL], False,
                                                                               0, 0, 1, 1)
    # a cut that removes the "\n" only: nothing trained is lost, the tail count follows
    assert PairTokenizer(tok, 27, max_prompt_length=19)(PAIR) == TokenizedPair(PROMPT, FINE, FIVE + [NL], True,
                                                                               0, 1, 0, 1)


def test_keep_end_keeps_the_bos_first():
    tok = make_tiny_tokenizer("llama2", add_bos=True)  # its template renders <s> (id 2) once
    full = PairTokenizer(tok, 64)(PAIR).prompt_ids
    assert full[0] == 2 and full.count(2) == 1
    assert PairTokenizer(tok, 64, 5)(PAIR).prompt_ids == [2, *full[-4:]]
    assert PairTokenizer(tok, 64, 5, "keep_start")(PAIR).prompt_ids == full[:5]


def test_pairs_whose_prompt_fills_max_length_keep_their_completions_and_are_counted(write, cfg):
    tok = _raw_tok()
    long = {"prompt": "The sea is wide. " * 3, "chosen": "Yes.", "rejected": "No."}
    short = {"prompt": "The sea is ", "chosen": "wide.", "rejected": "It is 5."}
    path = write("t.jsonl", [long, short])
    assert len(tok(long["prompt"]).input_ids) == 19
    data = build_preference_data(cfg(path, max_length=10), tok)
    r = data.report
    # old code: the long pair was dropped ("prompt fills max_length"). Now max_prompt_length null cuts its prompt to
    # 10 - min(4, 10 // 2) = 6 tokens (its end) and keeps both 4-token completions whole.
    assert r.dropped == [] and r.train_rows == 2
    long_row = next(row for row in data.train if row["prompt_length"] == 6)
    assert long_row["chosen_input_ids"] == [350, 286, 336, 387, 19, 226, 62, 268, 19, 1]
    # short pair: 4 prompt tokens + "It is 5." (6 ids + EOS) cut to 6: 1 completion token cut (EOS), "wide." fits
    assert r.truncated_rows == [{"source": str(path), "row": 0, "prompt_tokens_cut": 13, "response_tokens_cut": 0},
                                {"source": str(path), "row": 1, "prompt_tokens_cut": 0, "response_tokens_cut": 1}]
    short_row = next(row for row in data.train if row["prompt_length"] == 4)
    assert short_row["rejected_input_ids"] == [287, 350, 286, 226, 46, 89, 286, 226, 26, 19]  # cut at the end, no EOS
    kept = build_preference_data(cfg(path, max_length=10, max_prompt_length=6), tok)
    assert kept.report.dropped == [] and kept.report.truncated == 2
    assert all(X not in row["chosen_labels"][row["prompt_length"]:] and len(row["chosen_input_ids"]) <= 10 for row in kept.train)
    dropped = build_preference_data(cfg(path, max_length=11, truncation="drop"), tok)  # short pair: 4 + 7 tokens
    assert [(d["row"], d["kind"]) for d in dropped.report.dropped] == [(0, "longer than max_length")]
    assert dropped.report.truncated == 0 and dropped.train[0]["rejected_input_ids"][-1] == 1
    with pytest.raises(DataError, match="no training rows left after tokenization"):
        build_preference_data(cfg(path, max_length=10, truncation="drop"), tok)


def test_collator_stacks_chosen_over_rejected_with_padding_by_position(tok, write, cfg):
    rows = [PAIR, {"prompt": "What is 2 + 3?", "chosen": "It is 5.", "rejected": "I am fine."}]
    data = build_preference_data(cfg(write("p.jsonl", rows)), tok)
    pairs = sorted(data.train, key=lambda r: r["prompt_length"])
    batch = PreferenceCollator(tok)(pairs)
    seqs = [p["chosen_input_ids"] for p in pairs] + [p["rejected_input_ids"] for p in pairs]
    labels = [p["chosen_labels"] for p in pairs] + [p["rejected_labels"] for p in pairs]
    T = max(map(len, seqs))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (4, T) == (4, 31)
    assert seqs[0] == PROMPT + FINE + [NL] and seqs[2] == PROMPT + FIVE + [NL]  # rows 0..B-1 chosen, then rejected
    for b, (ids, labs) in enumerate(zip(seqs, labels)):
        n = len(ids)
        assert batch["input_ids"][b].tolist() == ids + [1] * (T - n)  # pad id 1 == <|im_end|> == EOS
        assert batch["labels"][b].tolist() == labs + [X] * (T - n)
        assert batch["attention_mask"][b].tolist() == [1] * n + [0] * (T - n)
        assert labs[-2:] == [1, X]  # the real EOS keeps its label although it equals the pad id (trl #976)
    with pytest.raises(ValueError, match="empty batch"):
        PreferenceCollator(tok)([])


def test_missing_eos_or_bos_is_a_setup_error(write, cfg):
    tok = make_tiny_tokenizer()
    tok.eos_token = None
    with pytest.raises(DataError, match=r"has no EOS token \(eos_token is None\)"):
        build_preference_data(cfg("does-not-exist.jsonl"), tok)  # raised before any data is read
    tok = make_tiny_tokenizer("llama2")  # its template renders {{ bos_token }}
    tok.bos_token = None
    with pytest.raises(DataError, match=r"renders bos_token, but the tokenizer has no BOS token"):
        PairTokenizer(tok, 64)
    with pytest.raises(DataError, match="max_prompt_length=64 must be below data.max_length=64"):
        PairTokenizer(make_tiny_tokenizer(), 64, 64)


def test_kinds_do_not_mix(tok, write, cfg):
    alpaca = write("a.jsonl", [{"instruction": "Add 2 and 3.", "output": "5"}])
    with pytest.raises(DataError, match="cannot detect a preference format"):
        build_preference_data(cfg(alpaca), tok)
    with pytest.raises(DataError, match=r"\.format: 'alpaca' is SFT rows, but this stage needs preference pairs"):
        build_preference_data(cfg({"path": str(alpaca), "format": "alpaca"}), tok)
    with pytest.raises(DataError, match=r"chosen/rejected pairs are preference data"):
        build_sft_data(cfg(write("p.jsonl", [PAIR])), tok)
    with pytest.raises(DataError, match="packing does not apply"):
        build_preference_data(cfg(write("q.jsonl", [PAIR]), packing=True), tok)
    messages = write("m.jsonl", [{"chosen": [U, A_FINE], "rejected": [U, A_FIVE]}])
    with pytest.raises(DataError, match="has no chat template"):
        build_preference_data(cfg(messages), _raw_tok())


def test_mixing_max_samples_and_split_are_shared_with_sft(tok, write, cfg):
    a = write("a.jsonl", [{"prompt": f"apples {i}", "chosen": "Yes.", "rejected": "No."} for i in range(6)])
    b = write("b.jsonl", [{"prompt": f"oranges {i}", "chosen": "Yes.", "rejected": "No."} for i in range(6)])
    runs = [build_preference_data(cfg({"path": str(a), "weight": 2}, b, val_size=3), tok) for _ in range(2)]
    assert runs[0].train["chosen_input_ids"] == runs[1].train["chosen_input_ids"]
    train, held = ({tok.decode(ids) for ids in split["chosen_input_ids"]} for split in (runs[0].train, runs[0].eval))
    assert len(held) == len(runs[0].eval) == 3 and not train & held  # a repeated pair never sits in both splits
    repeats_held = sum(2 if "apples" in text else 1 for text in held)
    assert runs[0].report.train_rows == len(runs[0].train) == 18 - repeats_held  # 2 x 6 + 6 entries
    capped = build_preference_data(cfg(a, b, max_samples=5, val_size=1), tok)
    assert len(capped.train) == 4 and len(capped.eval) == 1


def test_render_pair_marks_both_completions(tok, write, cfg):
    row = build_preference_data(cfg(write("p.jsonl", [PAIR])), tok).train[0]
    assert render_pair(row, tok) == (
        "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n\n"
        "[chosen]   «I am fine.<|im_end|>»\n\n[rejected] «It is 5.<|im_end|>»\n"
    )


def test_pairs_survive_worker_processes(tok):
    rows = [PAIR, {**PAIR, "prompt": ""}] * 4
    with RowTokenizer(PairTokenizer(_raw_tok(), 64), num_proc=2) as tok_rows:  # pickled to workers and back
        out = list(tok_rows.map(rows))
    assert [getattr(r, "kind", "") for r in out] == ["", "empty prompt"] * 4
    assert out[0] == out[6] == PairTokenizer(_raw_tok(), 64)(PAIR) and isinstance(out[0], TokenizedPair)
    with pytest.raises(RowError, match="the prompt has no tokens"):
        PairTokenizer(_raw_tok(), 64)({**PAIR, "prompt": ""})


def test_truncation_keep_system_keeps_the_system_message_of_a_cut_prompt(tok):
    system = [0, 88, 94, 291, 313, 204, 39, 74, 226, 83, 78, 72, 74, 19, 1, 204]  # <|im_start|>system\nBe nice.<|im_end|>\n
    pair = {"prompt": [{"role": "system", "content": "Be nice."}, U], "chosen": "I am fine.", "rejected": "It is 5."}
    kept = PairTokenizer(tok, 40, max_prompt_length=24, keep_system=True)(pair)  # 16 + 19 prompt tokens cut to 24
    assert kept.prompt_ids == system + PROMPT[-8:] and kept.prompt_tokens_cut == 11
    plain = PairTokenizer(tok, 40, max_prompt_length=24)(pair)  # default: the BOS, then the end
    assert plain.prompt_ids == [0] + (system + PROMPT)[-23:]
    with pytest.raises(RowError, match="the BOS and system message alone take 16"):
        PairTokenizer(tok, 40, max_prompt_length=16, keep_system=True)(pair)


BOUNDARY_MERGE = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ 'Q: ' + m['content'] + '\nA: ' }}"
                  "{% else %}{{ m['content'] + eos_token + '\n' }}{% endif %}{% endfor %}")


def _template_tokenizer(template: str, add_bos: bool):
    tok = make_tiny_tokenizer("llama2" if template == "llama2" else "chatml", add_bos=add_bos)
    if template == "boundary merge":
        tok.chat_template = BOUNDARY_MERGE
    return tok


@pytest.mark.parametrize("template", ["chatml", "boundary merge", "llama2"])
@pytest.mark.parametrize("add_bos", [False, True])
def test_every_pair_stage_trains_on_the_templates_exact_output(template, add_bos):
    """Issue 21 bug 4: one rendering for RM, DPO, ORPO, SimPO (pairs) and KTO (rows): each sequence is
    apply_chat_template(conversation, tokenize=False) tokenized (add_special_tokens=False, as tokenize=True does),
    the text after the end-of-turn included (ChatML "\\n"; none for llama2), even where the answer merges with
    the generation prompt. Trained: the answer through its end-of-turn token; the "\\n" after it is not."""
    from llmtune.data.unpaired import UnpairedTokenizer

    tok = _template_tokenizer(template, add_bos)
    row = {"prompt": "How many?", "chosen": "The answer is 42.", "rejected": "Ten."}
    messages = [{"role": "user", "content": row["prompt"]}]
    pair = PairTokenizer(tok, 64)(row).to_row()
    kto = [r for result in (UnpairedTokenizer(PairTokenizer(tok, 64))(row),
                            UnpairedTokenizer(PairTokenizer(tok, 64))({"prompt": row["prompt"],
                                                                       "completion": row["chosen"], "label": True}))
           for r in result.to_rows(0, result, 64, 1)]
    end_of_turn = {"chatml": "<|im_end|>", "boundary merge": "<|im_end|>", "llama2": "</s>"}[template]
    for side, ids, labels in (("chosen", pair["chosen_input_ids"], pair["chosen_labels"]),
                              ("rejected", pair["rejected_input_ids"], pair["rejected_labels"]),
                              ("chosen", kto[0]["input_ids"], kto[0]["labels"]),
                              ("rejected", kto[1]["input_ids"], kto[1]["labels"]),
                              ("chosen", kto[2]["input_ids"], kto[2]["labels"])):
        conversation = [*messages, {"role": "assistant", "content": row[side]}]
        text = tok.apply_chat_template(conversation, tokenize=False)
        assert ids == tok(text, add_special_tokens=False).input_ids  # old code (DPO/KTO): no trailing "\\n"
        assert ids == list(tok.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"])
        tokens = tok.convert_ids_to_tokens(ids)
        trained = [t for t, label in zip(tokens, labels) if label != X]
        assert trained[-1] == end_of_turn and tok.convert_tokens_to_string(trained).strip().startswith(row[side][:3])
        if template == "llama2":
            assert tokens[-1] == "</s>" and labels[-1] == ids[-1]  # nothing after the turn: all of it trained
        else:
            assert tokens[-2:] == ["<|im_end|>", "Ċ"] and labels[-2:] == [ids[-2], X]
    assert pair["chosen_input_ids"][: pair["prompt_length"]] == pair["rejected_input_ids"][: pair["prompt_length"]]
    assert kto[0]["input_ids"] == pair["chosen_input_ids"] and kto[0]["labels"] == pair["chosen_labels"]


def test_pairs_are_truncated_with_the_template_tail_cut_first(tok):
    row = {"prompt": "Hello! " * 20, "chosen": "I am fine. " * 20, "rejected": "No."}
    rm = PairTokenizer(tok, 40, max_prompt_length=16)(row)
    assert rm.truncated and len(rm.prompt_ids) == 16 and len(rm.prompt_ids) + len(rm.chosen_ids) == 40
    assert rm.prompt_ids[0] == tok.bos_token_id  # keep_end keeps the BOS first
    assert tok.convert_ids_to_tokens(rm.rejected_ids)[-2:] == ["<|im_end|>", "Ċ"]
