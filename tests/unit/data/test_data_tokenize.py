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


def test_truncation_keeps_start_and_trained_tokens(tok):
    row = SFTTokenizer(tok, 40)({"messages": CHAT})
    assert row.truncated and row.input_ids == CHATML_IDS[:40] and row.labels == CHATML_LABELS[:40]
    assert row.labels[35:40] == [46, 262, 82, 282, 316]


def test_truncation_without_trained_tokens_is_dropped(tok):
    with pytest.raises(RowError) as info:
        SFTTokenizer(tok, 30)({"messages": CHAT})  # cut before the first answer
    assert info.value.kind == "no trained tokens after truncation" and not info.value.bad
    with pytest.raises(RowError) as info:
        SFTTokenizer(tok, 40, truncation="drop")({"messages": CHAT})
    assert info.value.kind == "longer than max_length" and not info.value.bad


def test_truncation_policies_counted_in_report(tok, write, cfg):
    long_prompt = [{"role": "user", "content": "apples " * 60}, {"role": "assistant", "content": "Yes."}]
    rows = [{"messages": CHAT}, {"messages": long_prompt}, {"messages": CHAT[1:3]}]
    path = write("m.jsonl", rows)
    data = build_sft_data(cfg(path, max_length=40), tok)
    r = data.report
    assert r.train_rows == 2 and r.truncated == 1 and r.truncated_rows == [{"source": str(path), "row": 0}]
    assert [(d["row"], d["kind"]) for d in r.dropped] == [(1, "no trained tokens after truncation")]
    data = build_sft_data(cfg(path, max_length=40, truncation="drop"), tok)
    assert data.report.train_rows == 1 and data.report.truncated == 0
    assert sorted((d["row"], d["kind"]) for d in data.report.dropped) == [(0, "longer than max_length"), (1, "longer than max_length")]
    assert data.train[0]["labels"] == SFTTokenizer(tok, 40)({"messages": CHAT[1:3]}).labels


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
