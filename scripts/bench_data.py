#!/usr/bin/env python
"""Data pipeline benchmark: rows/s, peak RSS and cached rerun time of ``llmtune validate`` on a large source.

    python scripts/bench_data.py                       # builtin:sharegpt, SmolLM2 tokenizer, max_length 2048
    python scripts/bench_data.py --max-samples 2000    # a quick look
    python scripts/bench_data.py --num-proc 2 --out bench_data.json

Each run is ``llmtune validate RECIPE`` in its own subprocess (so peak RSS is that process's, from ``wait4``);
the runs are, in order:

1. ``cold``: an empty data cache (``data.cache_dir`` = a fresh directory): read, convert, tokenize, write the cache;
2. ``cached``: the same command again: the tokenized data is read back from the cache;
3. ``no_cache`` (``--no-cache-run``): ``data.cache: false``, the pipeline without the cache.

Rows/s = canonical rows read (``rows_read`` of the data report) / wall seconds of the whole command (tokenizer
loading and the report included). Works on code without the cache (pass ``--no-cache-keys``: only the cold run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RECIPE = """\
stage: sft
model:
  name_or_path: builtin:smollm2-135m-instruct
data:
  datasets:
    - path: builtin:sharegpt
      allow_truncated_json: true
{max_samples}  max_length: {max_length}
  bad_rows: skip
  val_size: 0.01
{extra}output:
  dir: {run_dir}
"""


def run(cmd: list[str], env: dict) -> dict:
    """Run ``cmd``; return wall seconds, peak RSS (GiB) of the process tree's largest process, rc and output."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    return {"wall_s": round(wall, 2), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 3),
            "user_s": round(usage.ru_utime, 1), "rc": os.waitstatus_to_exitcode(status), "output": out}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-samples", type=int, default=None, help="rows of the source (default: all)")
    parser.add_argument("--max-length", type=int, default=2048)
    parser.add_argument("--num-proc", type=int, default=None, help="data.num_proc (default: the recipe default)")
    parser.add_argument("--no-cache-keys", action="store_true", help="code without data.cache: only the cold run")
    parser.add_argument("--no-cache-run", action="store_true", help="also run once with data.cache: false")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmtune-bench-data-"))
    extra = "" if args.num_proc is None else f"  num_proc: {args.num_proc}\n"
    if not args.no_cache_keys:
        extra += f"  cache_dir: {work / 'cache'}\n"
    recipe = work / "recipe.yaml"
    recipe.write_text(RECIPE.format(
        max_samples="" if args.max_samples is None else f"      max_samples: {args.max_samples}\n",
        max_length=args.max_length, extra=extra, run_dir=work / "run"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "llmtune", "validate", str(recipe)]
    runs = {"cold": run(cmd, env)}
    if not args.no_cache_keys:
        runs["cached"] = run(cmd, env)
        if args.no_cache_run:
            runs["no_cache"] = run(cmd + ["data.cache=false"], env)
    for name, r in runs.items():
        if r["rc"] != 0:
            print(r["output"][-3000:])
            print(f"{name}: llmtune validate failed (rc {r['rc']})")
            return 1
    cold_out = runs["cold"]["output"]
    rows = _rows_read(cold_out)
    print(f"{'run':<10} {'wall s':>8} {'user s':>8} {'peak RSS GiB':>13} {'rows/s':>9}")
    for name, r in runs.items():
        rate = rows / r["wall_s"] if rows else float("nan")
        r["rows_per_s"] = round(rate, 1)
        print(f"{name:<10} {r['wall_s']:>8.1f} {r['user_s']:>8.1f} {r['peak_rss_gib']:>13.2f} {rate:>9.0f}")
    print(f"rows read: {rows}; summary line: {_summary_line(cold_out)}")
    if args.out:
        args.out.write_text(json.dumps({"rows_read": rows, "args": vars(args) | {"out": str(args.out)},
                                        "runs": {k: {x: v for x, v in r.items() if x != "output"}
                                                 for k, r in runs.items()}}, indent=2))
    return 0


def _rows_read(output: str) -> int | None:
    """Rows read, from the source table printed by ``llmtune validate`` (``builtin:sharegpt  sharegpt  READ ...``)."""
    for line in output.splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[0] == "builtin:sharegpt" and parts[2].replace(",", "").isdigit():
            return int(parts[2].replace(",", ""))
    return None


def _summary_line(output: str) -> str:
    return next((line.strip() for line in output.splitlines() if "train" in line and "rows" in line), "")


if __name__ == "__main__":
    sys.exit(main())
