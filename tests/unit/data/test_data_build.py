"""build_sft_data: mixing weights, max_samples, deterministic validation split, report, num_proc."""

from __future__ import annotations

import json

import pytest

from llmtune.data import DataError, DataReport, build_sft_data


def _sources(write, n_a=10, n_b=10):
    a = write("a.jsonl", [{"text": f"apples {i}"} for i in range(n_a)])
    b = write("b.jsonl", [{"text": f"oranges {i}"} for i in range(n_b)])
    return a, b


def _texts(tok, split) -> list[str]:
    return [tok.decode(ids) for ids in split["input_ids"]]


def test_weights_scale_each_source(tok, write, cfg):
    a, b = _sources(write)
    data = build_sft_data(cfg({"path": str(a)}, {"path": str(b), "weight": 0.5}), tok)
    assert [s.train_rows for s in data.report.sources] == [10, 5]
    data = build_sft_data(cfg({"path": str(a), "weight": 2}, {"path": str(b), "weight": 1.5}), tok)
    texts = _texts(tok, data.train)
    assert [s.train_rows for s in data.report.sources] == [20, 15] and len(texts) == 35
    assert all(texts.count(f"apples {i}<|im_end|>") == 2 for i in range(10))
    assert sorted(texts.count(f"oranges {i}<|im_end|>") for i in range(10)) == [1] * 5 + [2] * 5


def test_max_samples_per_source_and_total(tok, write, cfg):
    a, b = _sources(write)
    data = build_sft_data(cfg({"path": str(a), "max_samples": 3}, {"path": str(b)}), tok)
    assert [s.rows_read for s in data.report.sources] == [3, 10] and data.report.sources[0].stopped_early
    assert sorted(t for t in _texts(tok, data.train) if t.startswith("apples")) == [f"apples {i}<|im_end|>" for i in range(3)]
    data = build_sft_data(cfg(a, b, max_samples=7, val_size=2), tok)
    assert data.report.train_rows == 5 and data.report.eval_rows == 2 and len(data.train) == 5 and len(data.eval) == 2


def test_validation_split_is_deterministic_and_disjoint(tok, write, cfg):
    a, b = _sources(write)
    runs = [build_sft_data(cfg({"path": str(a), "weight": 2}, b, val_size=0.25), tok) for _ in range(2)]
    assert runs[0].train["input_ids"] == runs[1].train["input_ids"]
    assert runs[0].eval["input_ids"] == runs[1].eval["input_ids"]
    train, held = set(_texts(tok, runs[0].train)), set(_texts(tok, runs[0].eval))
    assert len(held) == len(runs[0].eval) == 8  # round(0.25 x 30 rows)
    assert not train & held  # a repeated row (weight 2) never sits in both splits
    other_seed = build_sft_data(cfg({"path": str(a), "weight": 2}, b, val_size=0.25, seed=7), tok)
    assert set(_texts(tok, other_seed.eval)) != held
    counted = build_sft_data(cfg(a, b, val_size=3), tok)
    assert len(counted.eval) == 3 and len(counted.train) == 17
    assert build_sft_data(cfg(a, b), tok).eval is None


def test_val_size_errors(tok, write, cfg):
    a, _ = _sources(write, n_a=3)
    with pytest.raises(DataError, match="asks for 3 eval rows but only 3 distinct rows"):
        build_sft_data(cfg(a, val_size=3), tok)
    with pytest.raises(DataError, match="neither a fraction"):
        build_sft_data(cfg(a, val_size=1.5), tok)


def test_report_counts_save_and_summary(tok, write, cfg, tmp_path):
    rows = [{"instruction": "Hi", "output": "Hello"}] * 4 + [{"instruction": "Hi", "output": ""}] * 100
    path = write("a.jsonl", rows)
    data = build_sft_data(cfg(path, bad_rows="skip", val_size=1), tok)
    r = data.report
    assert (r.train_rows, r.eval_rows, len(r.dropped)) == (3, 1, 100)
    src = r.sources[0]
    assert (src.rows_read, src.rows_valid, src.rows_kept, src.train_rows, src.eval_rows) == (104, 4, 4, 3, 1)
    ids, labels = data.train[0]["input_ids"], data.train[0]["labels"]
    assert r.tokens == 3 * len(ids) and r.trained_tokens == 3 * sum(1 for x in labels if x != -100)
    saved = json.loads(r.save(tmp_path / "run" / "data_report.json").read_text())
    assert saved["drop_counts"] == {"empty response": 100} and saved["truncated"] == 0
    assert saved["dropped"][0] == {"source": str(path), "row": 4, "kind": "empty response",
                                   "reason": "empty response: field 'output' is empty"}
    summary = r.summary()
    assert len(summary.splitlines()) <= 6
    assert f"100  empty response (e.g. {path} row 4, {path} row 5, {path} row 6)" in summary
    lineage = r.sources_lineage()
    assert lineage[0]["path"] == str(path) and len(lineage[0]["sha256"]) == 64
    assert isinstance(DataReport().to_dict(), dict)


def test_num_proc_gives_the_same_rows(tok, write, cfg):
    a, b = _sources(write, n_a=6, n_b=6)
    long = write("long.jsonl", [{"text": "word " * 80}, {"text": "short"}])  # dropped by the tokenizer: too long
    kwargs = {"val_size": 2, "max_length": 32, "truncation": "drop", "cache": False}  # no cache: tokenize twice
    one = build_sft_data(cfg(a, b, long, **kwargs), tok)
    two = build_sft_data(cfg(a, b, long, num_proc=2, **kwargs), tok)
    assert one.train.to_dict() == two.train.to_dict() and one.eval.to_dict() == two.eval.to_dict()
    assert one.report.to_dict() == two.report.to_dict() and one.report.drop_counts() == {"longer than max_length": 1}


def test_no_chat_template_needed_for_text_only(write, cfg):
    from llmtune.models.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    tok.chat_template = None
    a, _ = _sources(write, n_a=2)
    assert build_sft_data(cfg(a), tok).report.train_rows == 2
    chat = write("c.jsonl", [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}])
    with pytest.raises(DataError, match="has no chat template, and data.chat_template is not set"):
        build_sft_data(cfg(chat), tok)
    assert build_sft_data(cfg(chat, chat_template="chatml"), tok).report.train_rows == 1


def test_tokenizing_many_rows_shows_progress_and_few_rows_stay_quiet(tok, write, cfg, capfd, monkeypatch):
    import llmtune.data.tokenize as tokenize_mod

    a, b = _sources(write, n_a=6, n_b=6)
    capfd.readouterr()
    build_sft_data(cfg(a, b), tok)
    assert "tokenizing" not in capfd.readouterr().err
    monkeypatch.setattr(tokenize_mod, "PROGRESS_MIN_ROWS", 5)
    data = build_sft_data(cfg(a, b, cache=False), tok)  # the cache would skip tokenizing
    assert "tokenizing" in capfd.readouterr().err and data.report.train_rows == 12
