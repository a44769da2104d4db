"""The tokenized-data cache (llmtune.data.cache): reuse, keys, crash safety, corrupt entries, every data kind."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest

import llmtune.data.tokenize as tokenize_mod
import llmtune.utils as utils
from llmtune.data import DataError, build_preference_data, build_prompt_data, build_sft_data
from llmtune.data.cache import META, cache_key, source_fingerprints
from llmtune.data.report import DataReport, SourceReport
from llmtune.data.tokenize import auto_num_proc
from llmtune.data.unpaired import build_unpaired_data
from llmtune.models.tiny import make_tiny_tokenizer

CHAT = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"answer {i}"}]}
        for i in range(12)]


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("LLMTUNE_DATA_CACHE", str(path))
    return path


def _entries(cache_dir):
    return sorted(p for p in cache_dir.iterdir() if (p / META).is_file()) if cache_dir.exists() else []


def _count_tokenizer_calls(monkeypatch) -> list:
    calls = []
    original = tokenize_mod.SFTTokenizer.__call__
    monkeypatch.setattr(tokenize_mod.SFTTokenizer, "__call__", lambda self, row: calls.append(1) or original(self, row))
    return calls


def test_second_build_reuses_the_cache_with_identical_rows_and_report(tok, write, cfg, cache_dir, monkeypatch):
    path = write("chat.jsonl", CHAT)
    calls = _count_tokenizer_calls(monkeypatch)
    first = build_sft_data(cfg(path, val_size=2), tok)
    assert len(calls) == 12 and len(_entries(cache_dir)) == 1
    second = build_sft_data(cfg(path, val_size=2, num_proc=1), tok)  # num_proc does not change the result
    assert len(calls) == 12  # nothing tokenized again
    assert second.train["input_ids"] == first.train["input_ids"] and second.train["labels"] == first.train["labels"]
    assert second.eval["input_ids"] == first.eval["input_ids"]
    assert second.report.to_dict() == first.report.to_dict()
    # memory-mapped Arrow files inside the cache entry, on the miss and on the hit
    for data in (first, second):
        assert str(cache_dir) in data.train.cache_files[0]["filename"]


def test_what_changes_the_result_changes_the_key(tok, write, cfg, cache_dir, tmp_path):
    path = write("chat.jsonl", CHAT)
    build_sft_data(cfg(path), tok)
    build_sft_data(cfg(path, max_length=64), tok)
    other = make_tiny_tokenizer()
    other.chat_template = other.chat_template.replace("<|im_start|>", "<|im_start|> ")
    build_sft_data(cfg(path), other)
    assert len(_entries(cache_dir)) == 3
    # the same file name with other content: a new entry with the new rows, never the stale ones
    edited = [dict(r) for r in CHAT]
    edited[0] = {"messages": [{"role": "user", "content": "new"}, {"role": "assistant", "content": "changed text"}]}
    path.write_text("".join(json.dumps(r) + "\n" for r in edited))
    data = build_sft_data(cfg(path), tok)
    assert len(_entries(cache_dir)) == 4
    assert any("changed text" in tok.decode(ids) for ids in data.train["input_ids"])


def test_a_failed_build_stores_nothing_and_a_dead_staging_dir_is_removed(tok, write, cfg, cache_dir):
    bad = write("bad.jsonl", CHAT[:3] + [{"messages": [{"role": "assistant", "content": "no user"}]}])
    with pytest.raises(DataError, match="bad row"):
        build_sft_data(cfg(bad), tok)
    # no entry, no staging left behind (only the lock file of the key)
    assert _entries(cache_dir) == [] and [p.suffix for p in cache_dir.iterdir()] == [".lock"]
    old = cache_dir / ".staging-abc-otherhost-123-x1"
    old.mkdir()
    os.utime(old, (0, 0))  # a build on another host, long ago
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # a process that no longer exists, as a killed build
    killed = cache_dir / f".staging-abc-{socket.gethostname()}-{child.pid}-x2"
    live = cache_dir / f".staging-abc-{socket.gethostname()}-{os.getpid()}-x3"  # a build still running
    killed.mkdir(), live.mkdir()
    build_sft_data(cfg(write("ok.jsonl", CHAT)), tok)
    assert not old.exists() and not killed.exists() and live.exists() and len(_entries(cache_dir)) == 1


def test_a_corrupt_entry_is_rebuilt(tok, write, cfg, cache_dir, capfd):
    path = write("chat.jsonl", CHAT)
    first = build_sft_data(cfg(path), tok).train["input_ids"][:]  # read now: the file is overwritten below
    (entry,) = _entries(cache_dir)
    arrow = next(entry.glob("*.arrow"))
    arrow.write_bytes(arrow.read_bytes()[:50])  # cut off, as by a full disk or a copy that died
    capfd.readouterr()
    again = build_sft_data(cfg(path), tok)
    assert "cannot be read" in capfd.readouterr().err
    assert again.train["input_ids"][:] == first and len(first) == 12


def test_a_hit_sets_the_chat_template_the_build_set(write, cfg, cache_dir):
    path = write("chat.jsonl", CHAT)
    build_sft_data(cfg(path, chat_template="llama3"), make_tiny_tokenizer())
    fresh = make_tiny_tokenizer()
    build_sft_data(cfg(path, chat_template="llama3"), fresh)
    assert len(_entries(cache_dir)) == 1 and "<|start_header_id|>" in fresh.chat_template


def test_cache_off_still_gives_file_backed_datasets(tok, write, cfg, cache_dir, monkeypatch):
    path = write("chat.jsonl", CHAT)
    calls = _count_tokenizer_calls(monkeypatch)
    for _ in range(2):
        data = build_sft_data(cfg(path, cache=False), tok)
    assert len(calls) == 24 and _entries(cache_dir) == []
    assert data.train.cache_files and str(cache_dir) not in data.train.cache_files[0]["filename"]
    monkeypatch.setenv("LLMTUNE_DATA_CACHE", "off")
    assert cache_key("sft", cfg(path), tok, ".", {}) is not None  # the key exists; the switch is in cache_root
    build_sft_data(cfg(path), tok)
    assert len(calls) == 36


def test_every_data_kind_is_cached(tok, write, cfg, cache_dir):
    pairs = write("pairs.jsonl", [{"prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(8)])
    unpaired = write("kto.jsonl", [{"prompt": f"q{i}", "completion": f"c {i}", "label": i % 2 == 0} for i in range(8)])
    prompts = write("prompts.jsonl", [{"question": f"q{i}", "answer": f"{i}"} for i in range(8)])
    builds = [
        lambda: build_preference_data(cfg(pairs, chat_template="chatml"), tok),
        lambda: build_unpaired_data(cfg(unpaired, chat_template="chatml"), tok),
        lambda: build_prompt_data(cfg({"path": str(prompts), "format": "alpaca",
                                       "columns": {"instruction": "question", "output": "answer"}}), tok),
    ]
    for i, build in enumerate(builds):
        first = build()
        assert len(_entries(cache_dir)) == i + 1
        second = build()
        assert len(_entries(cache_dir)) == i + 1  # a hit
        assert second.train.to_list() == first.train.to_list() and second.report.to_dict() == first.report.to_dict()
    assert builds[2]().train["reference"] == first.train["reference"]


def test_auto_num_proc(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert auto_num_proc(1999) == 1 and auto_num_proc(2000) == 8
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert auto_num_proc(10**6) == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert auto_num_proc(10**6) == 1


BUILD_SCRIPT = """
import sys, time
import llmtune.data.tokenize as tokenize_mod
from llmtune.config.schema import DataConfig, DatasetConfig
from llmtune.data import build_sft_data
from llmtune.models.tiny import make_tiny_tokenizer

original = tokenize_mod.SFTTokenizer.__call__
def counted(self, row):
    with open(sys.argv[2], "a") as fh:
        fh.write("x\\n")
    time.sleep(0.05)  # a slow tokenizer: both processes start while the first one builds
    return original(self, row)
tokenize_mod.SFTTokenizer.__call__ = counted
import os, pathlib
pathlib.Path(sys.argv[3], f"ready-{os.getpid()}").touch()  # imports done: both start the build together
while not pathlib.Path(sys.argv[3], "go").exists():
    time.sleep(0.01)
data = build_sft_data(DataConfig(datasets=[DatasetConfig(path=sys.argv[1])], val_size=2), make_tiny_tokenizer())
print(len(data.train), data.train.cache_files[0]["filename"])
"""


@pytest.mark.slow  # two interpreters importing torch: ~10 s
def test_concurrent_builds_of_one_entry_tokenize_once(write, cache_dir, tmp_path):
    """Ranks of a launch build the same data at the same time: one tokenizes, the others wait and read its entry."""
    path = write("chat.jsonl", CHAT)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "LLMTUNE_DATA_CACHE": str(cache_dir), "HF_HUB_OFFLINE": "1"}
    sync = tmp_path / "sync"
    sync.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, str(path), str(calls), str(sync)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    import time

    deadline = time.time() + 120
    while len(list(sync.glob("ready-*"))) < 2 and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    (sync / "go").touch()  # both interpreters are up: their builds start within milliseconds of each other
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert len(calls.read_text().splitlines()) == 12  # not 24
    (entry,) = _entries(cache_dir)
    assert [o[0].split() for o in outs] == [["10", o[0].split()[1]] for o in outs]
    assert all(str(entry) in o[0] for o in outs)
    assert sum("waiting for another process" in o[1] for o in outs) == 1


def test_a_cache_dir_where_no_file_can_be_created_is_a_clear_error(tok, write, cfg, tmp_path, monkeypatch):
    """/proc: mkdir succeeds (it exists) but no lock file can be made; filelock alone hangs there for ever."""
    monkeypatch.setenv("LLMTUNE_DATA_CACHE", "/proc")
    with pytest.raises(DataError, match="cannot create the data cache directory /proc or write in it"):
        build_sft_data(cfg(write("chat.jsonl", CHAT)), tok)


def test_bad_cache_days_and_a_meta_without_a_template_key(tok, write, cfg, cache_dir, monkeypatch, capfd):
    import pickle

    path = write("chat.jsonl", CHAT)
    monkeypatch.setenv("LLMTUNE_DATA_CACHE_DAYS", "abc")
    with pytest.raises(DataError, match="LLMTUNE_DATA_CACHE_DAYS='abc': expected a positive number"):
        build_sft_data(cfg(path), tok)
    monkeypatch.delenv("LLMTUNE_DATA_CACHE_DAYS")
    first = build_sft_data(cfg(path), tok).train["input_ids"][:]
    (entry,) = _entries(cache_dir)
    meta = pickle.loads((entry / META).read_bytes())
    del meta["chat_template"]  # a damaged or foreign meta.pkl: rebuilt, not a traceback
    (entry / META).write_bytes(pickle.dumps(meta))
    capfd.readouterr()
    assert build_sft_data(cfg(path), tok).train["input_ids"][:] == first
    assert "cannot be read (KeyError" in capfd.readouterr().err
    assert oct(cache_dir.stat().st_mode & 0o777) == "0o700"  # private: meta.pkl is a pickle


KILLED_SCRIPT = """
import sys, time
import llmtune.data.tokenize as tokenize_mod
from llmtune.config.schema import DataConfig, DatasetConfig
from llmtune.data import build_sft_data
from llmtune.models.tiny import make_tiny_tokenizer

original = tokenize_mod.SFTTokenizer.__call__
def slow(self, row):
    time.sleep(0.5)
    return original(self, row)
tokenize_mod.SFTTokenizer.__call__ = slow
build_sft_data(DataConfig(datasets=[DatasetConfig(path=sys.argv[1])], num_proc=2), make_tiny_tokenizer())
"""


@pytest.mark.slow  # an interpreter importing torch, then worker processes: ~10 s
def test_tokenization_workers_die_with_a_killed_parent(write, cache_dir):
    import signal
    import time

    import psutil

    path = write("chat.jsonl", CHAT * 20)
    env = {**os.environ, "LLMTUNE_DATA_CACHE": str(cache_dir), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_SCRIPT, str(path)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parent = psutil.Process(proc.pid)
    deadline = time.time() + 90
    while len(parent.children()) < 2 and time.time() < deadline:
        time.sleep(0.2)
    workers = parent.children()
    assert len(workers) >= 2, "no tokenization workers started"
    time.sleep(1.0)  # the workers are tokenizing
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(workers, timeout=10)
    for p in alive:
        p.kill()
    assert not alive  # killed with their parent, not left running (re-parented to init)


def test_the_cache_key_and_the_lineage_hash_a_source_with_one_function(cfg, tmp_path, monkeypatch):
    src = tmp_path / "shards"
    (src / "b").mkdir(parents=True)
    (src / "a.arrow").write_bytes(b"alpha")
    (src / "b" / "c.arrow").write_bytes(b"gamma")
    single = tmp_path / "one.jsonl"
    single.write_bytes(b'{"text": "x"}\n')
    expected_dir = hashlib.sha256(b"a.arrow\0alpha" + b"b/c.arrow\0gamma").hexdigest()
    reads = []
    feed = utils._feed_file
    monkeypatch.setattr(utils, "_feed_file", lambda digest, path, *a: reads.append(path) or feed(digest, path, *a))

    keys = [s["sha256"] for s in source_fingerprints(cfg(src, single), tmp_path)]
    report = DataReport(sources=[SourceReport(path=str(p), location=str(p), format="arrow", rows_read=1)
                                 for p in (src, single)])
    lineage = [s["sha256"] for s in report.sources_lineage()]
    # one definition: a directory folds in the relative names (the old lineage hash did not), a file is its bytes
    assert keys == lineage == [expected_dir, hashlib.sha256(single.read_bytes()).hexdigest()]
    assert len(reads) == 3  # memoised: the lineage read no file again
    # a file moved inside the directory (same bytes) is another source
    (src / "b" / "c.arrow").rename(src / "c.arrow")
    assert utils.content_sha256(src) == hashlib.sha256(b"a.arrow\0alpha" + b"c.arrow\0gamma").hexdigest()
    # a changed file is hashed again, not taken from the memo
    single.write_bytes(b'{"text": "longer"}\n')
    assert utils.content_sha256(single) == hashlib.sha256(single.read_bytes()).hexdigest()
    assert utils.content_sha256(tmp_path / "missing") is None and utils.content_sha256(src / "b") is None


def test_the_hash_memo_does_not_mix_up_a_directory_and_its_only_file(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.jsonl").write_bytes(b"row\n")
    assert utils.content_sha256(tmp_path / "d") == hashlib.sha256(b"x.jsonl\0row\n").hexdigest()
    assert utils.content_sha256(tmp_path / "d" / "x.jsonl") == hashlib.sha256(b"row\n").hexdigest()
