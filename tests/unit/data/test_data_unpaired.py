"""KTO data: unpaired rows and pairs split into desirable/undesirable rows, the same ids as DPO's pairs, bad rows
named with file, row index, field, expectation and fix, and the paper's weighting guidance in the report."""

from __future__ import annotations

import json
import re

import pytest

from llmtune.data import DataError, build_preference_data
from llmtune.data.unpaired import UnpairedCollator, build_unpaired_data, kto_balance

U = {"role": "user", "content": "Hello!"}
PAIR = {"prompt": "Hello!", "chosen": "I am fine.", "rejected": "It is 5."}


def test_pairs_split_into_desirable_and_undesirable_rows_with_dpo_ids(tok, write, cfg):
    path = write("pairs.jsonl", [PAIR, {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go."}])
    data = build_unpaired_data(cfg({"path": str(path), "format": "preference"}), tok)
    pairs = build_preference_data(cfg({"path": str(path), "format": "preference"}), tok)
    rows = data.train.to_list()
    assert [r["label"] for r in rows] == [1, 0, 1, 0] and [r["pair_index"] for r in rows] == [0, 0, 1, 1]
    for k, pair in enumerate(pairs.train.to_list()):  # byte-for-byte DPO's chosen and rejected sequences
        assert rows[2 * k]["input_ids"] == pair["chosen_input_ids"] and rows[2 * k]["labels"] == pair["chosen_labels"]
        assert rows[2 * k + 1]["input_ids"] == pair["rejected_input_ids"]
        assert rows[2 * k]["prompt_length"] == pair["prompt_length"]
    b = data.report.kto_balance
    assert (b["desirable"], b["undesirable"], b["ratio"], b["in_range"]) == (2, 2, 1.0, True)


def test_unpaired_formats_give_the_pair_tokens(tok, write, cfg):
    rows = [
        {"prompt": "Hello!", "completion": "I am fine.", "label": True},
        {"prompt": [U], "completion": [{"role": "assistant", "content": "It is 5."}], "label": False},
        {"messages": [U, {"role": "assistant", "content": "I am fine."}], "label": False},  # completion = last turn
        {"messages": [U], "completion": "It is 5.", "label": True},
    ]
    data = build_unpaired_data(cfg({"path": str(write("kto.jsonl", rows))}, max_samples=None), tok)
    assert data.report.sources[0].format == "unpaired"
    pair = build_preference_data(cfg({"path": str(write("p.jsonl", [PAIR]))}), tok).train[0]
    got = {(tuple(r["input_ids"]), r["label"], r["pair_index"]) for r in data.train.to_list()}
    assert got == {(tuple(pair["chosen_input_ids"]), 1, -1), (tuple(pair["rejected_input_ids"]), 0, -1),
                   (tuple(pair["chosen_input_ids"]), 0, -1), (tuple(pair["rejected_input_ids"]), 1, -1)}
    batch = UnpairedCollator(tok)(data.train.to_list()[:2])
    assert batch["input_ids"].shape[0] == 2 and batch["label"].tolist() == [r["label"] for r in data.train.to_list()[:2]]
    assert batch["prompt_length"].tolist() == [19, 19]


def test_bad_rows_name_file_row_field_expectation_and_fix(tok, write, cfg):
    rows = [
        {"prompt": "Hello!", "completion": "Fine.", "label": True},
        {"prompt": "Hello!", "completion": "Fine.", "label": "yes"},
        {"prompt": "Hello!", "completion": "Fine."},
        {"prompt": "Hello!", "label": False},
        {"prompt": "Hello!", "messages": [U], "completion": "Fine.", "label": True},
        {"completion": "Fine.", "label": True},
        {"prompt": "Hello!", "completion": 5, "label": True},
        {"prompt": "Hello!", "completion": "Fine.", "label": 1},
    ]
    path = write("kto.jsonl", rows)
    with pytest.raises(DataError) as exc:
        build_unpaired_data(cfg({"path": str(path), "format": "unpaired"}), tok)
    msg = str(exc.value)
    assert f"{path} row 1: field 'label' must be true (desirable) or false (undesirable), got a string 'yes'" in msg
    assert f"{path} row 2: missing field 'label': expected true (desirable) or false (undesirable); add it, or " \
           "map your column with columns: {label: <column>}" in msg
    assert f"{path} row 3: missing field 'completion': expected the completion as a string" in msg
    assert f"{path} row 4: the row has both 'prompt' and 'messages'" in msg
    assert f"{path} row 5: missing field 'prompt' (or 'messages')" in msg
    assert f"{path} row 6: field 'completion' must be a string or one assistant message, got a number" in msg
    assert f"{path} row 7: field 'label' must be true (desirable) or false (undesirable), got a number 1" in msg
    assert "data.bad_rows: skip" in msg  # how to go on without them
    with pytest.raises(DataError, match="all desirable: no undesirable"):  # the one row left has one label
        build_unpaired_data(cfg({"path": str(path), "format": "unpaired"}, bad_rows="skip"), tok)
    rows.append({"prompt": "Hi", "completion": "No.", "label": False})
    skipped = build_unpaired_data(cfg({"path": str(write("kto2.jsonl", rows)), "format": "unpaired"},
                                      bad_rows="skip", val_size=0), tok)
    assert len(skipped.train) == 2 and sorted(d["row"] for d in skipped.report.dropped) == [1, 2, 3, 4, 5, 6, 7]


def test_label_column_mapping_and_auto_detection(tok, write, cfg):
    rows = [{"q": "Hello!", "a": "Fine.", "thumbs_up": True}, {"q": "Hi", "a": "No.", "thumbs_up": False}]
    path = write("fb.json", rows)
    data = build_unpaired_data(cfg({"path": str(path), "columns": {"prompt": "q", "completion": "a",
                                                                    "label": "thumbs_up"}}), tok)
    assert sorted(data.train["label"]) == [0, 1]


def test_balance_guidance_of_the_paper():
    """Eq. 8 of Ethayarajh et al. 2024: desirable_weight n_D / (undesirable_weight n_U) in [1, 4/3]."""
    b = kto_balance(300, 100, 1.0, 1.0)
    assert b["ratio"] == 3.0 and not b["in_range"]
    assert b["desirable_weight_range"] == [0.3333, 0.4444]  # 100/300 .. (4/3)(100/300)
    assert b["undesirable_weight_range"] == [2.25, 3.0]  # 300/(4/3 * 100) .. 300/100
    assert "kto.desirable_weight in [0.3333, 0.4444] OR kto.undesirable_weight in [2.25, 3.0]" in b["advice"]
    assert kto_balance(100, 300, 3.5, 1.0)["in_range"]  # 350 / 300 = 1.17
    assert not kto_balance(100, 300, 1.0, 1.0)["in_range"]
    only = kto_balance(5, 0, 1.0, 1.0)
    assert "only desirable rows" in only["advice"] and only["ratio"] is None and not only["in_range"]


def test_balance_in_data_report_json(tok, write, cfg, tmp_path):
    rows = [{"prompt": f"Q{i}", "completion": f"A{i}", "label": i % 4 != 0} for i in range(8)]  # 6 desirable, 2 not
    data = build_unpaired_data(cfg({"path": str(write("kto.jsonl", rows))}), tok, desirable_weight=1.0,
                               undesirable_weight=1.0)
    saved = json.loads(data.report.save(tmp_path / "report.json").read_text())
    assert saved["kind"] == "unpaired" and saved["kto_balance"]["ratio"] == 3.0
    assert saved["kto_balance"]["in_range"] is False
    assert "KTO balance: 6 desirable / 2 undesirable" in data.report.summary()
    assert "OUTSIDE" in data.report.summary()


def test_sft_stage_refuses_unpaired_rows(tok, write, cfg):
    from llmtune.data import build_sft_data

    path = write("kto.jsonl", [{"prompt": "Hello!", "completion": "Fine.", "label": True}])
    with pytest.raises(DataError, match="format: 'unpaired' is unpaired rows"):
        build_sft_data(cfg({"path": str(path), "format": "unpaired"}), tok)


@pytest.mark.parametrize("label", [True, False])
def test_a_dataset_with_one_label_class_is_an_error_naming_the_missing_class(tok, write, cfg, label):
    """Issue 21 bug 2: old code trained to the end with a warning."""
    rows = [{"prompt": f"Q{i}", "completion": f"A{i}", "label": label} for i in range(4)]
    missing = "undesirable (label false)" if label else "desirable (label true)"
    path = write("kto.jsonl", rows)
    counts = "4 desirable, 0 undesirable" if label else "0 desirable, 4 undesirable"
    # issue 30: the message names the file (and what it holds), not only the key
    with pytest.raises(DataError, match=rf"KTO data \(data.datasets\[0\] {re.escape(str(path))}: {counts} rows\): "
                                        rf"the 4 train row\(s\) are all {'desirable' if label else 'undesirable'}: "
                                        rf"no {re.escape(missing)} row.*Add .* rows \(check the label column"):
        build_unpaired_data(cfg({"path": str(path)}, val_size=0), tok)


def _completion(row):
    return row["input_ids"][row["prompt_length"]:]


def _kl_completion(row):
    return row["kl_input_ids"][row["prompt_length"]:]


def test_kl_sequences_never_pair_a_row_with_its_own_completion(tok, write, cfg):
    """Issue 21 bug 2: each row's KL sequence (built with the data) is its own prompt + the completion of a row
    of another prompt, in train and in an eval split of ONE row (an eval batch of one row: old code paired it with
    its own completion), and the KL labels train exactly that completion (its template tail untrained)."""
    rows = [{"prompt": f"Question {i}?", "completion": f"Answer {i}.", "label": i % 2 == 0} for i in range(5)]
    data = build_unpaired_data(cfg({"path": str(write("kto.jsonl", rows))}, val_size=1), tok)
    train, held = data.train.to_list(), data.eval.to_list()
    assert len(held) == 1
    for row in train + held:
        p = row["prompt_length"]
        assert row["kl_input_ids"][:p] == row["input_ids"][:p]  # its own prompt
        assert _kl_completion(row) != _completion(row)  # never its own completion
        donor = next(r for r in train if _completion(r) == _kl_completion(row))  # another row's, from train
        assert donor["input_ids"][: donor["prompt_length"]] != row["input_ids"][:p]
        assert row["kl_labels"] == [-100] * p + donor["labels"][donor["prompt_length"]:]
    # train: row i takes the completion of row i + 1 (cyclically)
    assert [_kl_completion(r) for r in train] == [_completion(r) for r in train[1:] + train[:1]]


def test_kl_sequences_of_pairs_come_from_another_prompt(tok, write, cfg):
    """A pair's desirable and undesirable rows share a prompt: both take completions of the next pair."""
    pairs = [{"prompt": f"Question {i}?", "chosen": f"Yes {i}.", "rejected": f"No {i}."} for i in range(3)]
    train = build_unpaired_data(cfg({"path": str(write("p.jsonl", pairs))}, val_size=0), tok).train.to_list()
    assert len(train) == 6
    for i, row in enumerate(train):
        nxt = train[(i + 2) % 6]  # the same side of the next pair
        assert _kl_completion(row) == _completion(nxt) and row["label"] == nxt["label"]


def test_kl_donors_of_a_single_pair_swap_its_completions():
    """With no other row at all, a pair's two rows swap completions (still never a row's own)."""
    from llmtune.data.unpaired import TokenizedUnpaired, kl_donors

    only = TokenizedUnpaired([5, 6], [[7, 8], [9]], [True, False], True)
    (result, donor, shift), = kl_donors([only], [])
    rows = result.to_rows(0, donor, 64, shift)
    assert [r["kl_input_ids"] for r in rows] == [[5, 6, 9], [5, 6, 7, 8]]
