"""Streaming sources: iter_source batches, chunk-size independence, exact positions, bounded memory."""

from __future__ import annotations

import codecs
import gzip
import io
import json
import random
import tracemalloc

import pytest

from llmtune.config.schema import DatasetConfig
from llmtune.data import DataError
from llmtune.data import sources as sources_mod
from llmtune.data.sources import iter_source, read_source

BOM = codecs.BOM_UTF8
CHUNKS = (1, 2, 3, 7, 64)
BATCHES = (1, 3)
OPTIONS = ({}, {"allow_truncated_json": True}, {"allow_truncated_json": True, "max_samples": 2})

ARRAY = ('[{"text": "caf\u00e9 \u20ac\U0001f600", "n": 12},\n 23, -4.5e3, true, null, "\\ud834\\udd1e",\n'
         ' {"t": [1, {"u": "\u00e9"}]}]\n')
NUMBERED = "".join(f'{{"n": {i}, "t": "{i * 7919 % 10007}"}}\n' for i in range(300))
LINES = '{"text": "\u00e9\u20ac"}\n\n23\n{"text": oops}\n  \n-4.5e3\n"\U0001f600\u00e9"\n\r\n{"t": [1, 2]}\n'


def _outcome(path, **options):
    """Everything read_source returns (or the exact error message)."""
    try:
        src = read_source(DatasetConfig(path=str(path), **options), 0)
    except DataError as exc:
        return ("error", str(exc))
    bad = [(row_id, err.kind, err.reason) for row_id, err in src.bad]
    return ("ok", src.rows, src.row_ids, bad, src.columns, src.truncated_json, src.stopped_early)


def _same_whatever_the_chunks(monkeypatch, path, options=OPTIONS):
    """The outcomes with a chunk larger than the file; asserts every small chunk and batch size gives them too."""
    monkeypatch.setattr(sources_mod, "READ_CHUNK_BYTES", 1 << 20)
    monkeypatch.setattr(sources_mod, "BATCH_ROWS", 1024)
    expected = [_outcome(path, **o) for o in options]
    for chunk in CHUNKS:
        for batch in BATCHES:
            monkeypatch.setattr(sources_mod, "READ_CHUNK_BYTES", chunk)
            monkeypatch.setattr(sources_mod, "BATCH_ROWS", batch)
            for o, want in zip(options, expected):
                assert _outcome(path, **o) == want, (path.name, path.read_bytes(), o, chunk, batch)
    return expected


FILES = {
    "array.json": ARRAY.encode(),
    "bom_array.json": BOM + ARRAY.encode(),
    "array.json.gz": gzip.compress(ARRAY.encode()),
    "numbers.json": b"[1, 23, 456, -7.5e-3, 0, 1E5]",
    "special_numbers.json": b"[NaN, -Infinity, Infinity, 1]",
    "lines.jsonl": LINES.encode(),
    "bom_lines.jsonl": BOM + LINES.encode(),
    "lines.jsonl.gz": gzip.compress(LINES.encode()),
    "lines_no_final_newline.jsonl": LINES.rstrip().encode(),
    "lines_in.json": LINES.encode(),
    "bad_utf8_array.json": ARRAY.encode()[:40] + b"\xff" + ARRAY.encode()[40:],
    "bad_utf8_lines.jsonl": LINES.encode()[:30] + b"\xe9" + LINES.encode()[30:],
    "bad_utf8_lines.jsonl.gz": gzip.compress(LINES.encode()[:30] + b"\xed\xa0\x80" + LINES.encode()[30:]),
    "bad_utf8_after_array.json": b"[1, 2]" + b" " * 40 + b"\n\xff\n",
    "cut_in_char.jsonl": LINES.encode() + '{"text": "\u20ac'.encode()[:-1],
    "syntax_error.json": b'[{"text": "a"},\n {"text": "b" "c": 1},\n {"text": "d"}]',
    "after_record.json": b'[{"text": "a"}\n {"text": "b"}]',
    "pretty.jsonl": b'{\n  "text": "a"\n}\n',
    "one_object.json": b'{"data": [{"text": "a"}, {"text": "b"}]}\n',
    "empty.json": b" \n\r\n\t",
    "hidden_gzip.jsonl": gzip.compress(LINES.encode()),
    "plain.jsonl.gz": LINES.encode(),
    "truncated.jsonl.gz": gzip.compress(NUMBERED.encode())[:1000],
    "brace_only.jsonl": b"{\n",
    # Problems are reported in file order: the JSON error comes before the later bytes that are not UTF-8
    # (a whole-file decode reported the UTF-8 error first).
    "syntax_before_bad_utf8.json": b'[{"k": "' + b"y" * 100 + b'"}, 1 x' + b" " * 40 + b"\xff]",
    "pretty_before_bad_utf8.jsonl": b'{\n"' + b"y" * 100 + b'"\n\xff\n',
}
# What the whole-file reader gave for these (with default options): the streaming reader gives the same.
EXPECTED = {
    "bad_utf8_array.json": "not UTF-8 text (byte 40, line 2: invalid start byte, byte value 0xff)",
    "bad_utf8_lines.jsonl": "not UTF-8 text (byte 30, line 4: invalid continuation byte, byte value 0xe9)",
    "bad_utf8_lines.jsonl.gz": "not UTF-8 text (byte 30, line 4: invalid continuation byte, byte value 0xed)",
    "bad_utf8_after_array.json": "not UTF-8 text (byte 47, line 2: invalid start byte, byte value 0xff)",
    "cut_in_char.jsonl": "the JSON ends at char 75 (line 10, column 11) inside record 5 (which starts at line 10, "
                         "column 1, char 65) (Unterminated string starting at (line 10, column 10))",
    "syntax_error.json": "invalid JSON in record 1 (starts at line 2): Expecting ',' delimiter at line 2 column 15 "
                         "(char 30)",
    "after_record.json": "invalid JSON after record 0: expected ',' or ']' at line 2 column 2 (char 16), found '{'",
    "pretty.jsonl": "line 1 is '{' alone",
    "one_object.json": "holds one JSON object (keys: data)",
    "empty.json": "is empty; expected a JSON array",
    "hidden_gzip.jsonl": "is gzip-compressed but its name does not end in .gz",
    "plain.jsonl.gz": "is named .gz but is not a valid gzip file (Not a gzipped file",
    "truncated.jsonl.gz": "the gzip stream ends early, so the file is truncated",
    "brace_only.jsonl": "the JSON ends at char 2 (line 2, column 1) inside record 0 (which starts at line 1, column 1, "
                        "char 0)",
    "syntax_before_bad_utf8.json": "invalid JSON after record 1: expected ',' or ']' at line 1 column 115 (char 114), "
                                   "found 'x'",
    "pretty_before_bad_utf8.jsonl": "line 1 is '{' alone",
}


@pytest.mark.parametrize("name", FILES, ids=list(FILES))
def test_chunk_and_batch_sizes_do_not_change_what_is_read(tmp_path, monkeypatch, name):
    path = tmp_path / name
    path.write_bytes(FILES[name])
    outcomes = _same_whatever_the_chunks(monkeypatch, path)
    if name in EXPECTED:
        assert outcomes[0][0] == "error" and EXPECTED[name] in outcomes[0][1], outcomes[0]
    if name in ("array.json", "bom_array.json", "array.json.gz"):
        assert outcomes[0][1] == json.loads(ARRAY)
    if name in ("lines.jsonl", "bom_lines.jsonl", "lines.jsonl.gz", "lines_in.json"):
        assert outcomes[0][2] == [0, 2, 5, 6, 8] and [b[0] for b in outcomes[0][3]] == [3]


@pytest.mark.parametrize("text", [ARRAY, LINES], ids=["array", "lines"])
def test_every_cut_of_a_small_file_reads_the_same_whatever_the_chunks(tmp_path, monkeypatch, text):
    data = text.encode()
    path = tmp_path / ("cut.json" if text is ARRAY else "cut.jsonl")
    kinds, cuts = set(), 0
    for end in range(len(data) + 1):
        path.write_bytes(data[:end])
        outcomes = _same_whatever_the_chunks(monkeypatch, path, options=OPTIONS[:2])
        kinds.add(outcomes[0][0])
        cuts += outcomes[1][0] == "ok" and outcomes[1][5] is not None
    assert kinds == {"ok", "error"} and cuts > len(data) // 2


def test_positions_in_a_cut_array_are_those_of_the_whole_text(tmp_path, monkeypatch):
    # Record 2 starts on line 3 after multi-byte characters: char offsets, lines and columns are counted in
    # characters of the whole text (as the json module counts them), not in bytes or within a chunk.
    text = '[{"a": "\u00e9\u00e9"},\n {"b": "\u20ac"},\n  {"c": "\U0001f600x'
    path = tmp_path / "cut.json"
    path.write_text(text, encoding="utf-8")
    (outcome,) = _same_whatever_the_chunks(monkeypatch, path, options=({"allow_truncated_json": True},))

    def where(pos):
        err = json.JSONDecodeError("", text, pos)
        return err.lineno, err.colno

    record, string = text.index('{"c"'), text.index('"\U0001f600')
    assert outcome[5] == {
        "records_kept": 2, "cut_at_char": len(text), "cut_at_line": where(len(text))[0],
        "cut_at_column": where(len(text))[1], "file_bytes": len(text.encode()),
        "partial_record_char": record, "partial_record_line": 3, "partial_record_column": 3,
        "json_error": f"Unterminated string starting at (line 3, column {where(string)[1]}, char {string})",
    }
    assert (record, where(record), where(len(text))) == (29, (3, 3), (3, 12))


def test_invalid_utf8_names_the_byte_offset_in_the_whole_file(tmp_path, monkeypatch):
    head = "".join(json.dumps({"text": f"caf\u00e9 {i}"}, ensure_ascii=False) + "\n" for i in range(5)).encode()
    path = tmp_path / "rows.jsonl"
    path.write_bytes(head + b'{"text": "\xe9"}\n')
    (plain,) = _same_whatever_the_chunks(monkeypatch, path, options=({},))
    assert f"not UTF-8 text (byte {len(head) + 10}, line 6: invalid continuation byte, byte value 0xe9)" in plain[1]
    # With a BOM the offset counts the BOM's 3 bytes and names the bad byte (the whole-file decode named an
    # offset 3 bytes short and the byte there).
    path.write_bytes(BOM + head + b'{"text": "\xff"}\n')
    (bom,) = _same_whatever_the_chunks(monkeypatch, path, options=({},))
    assert f"not UTF-8 text (byte {len(head) + 13}, line 6: invalid start byte, byte value 0xff)" in bom[1]


def test_a_bom_file_cut_inside_a_character_keeps_the_text_before_it(tmp_path, monkeypatch):
    # The whole-file decode cut 3 bytes too early here (a traceback, or lost rows).
    path = tmp_path / "rows.jsonl"
    path.write_bytes(BOM + b'{"text": "a"}\n{"text": "b"}\n{"text": "\xe2\x82')
    (outcome,) = _same_whatever_the_chunks(monkeypatch, path, options=({"allow_truncated_json": True},))
    assert outcome[1] == [{"text": "a"}, {"text": "b"}] and outcome[5]["cut_at_char"] == 38


@pytest.mark.parametrize("seed", range(4))
def test_the_chunked_decoder_matches_a_whole_file_decode(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    pieces = [b"a", b"\n", "\u00e9".encode(), "\u20ac".encode(), "\U0001f600".encode(), b"\xff", b"\xed\xa0\x80",
              b"\xe2\x82", b"\xc3"]
    path = tmp_path / "text.jsonl"
    for _ in range(60):
        data = b"".join(rng.choice(pieces[:5] if rng.random() < 0.5 else pieces) for _ in range(rng.randint(0, 12)))
        path.write_bytes(data)
        try:
            expected = ("text", data.decode("utf-8"))
        except UnicodeDecodeError as exc:
            if exc.reason == "unexpected end of data":
                expected = ("text", data[: exc.start].decode("utf-8"))
            else:
                line = data.count(b"\n", 0, exc.start) + 1
                expected = ("error", f"byte {exc.start}, line {line}: {exc.reason}, byte value 0x{data[exc.start]:02x}")
        for chunk in (1, 2, 3, 64):
            monkeypatch.setattr(sources_mod, "READ_CHUNK_BYTES", chunk)
            try:
                got = ("text", "".join(sources_mod._text_chunks(path)))
            except DataError as exc:
                got = ("error", str(exc).split("(", 1)[1].split(")", 1)[0])
            assert got == expected, (data, chunk)


def test_csv_lines_are_split_as_a_file_opened_with_newline_empty():
    rng = random.Random(0)
    for _ in range(200):
        text = "".join(rng.choice(["a", ",", "\r", "\n", "\r\n", '"']) for _ in range(rng.randint(0, 15)))
        want = list(io.StringIO(text, newline=""))
        for size in (1, 2, 3):
            chunks = iter([text[k:k + size] for k in range(0, len(text), size)])
            assert list(sources_mod._universal_lines(chunks)) == want, (text, size)


def test_csv_reads_the_same_whatever_the_chunks(tmp_path, monkeypatch):
    path = tmp_path / "rows.csv"
    path.write_bytes(BOM + 'instruction,output\r\n"caf\u00e9\r\nline 2",ok\r\nq2,"a ""b"""\rq3,\u20ac\n'.encode())
    (outcome,) = _same_whatever_the_chunks(monkeypatch, path, options=({},))
    assert outcome[1] == [{"instruction": "caf\u00e9\r\nline 2", "output": "ok"},
                          {"instruction": "q2", "output": 'a "b"'}, {"instruction": "q3", "output": "\u20ac"}]
    latin1 = b"".join(f"caf\xe9 {i},ok\n".encode("latin-1") for i in range(3))
    path.write_bytes(b"instruction,output\n" + latin1)
    (bad,) = _same_whatever_the_chunks(monkeypatch, path, options=({},))
    assert "not UTF-8 text (byte 22, line 2: invalid continuation byte, byte value 0xe9)" in bad[1]


def test_a_corrupt_gzip_stream_is_a_clear_error(tmp_path, monkeypatch):
    # zlib.error (not an OSError) escaped as a traceback from the whole-file read.
    blob = bytearray(gzip.compress(b"".join(b'{"text": "row %d %s"}\n' % (i, b"x" * 50) for i in range(200))))
    blob[len(blob) // 2] ^= 0xFF
    blob[len(blob) // 2 + 1] ^= 0xFF
    path = tmp_path / "rows.jsonl.gz"
    path.write_bytes(bytes(blob))
    (outcome,) = _same_whatever_the_chunks(monkeypatch, path, options=({},))
    assert outcome[0] == "error"
    assert "is named .gz but is not a valid gzip file (Error -3 while decompressing" in outcome[1]


def _batches(path, batch_rows, **options):
    return list(iter_source(DatasetConfig(path=str(path), **options), 0, batch_rows=batch_rows))


def test_batches_hold_their_own_rows_and_the_last_carries_the_flags(tmp_path):
    path = tmp_path / "rows.jsonl"
    lines = ["1", "2"] + [json.dumps({"text": str(i)}) for i in range(8)] + ["{bad", "", "{bad"] + ['{"text": "cut']
    path.write_text("\n".join(lines))
    batches = _batches(path, 3, allow_truncated_json=True)
    assert [len(b.rows) + len(b.bad) for b in batches] == [3, 3, 3, 3]
    assert all(b.location == str(path.resolve()) and b.index == 0 for b in batches)
    assert [b.columns for b in batches] == [["text"]] * 4  # known from the batch with the first dict row
    assert [b.truncated_json is not None for b in batches] == [False, False, False, True]
    whole = read_source(DatasetConfig(path=str(path), allow_truncated_json=True), 0)
    assert [r for b in batches for r in b.rows] == whole.rows
    assert whole.row_ids == [i for b in batches for i in b.row_ids] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert [i for b in batches for i, _ in b.bad] == [10, 12] and whole.truncated_json["records_kept"] == 10

    path.write_text("\n".join(["1", "2", "3"] + [json.dumps({"text": str(i)}) for i in range(4)]))
    first_cols = [b.columns for b in _batches(path, 2)]
    assert first_cols == [[], ["text"], ["text"], ["text"]]


def test_max_samples_counts_across_batches(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(['{"text": "a"}', "{bad", '{"text": "b"}', '{"text": "c"}', '{"text": "d"}']))
    batches = _batches(path, 1, max_samples=3)
    assert [(b.row_ids, [i for i, _ in b.bad]) for b in batches] == [([0], []), ([], [1]), ([2], [])]
    assert [b.stopped_early for b in batches] == [False, False, True]
    array = tmp_path / "rows.json"
    array.write_text(json.dumps([{"text": str(i)} for i in range(10)]))
    batches = _batches(array, 3, max_samples=7)
    assert [len(b.rows) for b in batches] == [3, 3, 1] and [b.stopped_early for b in batches] == [False, False, True]
    assert len(_batches(array, 3, max_samples=10)) == 4 and not _batches(array, 3, max_samples=10)[-1].stopped_early


def test_parquet_and_datasets_dirs_are_read_in_batches(tmp_path, monkeypatch):
    import datasets
    import pandas as pd

    monkeypatch.setattr(sources_mod, "DATASET_BLOCK_ROWS", 2)

    rows = [{"text": f"row {i}"} for i in range(10)]
    pd.DataFrame(rows).to_parquet(tmp_path / "rows.parquet", row_group_size=4)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "disk"))
    for name in ("rows.parquet", "disk"):
        batches = _batches(tmp_path / name, 3, max_samples=7)
        assert [len(b.rows) for b in batches] == [3, 3, 1], name
        assert [r for b in batches for r in b.rows] == rows[:7] and [b.stopped_early for b in batches] == [0, 0, 1]
        assert [i for b in batches for i in b.row_ids] == list(range(7))
        whole = _batches(tmp_path / name, 4)
        assert [len(b.rows) for b in whole] == [4, 4, 2] and not whole[-1].stopped_early


def test_an_empty_source_is_one_empty_batch(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("instruction,output\n")
    (batch,) = _batches(path, 3)
    assert batch.rows == [] and batch.columns == [] and not batch.stopped_early


def test_one_object_json_is_refused_even_in_batches_of_one(tmp_path):
    path = tmp_path / "one.json"
    path.write_text('{"data": [{"text": "a"}]}\n')
    with pytest.raises(DataError, match="holds one JSON object"):
        _batches(path, 1)


def _peak_mb(path, **options) -> float:
    tracemalloc.start()
    try:
        for batch in iter_source(DatasetConfig(path=str(path), **options), 0, batch_rows=64):
            del batch
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def test_memory_stays_bounded_by_a_few_chunks(tmp_path):
    # ~30 MB files of 2 KB records. The whole-file reader held the file's bytes and its decoded str at once:
    # tracemalloc peaks of the old read_source on these files, measured: 98.7 MB (JSON lines) and 67.1 MB (array),
    # of which 91.4 / 61.2 MB for the whole-file decode alone. Streaming holds a 1 MB read chunk, its text and a
    # batch of 64 rows: measured 4.5 MB for each file.
    filler = "x" * 2000
    lines = tmp_path / "big.jsonl"
    lines.write_text("".join(f'{{"id": {i}, "text": "caf\u00e9 {filler}"}}\n' for i in range(15_000)))
    array = tmp_path / "big.json"
    array.write_text("[" + ",\n".join(f'{{"id": {i}, "text": "{filler}", "n": {i}.5}}' for i in range(15_000)) + "]")
    for path in (lines, array):
        assert path.stat().st_size > 29e6
        assert _peak_mb(path) < 10, path.name
    assert sum(len(b.rows) for b in iter_source(DatasetConfig(path=str(array)), 0)) == 15_000
