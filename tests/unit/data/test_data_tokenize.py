"""Loss masks with exact expected labels (trl #598, #976, #1400, #1623; LLaMA-Factory #3995)."""

from __future__ import annotations

import pytest

from llmtune.data import SFTCollator, build_sft_data, render_labels
from llmtune.data.errors import RowError
from llmtune.data.tokenize import SFTTokenizer
from llmtune.models.tiny import make_tiny_tokenizer

from chat_fixture import CHAT  # noqa: E402
X = -100
# CHAT rendered with ChatML by the tiny tokenizer (74 tokens); ids checked against the token strings below.
CHATML_IDS = [
    0, 88, 94, 291, 313, 204, 39, 74, 226, 83, 78, 72, 74, 19, 1, 204,   # <|im_start|>system\nBe nice.<|im_end|>\n
    0, 90, 88, 267, 204, 45, 305, 84, 6, 1, 204,                          # <|im_start|>user\nHello!<|im_end|>\n
    0, 70, 88, 88, 386, 265, 89, 204,                                     # <|im_start|>assistant\n
    46, 262, 82, 282, 316, 74, 19, 1,                                     # I am fine.<|im_end|>   (trained)
    204,                                                                  # \n
    0, 90, 88, 267, 204, 368, 289, 286, 294, 330, 332, 36, 1, 204,        # <|im_start|>user\nWhat is 2 + 3?<|im_end|>\n
    0, 70, 88, 88, 386, 265, 89, 204,                                     # <|im_start|>assistant\n
    46, 89, 286, 226, 26, 19, 1,                                          # It is 5.<|im_end|>      (trained)
    204,                                                                  # \n
]
CHATML_LABELS = [X] * 35 + [46, 262, 82, 282, 316, 74, 19, 1] + [X] * 23 + [46, 89, 286, 226, 26, 19, 1] + [X]


def trained_tokens(tokenizer, row) -> list[str]:
    return [tokenizer.convert_ids_to_tokens(i) for i, lab in zip(row.input_ids, row.labels) if lab != X]


def test_chatml_multi_turn_exact_labels(tok):
    row = SFTTokenizer(tok, 512)({"messages": CHAT})
    assert row.input_ids == CHATML_IDS
    assert row.labels == CHATML_LABELS
    assert trained_tokens(tok, row) == ["I", "Ġa", "m", "Ġf", "in", "e", ".", "<|im_end|>", "I", "t", "Ġis", "Ġ", "5", ".", "<|im_end|>"]
    assert render_labels(row.input_ids, row.labels, tok) == (
        "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
        "«I am fine.<|im_end|>»\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n«It is 5.<|im_end|>»\n"
    )
    # Segment-wise tokenization equals whole-text tokenization here (no merge crosses a span boundary).
    assert row.input_ids == tok(tok.apply_chat_template(CHAT, tokenize=False), add_special_tokens=False).input_ids


def test_train_on_all_trains_every_token(tok):
    row = SFTTokenizer(tok, 512, train_on="all")({"messages": CHAT})
    assert row.input_ids == CHATML_IDS and row.labels == CHATML_IDS


def test_pad_equals_eos_keeps_final_eos_label(tok):
    assert tok.pad_token_id == tok.eos_token_id == 1
    fn = SFTTokenizer(tok, 512)
    long_row, short_row = fn({"messages": CHAT}), fn({"messages": CHAT[1:3]})
    rows = [{"input_ids": r.input_ids, "labels": r.labels} for r in (short_row, long_row)]
    batch = SFTCollator(tok)(rows)
    n = len(short_row.input_ids)
    assert short_row.input_ids[-2:] == [1, 204] and short_row.labels[-2:] == [1, X]
    assert batch["input_ids"].shape == (2, 74)
    assert batch["labels"][0, :n].tolist() == short_row.labels  # real <|im_end|> label (id 1 == pad) kept
    assert batch["labels"][0, n:].tolist() == [X] * (74 - n)  # padding (also id 1) never trained
    assert batch["input_ids"][0, n:].tolist() == [1] * (74 - n)
    assert batch["attention_mask"][0].tolist() == [1] * n + [0] * (74 - n)
    assert batch["labels"][1].tolist() == CHATML_LABELS


def test_text_gets_exactly_one_trained_eos(tok):
    fn = SFTTokenizer(tok, 64)
    plain = fn({"text": "The sea is wide."})
    assert tok.convert_ids_to_tokens(plain.input_ids) == ["The", "Ġsea", "Ġis", "Ġw", "ide", ".", "<|im_end|>"]
    assert plain.labels == plain.input_ids  # all trained, EOS included (trl #1623)
    with_eos = fn({"text": "The sea is wide.<|im_end|>"})  # already ends with EOS: not doubled
    assert with_eos.input_ids == plain.input_ids and with_eos.labels == plain.labels


def test_prompt_completion_raw_prompt_untrained(tok):
    row = SFTTokenizer(tok, 64)({"prompt": "What is 2 + 3?", "completion": " It is 5."})
    prompt_ids = tok("What is 2 + 3?", add_special_tokens=False).input_ids
    completion_ids = tok(" It is 5.", add_special_tokens=False).input_ids
    assert row.input_ids == prompt_ids + completion_ids + [1]
    assert row.labels == [X] * len(prompt_ids) + completion_ids + [1]
    assert tok.convert_ids_to_tokens(completion_ids) == ["ĠI", "t", "Ġis", "Ġ", "5", "."]


def test_llama2_template_with_add_bos_tokenizer_has_one_bos():
    tok = make_tiny_tokenizer("llama2", add_bos=True)
    assert tok("x").input_ids == [2, 93]  # this tokenizer adds <s> by itself
    row = SFTTokenizer(tok, 512)({"messages": CHAT[1:]})  # the template renders "<s>" itself (trl #1400)
    assert row.input_ids[0] == 2 and row.input_ids.count(2) == 1
    assert trained_tokens(tok, row) == ["ĠI", "Ġa", "m", "Ġf", "in", "e", ".", "</s>", "ĠI", "t", "Ġis", "Ġ", "5", ".", "</s>"]
    assert row.labels[0] == X


def test_bos_prepended_once_when_template_renders_none():
    tok = make_tiny_tokenizer("llama2", add_bos=True)
    tok.chat_template = make_tiny_tokenizer("chatml").chat_template  # renders no <s>
    row = SFTTokenizer(tok, 512)({"messages": CHAT[1:3]})
    assert row.input_ids[:2] == [2, 0] and row.input_ids.count(2) == 1 and row.labels[:2] == [X, X]
    text = SFTTokenizer(tok, 64)({"text": "The sea is wide."})
    assert tok.convert_ids_to_tokens(text.input_ids) == ["<s>", "The", "Ġsea", "Ġis", "Ġw", "ide", ".", "</s>"]
    assert text.labels == [X, 287, 350, 286, 336, 387, 19, 3]
    no_double = SFTTokenizer(tok, 64)({"text": "<s>The sea is wide."})
    assert no_double.input_ids == text.input_ids


def test_span_exact_when_bpe_merges_across_the_boundary(tok):
    # The generation prompt ends with a space; in context BPE merges it with the answer ("ĠThe", trl #598).
    tok.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}{{ 'Q: ' + m['content'] + '\nA: ' }}"
        "{% else %}{{ m['content'] + eos_token + '\n' }}{% endif %}{% endfor %}"
    )
    messages = [{"role": "user", "content": "How many?"}, {"role": "assistant", "content": "The answer is 42."}]
    whole = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False).input_ids
    assert "ĠThe" in tok.convert_ids_to_tokens(whole)  # the merge really happens in context
    row = SFTTokenizer(tok, 128)({"messages": messages})
    prompt = tok("Q: How many?\nA: ", add_special_tokens=False).input_ids  # what inference tokenizes
    assert tok.convert_ids_to_tokens(prompt)[-1] == "Ġ"
    assert row.input_ids[: len(prompt)] == prompt and row.labels[: len(prompt)] == [X] * len(prompt)
    assert trained_tokens(tok, row) == ["The", "Ġa", "nswer", "Ġis", "Ġ4", "2", ".", "<|im_end|>"]
    assert row.labels[-1] == X  # the "\n" after <|im_end|>


# CHAT in CHATML_IDS: context = ids[:66] (system 0-15, user 16-26, header 27-34, answer 35-42 trained, "\n" 43,
# user 44-57, header 58-65), response = ids[66:74] (the last answer 66-72 + "\n").
def test_truncation_cuts_the_context_from_the_left_and_keeps_the_last_answer(tok):
    # max_prompt_length null: context <= 40 - min(8, 40 // 2) = 32 tokens: the BOS, then the last 31 context tokens
    row = SFTTokenizer(tok, 40)({"messages": CHAT})
    assert row.input_ids == [0] + CHATML_IDS[35:74] and row.labels == [X] + CHATML_LABELS[35:74]
    assert row.truncated and (row.prompt_tokens_cut, row.response_tokens_cut) == (34, 0)
    assert trained_tokens(tok, row)[-7:] == ["I", "t", "Ġis", "Ġ", "5", ".", "<|im_end|>"]  # last answer whole
    assert row.labels[1:9] == CHATML_LABELS[35:43]  # an earlier answer inside the kept context stays trained


def test_truncation_keep_system_keep_start_and_max_prompt_length(tok):
    row = SFTTokenizer(tok, 40, keep_system=True)({"messages": CHAT})  # system message (16 ids, BOS first) stays
    assert row.input_ids == CHATML_IDS[:16] + CHATML_IDS[50:74] and row.labels == [X] * 32 + CHATML_LABELS[66:74]
    row = SFTTokenizer(tok, 40, truncation_mode="keep_start")({"messages": CHAT})  # start + the assistant header
    assert row.input_ids == CHATML_IDS[:24] + CHATML_IDS[58:74] and row.labels == [X] * 32 + CHATML_LABELS[66:74]
    row = SFTTokenizer(tok, 40, max_prompt_length=20)({"messages": CHAT})
    assert row.input_ids == [0] + CHATML_IDS[47:74] and (row.prompt_tokens_cut, row.response_tokens_cut) == (46, 0)
    with pytest.raises(Exception, match="max_prompt_length=40 must be below data.max_length=40"):
        SFTTokenizer(tok, 40, max_prompt_length=40)


def test_truncation_cuts_a_long_response_at_its_end_after_a_short_context(tok):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "apples " * 40}]
    full = SFTTokenizer(tok, 512)({"messages": chat})
    n = full.labels.index(next(x for x in full.labels if x != X))  # context tokens (< 40 // 2: never cut)
    row = SFTTokenizer(tok, 40)({"messages": chat})
    assert row.input_ids == full.input_ids[:40] and row.labels == full.labels[:40]
    assert (row.prompt_tokens_cut, row.response_tokens_cut) == (0, len(full.input_ids) - 40) and n < 20


def test_truncation_drop_and_rows_that_cannot_be_cut(tok):
    with pytest.raises(RowError) as info:
        SFTTokenizer(tok, 40, truncation="drop")({"messages": CHAT})
    assert info.value.kind == "longer than max_length" and not info.value.bad
    with pytest.raises(RowError) as info:  # the kept system message alone fills the 32 context tokens
        SFTTokenizer(tok, 40, keep_system=True)({"messages": [{"role": "system", "content": "Be nice. " * 20}, *CHAT[1:]]})
    assert info.value.kind == "prompt cannot be cut" and not info.value.bad
    assert "the BOS and system message alone take" in info.value.reason


def test_truncation_counted_in_report(tok, write, cfg):
    long_prompt = [{"role": "user", "content": "apples " * 60}, {"role": "assistant", "content": "Yes."}]
    big_system = [{"role": "system", "content": "Be nice. " * 20}, *CHAT[1:]]
    rows = [{"messages": CHAT}, {"messages": long_prompt}, {"messages": CHAT[1:3]}, {"messages": big_system}]
    path = write("m.jsonl", rows)
    data = build_sft_data(cfg(path, max_length=40), tok)
    r = data.report
    # old code: the long prompt was cut to its first 40 tokens and dropped ("no trained tokens after truncation")
    assert r.train_rows == 4 and r.dropped == [] and [d["row"] for d in r.truncated_rows] == [0, 1, 3]
    long_row = SFTTokenizer(tok, 40)({"messages": long_prompt})  # its whole answer is kept and trained
    assert trained_tokens(tok, long_row) == trained_tokens(tok, SFTTokenizer(tok, 512)({"messages": long_prompt}))
    assert [list(x) for x in data.train["input_ids"]].count(long_row.input_ids) == 1
    cut = {d["row"]: (d["prompt_tokens_cut"], d["response_tokens_cut"]) for d in r.truncated_rows}
    assert cut[0] == (34, 0) and cut[1] == (long_row.prompt_tokens_cut, 0) and long_row.prompt_tokens_cut > 0
    assert r.to_dict()["prompt_tokens_cut"] == sum(c[0] for c in cut.values())
    assert r.to_dict()["prompt_cut_rows"] == 3 and r.to_dict()["response_tokens_cut"] == 0
    assert "prompt: " in r.summary() and "tokens cut in 3 rows" in r.summary()
    kept = build_sft_data(cfg(path, max_length=40, truncation_keep_system=True), tok).report
    assert [(d["row"], d["kind"]) for d in kept.dropped] == [(3, "prompt cannot be cut")]  # index + reason
    dropped = build_sft_data(cfg(path, max_length=40, truncation="drop"), tok).report
    assert dropped.train_rows == 1 and dropped.truncated == 0
    assert sorted((d["row"], d["kind"]) for d in dropped.dropped) == [
        (0, "longer than max_length"), (1, "longer than max_length"), (3, "longer than max_length")]


def test_template_not_prefix_consistent_is_a_bad_row(tok, write, cfg):
    # Renders earlier turns differently once a later turn exists (like templates that drop old reasoning).
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}{{ m['role'] + ': ' + m['content'] + eos_token }}"
        "{% else %}{{ m['role'] + '> ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
    )
    with pytest.raises(RowError, match="not prefix-consistent at assistant turn 2"):
        SFTTokenizer(tok, 512)({"messages": CHAT[:3]})
    path = write("m.jsonl", [{"messages": CHAT[:3]}])
    with pytest.raises(Exception, match=r"m.jsonl row 0: chat template is not prefix-consistent"):
        build_sft_data(cfg(path, chat_template=tok.chat_template), tok)


def test_render_labels_marks_trained_runs(tok):
    assert render_labels([287, 350, 1, 204], [X, 350, 1, X], tok) == "The« sea<|im_end|>»\n"


def test_long_texts_are_cut_before_tokenizing_without_changing_the_kept_tokens(tok):
    text = "The quick brown fox jumps over the lazy dog. " * 600  # ~27k chars, far beyond max_length
    row = SFTTokenizer(tok, 64)({"text": text})
    assert row.truncated and row.input_ids == tok(text, add_special_tokens=False).input_ids[:64]
    chat = [{"role": "user", "content": text[:900]}, {"role": "assistant", "content": text}]
    row = SFTTokenizer(tok, 2000)({"messages": chat})
    prompt = tok(tok.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    answer = tok(text, add_special_tokens=False).input_ids
    n = len(prompt.input_ids)
    assert row.input_ids == (prompt.input_ids + answer)[:2000]
    assert row.labels == ([X] * n + answer)[:2000]


def test_keep_system_with_a_template_that_folds_the_system_message_in_drops_the_row(tok):
    from llmtune.data.templates import LLAMA2

    tok.chat_template = LLAMA2  # the system message is rendered inside the first user turn
    assert SFTTokenizer(tok, 40)({"messages": CHAT}).truncated
    with pytest.raises(RowError) as info:
        SFTTokenizer(tok, 40, keep_system=True)({"messages": CHAT})
    assert info.value.kind == "system message cannot be kept" and not info.value.bad
