"""GPU acceptance: every GPU path llmtune promises, through the `llmtune` CLI, on one machine, in < 9 minutes.

Usage (see scripts/gpu_acceptance.sh, the one command to run on the lent H200):
    python scripts/gpu_acceptance.py [--out DIR]          # GPU: random-init ~1.1B Llama (TinyLlama shape), bf16
    python scripts/gpu_acceptance.py --tiny [--out DIR]   # CPU dry run: 2-layer Llama, fp32 (also run by the tests)
    python scripts/gpu_acceptance.py --only sft,dpo       # a subset (names below)

Checks (each a subprocess of the CLI, `python -m llmtune ...`, on models built from a config):
  sft_lora   bf16 LoRA SFT on one fixed batch repeated: finite metrics, loss decreasing; export verifies; reloads
  sft_qlora  the same with QLoRA (nf4 + double quant)
  dpo        DPO from sft_lora on fixed pairs: loss decreasing, reward margin up; export verifies; reloads
  ppo        a short PPO from sft_lora with a reward function: finite metrics, non-zero updates; export; reloads
  grpo       a short GRPO with the same reward (only if the grpo stage exists)
  zero3      ZeRO-3 LoRA and ZeRO-3 QLoRA (scripts/gpu_zero3_check.py): every saved adapter tensor whole and trained
  bench      scripts/bench.py --gpu (--tiny on CPU) side by side with TRL, if the benchmark exists
Each record holds the peak memory measured (metrics.jsonl `peak_mem_gb`) next to the estimate llmtune printed
(`memory_estimate_gb` in lineage.json's summary, when the core writes one). Results: DIR/result.json (+ one log per
check in DIR); exit code 0 only if every check that ran passed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ("sft_lora", "sft_qlora", "dpo", "ppo", "grpo", "zero3", "bench")
REWARD_MODULE = '''"""A toy reward with spread even for a random model: the share of vowels among the completion's letters."""


def vowel_reward(prompts, completions, references=None):
    letters = [[ch for ch in c.lower() if ch.isalpha()] for c in completions]
    return [sum(ch in "aeiou" for ch in ls) / len(ls) if ls else 0.0 for ls in letters]
'''


def build_model(root: Path, tiny: bool) -> Path:
    """Random-init Llama (+ the offline tiny tokenizer) saved as a local HF directory (shared with the ZeRO check)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_zero3_check import build_model as build  # noqa: PLC0415  (scripts/ is not a package)

    return build(root, tiny)


def write_data(root: Path) -> dict[str, Path]:
    """One fixed SFT batch repeated, fixed preference pairs, prompts with references."""
    sea = "the sea is wide and blue and the waves come in and out of the bay all day"
    sft = [{"messages": [{"role": "user", "content": f"Describe the sea ({i % 4})."},
                         {"role": "assistant", "content": sea}]} for i in range(64)]
    pairs = [{"prompt": f"Describe the sea ({i % 4}).", "chosen": sea, "rejected": "no " * 12} for i in range(64)]
    prompts = [{"prompt": f"What colour is the sea ({i})?", "completion": "blue"} for i in range(64)]
    out = {}
    for name, rows in (("sft", sft), ("pairs", pairs), ("prompts", prompts)):
        out[name] = root / f"{name}.jsonl"
        out[name].write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (root / "acceptance_rewards.py").write_text(REWARD_MODULE)
    return out


def recipe(root: Path, name: str, stage: str, tiny: bool, **sections) -> Path:
    common = {
        "adapter": {"lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"},
        "precision": {} if tiny else {"bf16": True},
        "output": {"dir": str(root / name), "overwrite": True},
    }
    body = {"stage": stage, **common, **sections}
    body["train"] = {"micro_batch_size": 4, "global_batch_size": 4, "learning_rate": 1e-3, "lr_scheduler": "constant",
                     "gradient_checkpointing": not tiny, "seed": 0, **sections.get("train", {})}
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def run_logged(cmd: list[str], log: Path, timeout: float, cwd: Path, env: dict | None = None) -> tuple[int, float]:
    """Run ``cmd`` with stdout+stderr appended to ``log``; returns (exit code, 124 on timeout; seconds)."""
    start = time.perf_counter()
    with open(log, "a") as fh:
        fh.write(f"$ {' '.join(cmd)}\n")
        fh.flush()
        try:
            rc = subprocess.call(cmd, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout,
                                 env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, round(time.perf_counter() - start, 1)


def cli(root: Path, name: str, *args: str, timeout: int) -> tuple[int, str, float]:
    """Run ``python -m llmtune ARGS`` in ``root``; returns (exit code, log path, seconds)."""
    log = root / f"{name}.log"
    path = os.pathsep.join(p for p in (str(ROOT), str(root), os.environ.get("PYTHONPATH")) if p)
    rc, wall = run_logged([sys.executable, "-m", "llmtune", *args], log, timeout, root, {"PYTHONPATH": path})
    return rc, str(log), wall


def read_metrics(run: Path) -> tuple[list[dict], list[dict]]:
    records = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:  # a torn last line is not this check's concern
            continue
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if any(k.startswith("eval_") for k in r)]
    return train, evals


def finite(records: list[dict]) -> bool:
    return all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))


def export_and_reload(root: Path, run: Path, name: str, tiny: bool, timeout: int) -> dict:
    """`llmtune export` (its own verification must pass), then load the merged model with plain transformers on the
    device and check one forward is finite."""
    rc, log, wall = cli(root, f"{name}_export", "export", str(run), "--dtype", "fp32" if tiny else "bf16",
                        timeout=timeout)
    result = {"export_rc": rc, "export_s": wall}
    merged = run / "merged"
    if rc != 0 or not (merged / "config.json").is_file():
        result["export_passed"] = False
        return result
    report = merged / "verification.json"
    result["export_report"] = json.loads(report.read_text()) if report.is_file() else None
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32 if tiny else torch.bfloat16).to(device)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5]], device=device)).logits
    result.update(export_passed=True, reload_finite=bool(torch.isfinite(logits).all()))
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def summarise(run: Path, rc: int, log: str, wall: float, steps: int) -> dict:
    result: dict = {"returncode": rc, "wall_s": wall, "log": log}
    if rc != 0 or not (run / "metrics.jsonl").is_file():
        result["passed"] = False
        result["log_tail"] = Path(log).read_text()[-3000:]
        return result
    train, evals = read_metrics(run)
    lineage = json.loads((run / "lineage.json").read_text()) if (run / "lineage.json").is_file() else {}
    summary = lineage.get("summary", {})
    result.update(
        steps=len(train), losses=[round(r["loss"], 5) for r in train],
        peak_mem_gb=max((r.get("peak_mem_gb", 0.0) for r in train), default=None),
        memory_estimate_gb=summary.get("memory_estimate_gb"),
        finite=finite(train) and finite(evals), lineage=bool(lineage),
    )
    result["passed"] = bool(result["finite"] and result["lineage"] and len(train) == steps)
    return result


def check_sft(root, model, data, args, name, qlora=False) -> dict:
    steps = 6
    path = recipe(root, name, "sft", args.tiny, model={"name_or_path": str(model), "load_in_4bit": qlora},
                  data={"datasets": [{"path": str(data["sft"])}], "max_length": 64, "val_size": 0},
                  train={"max_steps": steps, "learning_rate": 3e-3})
    rc, log, wall = cli(root, name, "sft", str(path), timeout=args.timeout)
    result = summarise(root / name, rc, log, wall, steps)
    if result["passed"]:
        losses = result["losses"]
        result["loss_decreased"] = losses[-1] < losses[0]
        result.update(export_and_reload(root, root / name, name, args.tiny, args.timeout))
        result["passed"] = bool(result["loss_decreased"] and result.get("export_passed") and result.get("reload_finite"))
    return result


def check_dpo(root, model, data, args) -> dict:
    steps = 6
    path = recipe(root, "dpo", "dpo", args.tiny, model={"from_run": str(root / "sft_lora")},
                  data={"datasets": [{"path": str(data["pairs"]), "format": "preference"}], "max_length": 64,
                        "val_size": 0},
                  train={"max_steps": steps, "learning_rate": 3e-3})
    rc, log, wall = cli(root, "dpo", "dpo", str(path), timeout=args.timeout)
    result = summarise(root / "dpo", rc, log, wall, steps)
    if result["passed"]:
        train, _ = read_metrics(root / "dpo")
        margins = [r.get("rewards/margins") for r in train]
        result["margins"] = margins
        result["loss_decreased"] = result["losses"][-1] < result["losses"][0]
        result.update(export_and_reload(root, root / "dpo", "dpo", args.tiny, args.timeout))
        result["passed"] = bool(result["loss_decreased"] and result.get("export_passed") and result.get("reload_finite"))
    return result


def check_online(root, model, data, args, stage: str) -> dict:
    """PPO (or GRPO) from sft_lora with the toy reward function: 2 optimizer steps, finite metrics, export."""
    sections = {
        "model": {"from_run": str(root / "sft_lora")},
        "data": {"datasets": [{"path": str(data["prompts"])}], "max_length": 64, "val_size": 4},
        "reward": {"function": "acceptance_rewards:vowel_reward"},
        "train": {"max_steps": 2, "learning_rate": 1e-3, "eval_batch_size": 4},
        "rollout": {"max_new_tokens": 8},
    }
    if stage == "ppo":
        sections["ppo"] = {"rollout_batch_size": 4, "ppo_epochs": 2}
    else:
        sections["grpo"] = {"num_generations": 4, "rollout_batch_size": 8, "num_iterations": 1}
    path = recipe(root, stage, stage, args.tiny, **sections)
    rc, log, wall = cli(root, stage, stage, str(path), timeout=args.timeout)
    result = summarise(root / stage, rc, log, wall, 2)
    if result["passed"]:
        train, _ = read_metrics(root / stage)
        result["grad_norms"] = [r.get("grad_norm") for r in train]
        result["trained"] = any((g or 0.0) > 0 for g in result["grad_norms"])  # the reward had spread: updates happened
        result.update(export_and_reload(root, root / stage, stage, args.tiny, args.timeout))
        result["passed"] = bool(result["trained"] and result.get("export_passed") and result.get("reload_finite"))
    return result


def check_zero3(root, args) -> dict:
    out = root / "zero3"
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_zero3_check.py"), "--out", str(out)] + (["--tiny"] if args.tiny else [])
    log = root / "zero3.log"
    rc, wall = run_logged(cmd, log, args.timeout, ROOT)
    result = {"returncode": rc, "wall_s": wall, "log": str(log)}
    report = out / "result.json"
    if report.is_file():
        result["report"] = json.loads(report.read_text())
    result["passed"] = rc == 0 and bool(result.get("report", {}).get("passed"))
    return result


def check_bench(root, args) -> dict | None:
    bench = ROOT / "scripts" / "bench.py"
    if not bench.is_file():
        return None
    log = root / "bench.log"
    out = root / "bench.json"
    cmd = [sys.executable, str(bench), "--tiny" if args.tiny else "--gpu", "--out", str(out), "--work", str(root / "bench")]
    rc, wall = run_logged(cmd, log, args.bench_timeout, ROOT)
    result = {"returncode": rc, "wall_s": wall, "log": str(log),
              "table": log.read_text()[-4000:]}
    if out.is_file():
        result["report"] = json.loads(out.read_text())
    result["passed"] = rc == 0
    return result


def has_stage(name: str) -> bool:
    from llmtune.stages import STAGES

    return name in STAGES


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="2-layer model, fp32, on the CPU (dry run)")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/gpu_acceptance"), help="work/result directory")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {', '.join(CHECKS)}")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per CLI command")
    parser.add_argument("--bench-timeout", type=int, default=300, help="seconds for the benchmark")
    args = parser.parse_args()
    wanted = [c.strip() for c in args.only.split(",") if c.strip()]
    unknown = sorted(set(wanted) - set(CHECKS))
    if unknown:
        parser.error(f"unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device: run on the GPU machine, or use --tiny for the CPU dry run")
    root = Path(args.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    model = build_model(root, args.tiny)
    data = write_data(root)
    runs = {
        "sft_lora": lambda: check_sft(root, model, data, args, "sft_lora"),
        "sft_qlora": lambda: check_sft(root, model, data, args, "sft_qlora", qlora=True),
        "dpo": lambda: check_dpo(root, model, data, args),
        "ppo": lambda: check_online(root, model, data, args, "ppo"),
        "grpo": lambda: check_online(root, model, data, args, "grpo") if has_stage("grpo") else None,
        "zero3": lambda: check_zero3(root, args),
        "bench": lambda: check_bench(root, args),
    }
    needs_sft = {"dpo", "ppo", "grpo"}
    if needs_sft & set(wanted) and "sft_lora" not in wanted and not (root / "sft_lora" / "lineage.json").is_file():
        wanted.insert(0, "sft_lora")
    results: dict[str, dict | None] = {}
    for name in CHECKS:
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        try:
            results[name] = runs[name]()
        except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others' results
            results[name] = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        status = "skipped (not available)" if results[name] is None else (
            "PASSED" if results[name]["passed"] else "FAILED")
        print(f"{name:10s} {status}  {time.perf_counter() - t0:6.1f} s", flush=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    ran = {k: v for k, v in results.items() if v is not None}
    report = {
        "device": device, "tiny": args.tiny, "torch": torch.__version__, "wall_s": round(time.perf_counter() - start, 1),
        "checks": results, "skipped": [k for k, v in results.items() if v is None],
        "passed": bool(ran) and all(v["passed"] for v in ran.values()),
    }
    (root / "result.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'name':10s} {'passed':6s} {'peak GB':>8s} {'estimate GB':>11s}")
    for name, r in ran.items():
        est = r.get("memory_estimate_gb")
        print(f"{name:10s} {str(r['passed']):6s} {r.get('peak_mem_gb') or float('nan'):8.2f} "
              f"{est if est is not None else '-':>11}")
    print(("PASSED" if report["passed"] else "FAILED") + f" in {report['wall_s']} s: {root / 'result.json'}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
