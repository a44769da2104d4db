"""Peak RAM and wall time of `llmtune export` for a QLoRA run of an 8B-shaped model, measured on layer-reduced copies
and extrapolated to the full depth (docs/serving.md#ram-and-time-of-an-8b-export-on-a-cpu).

    python scripts/bench_export.py scripts/model_configs/llama-3.1-8b-instruct.json [--layers 2 4] [--dtype bf16]

For each layer count: a random model with the config's shapes (bf16 safetensors), a 1-step QLoRA SFT run of it
(4-bit NF4, LoRA r 16 on every linear layer, as recipes/llama3_8b_qlora_sft.yaml), then `llmtune export RUN --dtype D`
in a fresh process under /usr/bin/time (its maximum resident set size and wall time). Both grow affinely with the
layer count (the embeddings and the head once, every decoder layer alike), so two depths give the full model's
numbers by a straight line. Measured on this machine's CPUs; the time scales with its cores and disk.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def measure(config: dict, layers: int, dtype: str, work: Path) -> dict:
    from estimate_memory import build  # scripts/estimate_memory.py: the same random layer-reduced model

    model = build(config, layers, work / "model")
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 2?"}, {"role": "assistant",
                                                                            "content": f"It is {i + 2}."}]}
            for i in range(8)]
    (work / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {"stage": "sft", "model": {"name_or_path": str(model), "dtype": "bf16", "load_in_4bit": True,
                        "bnb_4bit_compute_dtype": "bf16"},
              "data": {"datasets": [{"path": str(work / "chat.jsonl")}], "max_length": 32},
              "adapter": {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0},
              "train": {"micro_batch_size": 1, "global_batch_size": 1, "max_steps": 1, "save_steps": 100},
              "output": {"dir": str(work / "run")}}  # fp32 optimizer math: transformers refuses bf16 on a CPU
    (work / "sft.yaml").write_text(yaml.safe_dump(recipe))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    trained = subprocess.run([sys.executable, "-m", "llmtune.commands.cli", "sft", str(work / "sft.yaml")], env=env,
                             capture_output=True, text=True)
    if trained.returncode != 0:
        raise SystemExit(trained.stdout[-2000:] + trained.stderr[-3000:])
    start = time.perf_counter()
    done = subprocess.run(["/usr/bin/time", "-v", sys.executable, "-m", "llmtune.commands.cli", "export",
                           str(work / "run"), "--dtype", dtype], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    rss_kib = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", done.stderr).group(1))
    report = json.loads((work / "run" / "merged" / "verification.json").read_text())
    return {"layers": layers, "peak_rss_gib": rss_kib / 2**20, "wall_s": wall, "passed": report["passed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--layers", type=int, nargs=2, default=[2, 4])
    parser.add_argument("--dtype", default="bf16")
    args = parser.parse_args()
    config = json.loads(Path(args.config).read_text())
    points = []
    for n in args.layers:
        with tempfile.TemporaryDirectory(prefix="llmtune-bench-export-") as tmp:
            points.append(measure(config, n, args.dtype, Path(tmp)))
            print(json.dumps(points[-1]), flush=True)
    (a, b), full = points, config["num_hidden_layers"]
    line = {k: a[k] + (b[k] - a[k]) / (b["layers"] - a["layers"]) * (full - a["layers"]) for k in ("peak_rss_gib",
                                                                                                   "wall_s")}
    print(json.dumps({"extrapolated_to_layers": full, **{k: round(v, 1) for k, v in line.items()},
                      "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))}))


if __name__ == "__main__":
    main()
