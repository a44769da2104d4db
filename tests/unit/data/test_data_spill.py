"""Disk-backed builds (llmtune.data.spill): the row stores, the mixed order, chunk-size independence, memory, and
the row files' clean-up."""

from __future__ import annotations

import json
import random
import tracemalloc

import numpy as np
import pytest

import llmtune.data.pipeline as pipeline
import llmtune.data.sources as data_sources
import llmtune.data.spill as spill
from llmtune.data import DataError, build_preference_data, build_prompt_data, build_sft_data
from llmtune.data.spill import SpillList, SpillView
from llmtune.data.unpaired import build_unpaired_data


def test_spill_list_behaves_as_a_list(tmp_path, monkeypatch):
    monkeypatch.setattr(spill, "READ_CHUNK_ROWS", 3)  # many short reads: run boundaries everywhere
    rng = random.Random(0)
    objs = [{"i": i, "ids": list(range(rng.randrange(50))), "text": "é" * rng.randrange(5)} for i in range(300)]
    store = SpillList(tmp_path)
    for obj in objs[:100]:
        assert store.append(obj) == obj["i"]
    assert store[5] == objs[5] and store[99] == objs[99]  # reads see earlier appends
    for obj in objs[100:]:
        store.append(obj)
    assert len(store) == 300 and list(store) == objs and store[-1] == objs[-1]
    assert store[10:250] == objs[10:250] and store[::7] == objs[::7] and store[290:400] == objs[290:]
    idx = [rng.randrange(300) for _ in range(500)]  # any order, with repeats
    assert store.take(idx) == [objs[i] for i in idx]
    view = SpillView(store, np.array(idx, dtype=np.int64))
    assert len(view) == 500 and list(view) == [objs[i] for i in idx]
    assert view[3] == objs[idx[3]] and view[7:20] == [objs[i] for i in idx[7:20]]
    assert view.take([4, 4, 0]) == [objs[idx[4]], objs[idx[4]], objs[idx[0]]]
    with pytest.raises(IndexError):
        store[300]
    store.close()
    assert not store.path.exists()


def _list_mix(cfg, sizes):
    """The mixed order as the in-memory pipeline computed it (a list of (source, index) tuples)."""
    rng = random.Random(cfg.seed)
    entries = []
    for s, (ds, n) in enumerate(zip(cfg.datasets, sizes)):
        copies = int(ds.weight)
        rest = round((ds.weight - copies) * n)
        entries += [(s, j) for _ in range(copies) for j in range(n)]
        entries += [(s, j) for j in sorted(rng.sample(range(n), rest))]
    rng.shuffle(entries)
    return entries


@pytest.mark.parametrize(("weights", "sizes", "seed"), [((1.0,), (17,), 0), ((1.5, 0.3, 2.0), (40, 11, 7), 3),
                                                         ((0.5, 1.0), (1000, 3), 42)])
def test_the_mixed_order_is_the_one_of_the_list_implementation(cfg, weights, sizes, seed):
    c = cfg(*({"path": f"s{i}.jsonl", "weight": w} for i, w in enumerate(weights)), seed=seed)
    offsets = np.cumsum([0, *sizes])
    mixed = pipeline.mix(c, list(sizes))
    # the same order, so recipes give the same train/eval split and training order as before
    assert [(int(np.searchsorted(offsets, g, side="right") - 1), g - int(offsets[np.searchsorted(offsets, g,
            side="right") - 1])) for g in mixed] == _list_mix(c, sizes)


def _chat(i: int, n: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}"},
                         {"role": "assistant", "content": f"answer {i} " + "word " * n}]}


@pytest.fixture()
def sources(write):
    rng = random.Random(1)
    rows = [_chat(i, rng.randrange(1, 40)) for i in range(60)]
    rows[7] = {"messages": [{"role": "user", "content": "no answer"}]}  # a bad row: ends with a user turn
    other = [_chat(100 + i, rng.randrange(1, 10)) for i in range(15)]
    return write("a.jsonl", rows), write("b.json", other)


def _snapshot(data):
    splits = {name: None if split is None else split.to_dict() for name, split in
              (("train", data.train), ("eval", data.eval))}
    return splits, json.loads(json.dumps(data.report.to_dict()))


@pytest.mark.parametrize("options", [
    {"val_size": 3},
    {"val_size": 0.1, "truncation": "drop", "max_length": 48},
    {"max_samples": 23, "val_size": 2},
    {"packing": True, "val_size": 4, "max_length": 96},
    {"num_proc": 2, "val_size": 3},  # one worker pool across many small chunks
])
def test_a_build_does_not_depend_on_the_chunk_sizes(tok, cfg, sources, monkeypatch, options):
    a, b = sources
    options = {"max_length": 64, "bad_rows": "skip", "cache": False, "num_proc": 1, **options}
    c = cfg(str(a), {"path": str(b), "weight": 1.5}, **options)
    reference = _snapshot(build_sft_data(c, tok))
    monkeypatch.setattr(pipeline, "TOKENIZE_CHUNK_ROWS", 4)
    monkeypatch.setattr(pipeline, "ARROW_CHUNK_ROWS", 3)
    monkeypatch.setattr(pipeline, "ARROW_CHUNK_VALUES", 50)
    monkeypatch.setattr(spill, "READ_CHUNK_ROWS", 2)
    small = _snapshot(build_sft_data(c, tok))
    assert small == reference
    splits, report = reference
    assert report["dropped"] and report["train_rows"] > 0  # the case has drops (and, but for drop, truncations)
    assert options.get("truncation") == "drop" or options.get("packing") or report["truncated_rows"]


def _peak_bytes(build) -> tuple[int, object]:
    tracemalloc.start()
    try:
        data = build()
        return tracemalloc.get_traced_memory()[1], data
    finally:
        tracemalloc.stop()


@pytest.mark.slow
def test_the_memory_of_a_build_does_not_grow_with_the_data(tok, write, cfg, monkeypatch):
    import datasets  # noqa: F401  (imported before measuring: module objects are not the build's memory)
    import pyarrow  # noqa: F401

    monkeypatch.setattr(pipeline, "ARROW_CHUNK_VALUES", 1 << 14, raising=False)
    monkeypatch.setattr(spill, "READ_CHUNK_BYTES", 1 << 15, raising=False)
    monkeypatch.setattr(pipeline, "TOKENIZE_CHUNK_ROWS", 256, raising=False)
    monkeypatch.setattr(data_sources, "BATCH_ROWS", 256, raising=False)  # the files here would fit one default batch
    monkeypatch.setattr(data_sources, "READ_CHUNK_BYTES", 1 << 15, raising=False)
    build_sft_data(cfg(str(write("warm.jsonl", [_chat(0, 3)] * 3)), cache=False), tok)  # lazy imports
    runs = []
    for n in (400, 1600):
        path = write(f"rows{n}.jsonl", [_chat(i, 60) for i in range(n)])
        c = cfg(str(path), max_length=4096, num_proc=1, cache=False, val_size=0.01)
        peak, data = _peak_bytes(lambda: build_sft_data(c, tok))
        runs.append((peak, data.report.tokens + data.report.eval_tokens))
        assert len(data.train) == data.report.train_rows == n - round(0.01 * n)
    (small, small_tokens), (big, big_tokens) = runs
    assert big_tokens > 3.9 * small_tokens > 400_000
    # Held in memory, the raw and tokenized rows grow with the data (>= 16 bytes per token for the two token lists
    # alone): the in-memory pipeline peaked at 3.1 and 12.5 MiB here, the streamed one at 2.8 and 2.9. The peak is a chunk of
    # rows and an Arrow batch, whatever the size.
    assert big < 1.25 * small, (f"peak {small / 2**20:.1f} MiB for {small_tokens} tokens, "
                                f"{big / 2**20:.1f} MiB for {big_tokens}")


def test_row_files_are_removed_after_a_build_and_after_a_failed_one(tok, write, cfg, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("LLMTUNE_DATA_CACHE", str(cache))
    made: list[SpillList] = []
    original = SpillList.__init__
    monkeypatch.setattr(SpillList, "__init__", lambda self, *a, **k: (original(self, *a, **k), made.append(self))[0])
    path = write("chat.jsonl", [_chat(i, 3) for i in range(10)])
    data = build_sft_data(cfg(str(path), val_size=2), tok)
    assert len(data.train) == 8 and made
    for store in made:  # built inside the cache entry's staging directory, gone after the build
        assert store.directory.parent.name.startswith(".staging-") and store.directory.parent.parent == cache
        assert not store.directory.exists() and store._file.closed
    assert not list(cache.rglob(".spill-*"))
    made.clear()
    bad = write("bad.jsonl", [_chat(0, 300), _chat(1, 300)])  # every row too long under truncation: drop
    with pytest.raises(DataError, match="no training rows left"):
        build_sft_data(cfg(str(bad), truncation="drop", max_length=32, cache=False), tok)
    assert made and all(not s.directory.exists() and s._file.closed for s in made)


@pytest.mark.parametrize("kind", ["preference", "prompt", "unpaired"])
def test_every_data_kind_builds_the_same_with_small_chunks(tok, write, cfg, monkeypatch, kind):
    pairs = [{"prompt": f"question {i}", "chosen": f"good answer {i}" + " yes" * (i % 7),
              "rejected": f"bad {i}"} for i in range(30)]
    rows = [{"prompt": f"q {i}", "completion": f"c {i}", "label": i % 3 != 0} for i in range(30)]
    path = write("data.jsonl", rows if kind == "unpaired" else pairs)
    c = cfg(str(path), val_size=3, max_length=24, cache=False, num_proc=1)
    build = {"preference": build_preference_data, "prompt": build_prompt_data, "unpaired": build_unpaired_data}[kind]
    reference = _snapshot(build(c, tok))
    monkeypatch.setattr(pipeline, "TOKENIZE_CHUNK_ROWS", 2)
    monkeypatch.setattr(pipeline, "ARROW_CHUNK_ROWS", 4)
    monkeypatch.setattr(spill, "READ_CHUNK_ROWS", 3)
    assert _snapshot(build(c, tok)) == reference
    assert len(reference[0]["eval"]["input_ids" if kind != "preference" else "chosen_input_ids"]) >= 3


def test_a_column_mapping_is_checked_against_every_batch(tok, write, cfg, monkeypatch):
    monkeypatch.setattr(data_sources, "BATCH_ROWS", 2)  # the first batch lacks the mapped column
    reads = []
    original = data_sources.iter_source
    monkeypatch.setattr(data_sources, "iter_source", lambda *a, **k: reads.append(1) or original(*a, **k))
    rows = [{"instruction": f"q{i}", "output": f"a{i}"} for i in range(3)]
    rows += [{"instruction": f"q{i}", "answer_text": f"a{i}"} for i in range(3, 9)]
    path = write("mixed.jsonl", rows)
    mapped = {"path": str(path), "format": "alpaca", "columns": {"output": "answer_text"}}
    data = build_sft_data(cfg(mapped, bad_rows="skip", cache=False), tok)
    assert [d["row"] for d in data.report.dropped] == [0, 1, 2]  # as when the whole file is checked at once
    assert data.report.train_rows == 6 and len(reads) == 2  # checked on the first batch, a scan, then read again
    with pytest.raises(DataError, match=r"columns\.output: column 'answer' is not in .*did you mean 'answer_text'"):
        build_sft_data(cfg({"path": str(path), "format": "alpaca", "columns": {"output": "answer"}}, cache=False), tok)


def test_a_full_disk_while_spilling_is_a_clear_error(tok, write, cfg, monkeypatch):
    import errno
    import os

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self.f, name)

    real = os.fdopen
    monkeypatch.setattr(spill.os, "fdopen", lambda *a, **k: FullDisk(real(*a, **k)))
    path = write("chat.jsonl", [_chat(i, 3) for i in range(5)])
    with pytest.raises(DataError, match=r"cannot write the data build's row files in .*No space left on device"):
        build_sft_data(cfg(str(path), cache=False), tok)


def test_with_max_samples_only_the_rows_reached_are_reported(tok, write, cfg, monkeypatch):
    from llmtune.data.errors import RowError
    from llmtune.data.formats import to_canonical
    from llmtune.data.sources import read_source
    from llmtune.data.tokenize import SFTTokenizer

    rng = random.Random(5)
    path = write("rows.jsonl", [_chat(i, rng.choice([2, 3, 60])) for i in range(400)])  # a third too long
    c = cfg(str(path), max_samples=150, truncation="drop", max_length=48, val_size=0, cache=False, num_proc=1)
    reports = []
    for chunk in (7, 100, 1024):
        monkeypatch.setattr(pipeline, "TOKENIZE_CHUNK_ROWS", chunk)
        reports.append(build_sft_data(c, tok).report.to_dict())
    assert reports[0] == reports[1] == reports[2]  # rows tokenized ahead of the stop do not leak into the report
    # reference: walk the mixed order row by row until max_samples rows are kept
    _, valid, _ = to_canonical(read_source(c.datasets[0], 0), c.datasets[0])
    fn = SFTTokenizer(tok, 48, "drop")
    kept, dropped = 0, []
    for g in pipeline.mix(c, [len(valid)]):
        try:
            fn(valid[g][1])
            kept += 1
        except RowError:
            dropped.append(valid[g][0])
        if kept == 150:
            break
    assert sorted(d["row"] for d in reports[0]["dropped"]) == sorted(dropped) and len(dropped) > 20


def test_many_sources_build_within_a_small_open_file_limit(tok, write, cfg):
    import os
    import resource

    paths = [write(f"s{i}.jsonl", [_chat(i, 2)]) for i in range(150)]
    c = cfg(*(str(p) for p in paths), val_size=2, cache=False, num_proc=1)
    build_sft_data(cfg(str(paths[0]), cache=False), tok)  # lazy imports (they open files) before the limit
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    open_now = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + 40, hard))  # fewer than one per source
    try:
        data = build_sft_data(c, tok)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert len(data.train) == 148 and len(data.report.sources) == 150


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.jsonl.gz"])
def test_a_source_that_cannot_be_opened_is_a_clear_error(tok, write, cfg, monkeypatch, tmp_path, name):
    import errno
    import gzip
    import os

    path = tmp_path / name
    text = "".join(json.dumps(_chat(i, 2)) + "\n" for i in range(3)).encode()
    path.write_bytes(gzip.compress(text) if name.endswith(".gz") else text)

    def denied(*args, **kwargs):
        raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(data_sources, "open", denied, raising=False)  # the module's own open, not the builtin
    monkeypatch.setattr(data_sources.gzip, "open", denied)
    with pytest.raises(DataError, match=r"rows\.jsonl(\.gz)?: cannot read it \(Permission denied\)"):
        build_sft_data(cfg(str(path), cache=False), tok)


def test_temporary_data_dirs_of_killed_processes_are_removed(tmp_path, monkeypatch):
    import os
    import socket
    import subprocess
    import sys
    import tempfile

    import llmtune.data.cache as cache
    import llmtune.data.workdir as workdir

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(workdir, "_temp_root", None)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    gone = tmp_path / f"llmtune-data-{host}-{int(dead.stdout)}-abc_1234"  # a `kill -9`ed build's leftovers
    (gone / ".spill-x").mkdir(parents=True)
    (gone / ".spill-x" / "canonical-1.pkl").write_bytes(b"x" * 100)
    alive = tmp_path / f"llmtune-data-{host}-{os.getppid()}-def_5678"  # a running process's: kept
    alive.mkdir()
    other = tmp_path / f"llmtune-data-other-host-{int(dead.stdout)}-ghi_9012"  # another host's: not ours to judge
    other.mkdir()
    path = cache.arrow_path("split", scratch=True)
    assert not gone.exists() and alive.exists() and other.exists()
    assert path.parent.name.startswith(f"llmtune-data-{host}-{os.getpid()}-")


def test_the_mapping_is_checked_on_the_first_object_rows(tok, write, cfg, monkeypatch):
    monkeypatch.setattr(data_sources, "BATCH_ROWS", 4)  # the first batches hold no object row at all
    path = write("late.jsonl", ["not an object"] * 9 + [{"conversations": [{"from": "human", "value": "hi"},
                                                                   {"from": "gpt", "value": "yo"}]}] * 3)
    mapped = {"path": str(path), "format": "sharegpt", "columns": {"role": "frm"}}
    with pytest.raises(DataError, match=r"columns\.role: column 'frm' is not in .*did you mean 'from'"):
        build_sft_data(cfg(mapped, bad_rows="skip", cache=False), tok)  # as the whole-file check said
    with pytest.raises(DataError, match=r"Columns found: conversations"):  # not "(none)"
        build_sft_data(cfg({"path": str(path), "format": "alpaca"}, bad_rows="skip", cache=False), tok)
