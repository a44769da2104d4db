#!/usr/bin/env python
"""Asynchronous rollouts: GRPO with ``rollout.max_staleness: 1`` (the next rollout batch sampled while the trainer
trains) beside ``0`` (sample, then train), with the SAME rollout engine for both: one ``llmtune rollout-server`` on
its own CPU core, the trainer on another (``taskset``; OMP_NUM_THREADS=1 on both sides).

    python scripts/bench_async.py --cpu              # SmolLM2-135M (builtin), GSM8K, 16 completions x 48 tokens
    python scripts/bench_async.py --tiny             # tiny random model: the same path in a few minutes
    python scripts/bench.py --async-rollouts [--cpu|--tiny]   # the same, from the side-by-side benchmark

Runs alternate sync, async, async, sync ... (``--reps`` pairs). Per run: the median ``iteration_s`` (wall seconds
of one iteration, sampling + training, evaluations excluded; the first iteration left out: nothing was sampled ahead
of it), the engine's busy share (``rollout/sample_s`` / ``iteration_s``), the trainer's wait for rollouts
(``rollout/wait_s``), the staleness of what was trained, and the reward curves: ``reward_mean`` of every iteration's
rollouts and ``eval_reward`` (greedy answers to held-out questions) every ``--eval-every`` steps.

The ideal, from the synchronous runs: an iteration there is sampling (``S``: ``rollout/sample_s``, the engine's wall
time for the batch) then everything else (``T = iteration_s - S``: the rollout forwards, the optimizer steps, the
weight push). Overlapped perfectly, an iteration takes ``max(S, T)``, so the ideal speed-up is ``(S + T) / max(S, T)``
(at most 2x, at S = T). Printed: the achieved ``speed-up = sync s/iteration / async s/iteration`` per alternated
pair (median, min-max), the ideal, and the achieved share of the ideal. Results go to ``--out`` (JSON).

Shapes (``--shape``): ``default`` (16 completions x 48 tokens, one optimizer step per rollout batch) and ``balanced``
(the same rollouts trained on for ``--passes`` passes: more T per S). Which one is balanced depends on the CPU, since
the bf16 engine's speed does: on an AMD EPYC core with AVX512_BF16 (2026-12-06) the default shape is (S 19.7 s, T 21.0
s: ideal 1.94x); on the 2026-12-03 machine (no AVX512_BF16, shared) sampling was ~80% of a synchronous iteration
(ideal ~1.25x), which ``balanced`` should even out (not measured). The bench prints whether S and T are within 20%. ``--max-new-tokens
128`` gives longer completions (more T than S on the first machine).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe(work: Path, tiny: bool, steps: int, eval_every: int, url: str, max_new_tokens: int, dtype: str,
           passes: int = 1) -> Path:
    if tiny:
        from llmtune.models.tiny import save_tiny_model

        model = str(save_tiny_model(work / "tiny-model", hidden_size=128))
    else:
        model = "builtin:smollm2-135m-instruct"
    doc = {
        "stage": "grpo", "model": {"name_or_path": model},
        "reward": {"functions": [{"function": "llmtune.rewards:gsm8k_reward", "weight": 1.0},
                                 {"function": "llmtune.rewards:format_reward", "weight": 0.2}]},
        "data": {"datasets": [{"path": "builtin:gsm8k", "max_samples": 300}], "max_length": 512,
                 "max_prompt_length": 256, "val_size": 16},
        "adapter": {"lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0},
        "grpo": {"num_generations": 4, "rollout_batch_size": 16, "epsilon_high": 0.28, "num_iterations": passes},
        "rollout": {"engine": "vllm", "max_new_tokens": max_new_tokens, "eval_max_new_tokens": max_new_tokens,
                    "temperature": 0.8,
                    "vllm": {"mode": "server", "url": url, "secret_file": str(work / "secret"), "dtype": dtype,
                             "request_timeout_s": 1800}},
        # steps and eval_every count iterations; an iteration is `passes` optimizer steps
        "train": {"micro_batch_size": 4, "global_batch_size": 16, "max_steps": steps * passes, "learning_rate": 2e-4,
                  "lr_scheduler": "constant", "eval_batch_size": 16, "eval_steps": eval_every * passes,
                  "save_steps": steps * passes, "seed": 0},
        "output": {"dir": str(work / "runs" / "unused")},
    }
    path = work / "grpo_async.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def start_server(work: Path, recipe_path: Path, port: int, core: int | None) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMTUNE_ROLLOUT_SECRET": (work / "secret").read_text().strip()}
    if core is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)  # vLLM's CPU threads on that core only
    cmd = [sys.executable, "-m", "llmtune", "rollout-server", str(recipe_path), "--port", str(port)]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    log = (work / "server.log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)


def wait_healthy(url: str, secret: str, process: subprocess.Popen, timeout: float, log: Path) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the rollout server exited ({process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            req = urllib.request.Request(url + "/health", headers={"Authorization": f"Bearer {secret}"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                if json.loads(resp.read()).get("status") == "ok":
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise SystemExit(f"the rollout server was not healthy within {timeout:g} s:\n{log.read_text()[-3000:]}")


def run(work: Path, recipe_path: Path, staleness: int, tag: str, core: int | None, timeout: float) -> dict:
    out = work / "runs" / f"{tag}_staleness{staleness}"
    cmd = [sys.executable, "-m", "llmtune", "grpo", str(recipe_path), f"rollout.max_staleness={staleness}",
           f"output.dir={out}"]
    if core is not None:
        cmd = ["taskset", "-c", str(core), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.perf_counter()
    with (work / f"{out.name}.log").open("w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=timeout).returncode
    if code != 0:
        raise SystemExit(f"{out.name} failed ({code}): see {work / (out.name + '.log')}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    iteration_s = [r["iteration_s"] for r in rows if "iteration_s" in r]
    sample_s = [r["rollout/sample_s"] for r in rows if "rollout/sample_s" in r]
    # iteration_s[k]: iteration k; the batch sampled during it: k's own (sync), k + 1's (async, sampled ahead)
    busy = [s / i for s, i in zip(sample_s[1:] if staleness else sample_s, iteration_s)][1:]
    steady = iteration_s[1:]  # iteration 0 samples its own batch first in both modes
    # sync: S = the iteration's own sampling, T = the rest of it (iteration 0 left out as above)
    train_s = [i - s for i, s in zip(iteration_s, sample_s)] if not staleness else []
    result = {
        "staleness": staleness, "wall_s": time.perf_counter() - start,
        "S": statistics.median(sample_s[1:len(iteration_s)]) if not staleness and len(iteration_s) > 1 else None,
        "T": statistics.median(train_s[1:]) if len(train_s) > 1 else None,
        "s_per_iteration": statistics.median(steady) if steady else None, "iteration_s": iteration_s,
        "sample_s": sample_s, "engine_busy_share": statistics.median(busy) if busy else None,
        "wait_s": [r["rollout/wait_s"] for r in rows if "rollout/wait_s" in r],
        "staleness_max": [r["rollout/staleness_max"] for r in rows if "rollout/staleness_max" in r],
        "reward_mean": [r["reward_mean"] for r in rows if "reward_mean" in r],
        "eval_reward": {r["step"]: r["eval_reward"] for r in rows if "eval_reward" in r},
    }
    print(f"  {out.name}: {result['s_per_iteration']:.2f} s/iteration, engine busy "
          f"{(result['engine_busy_share'] or 0):.0%}, eval_reward {result['eval_reward']}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", help="SmolLM2-135M (default)")
    mode.add_argument("--tiny", action="store_true", help="tiny random model (minutes)")
    ap.add_argument("--reps", type=int, default=2, help="alternated (sync, async) pairs (default 2)")
    ap.add_argument("--shape", choices=["default", "balanced"], default="default",
                    help="default: one optimizer step per rollout batch; balanced: --passes passes over it")
    ap.add_argument("--passes", type=int, default=None, help="grpo.num_iterations of the balanced shape (default 3: "
                    "T within 20%% of S for SmolLM2-135M on one core each; the bench prints whether it is)")
    ap.add_argument("--steps", type=int, default=None, help="iterations per run (default 10; tiny 6)")
    ap.add_argument("--eval-every", type=int, default=5, help="held-out eval every N steps")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="completion tokens (default 48; tiny 16)")
    ap.add_argument("--engine-dtype", default=None, help="the engine's dtype (default bfloat16; tiny float32); the "
                    "trainer is fp32, the importance correction covers the difference in both modes alike")
    ap.add_argument("--engine-core", type=int, default=1, help="CPU core of the rollout server (-1: no pinning)")
    ap.add_argument("--trainer-core", type=int, default=0, help="CPU core of the trainer (-1: no pinning)")
    ap.add_argument("--work", default=None, help="directory for runs (default a temporary one)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    work = Path(args.work or tempfile.mkdtemp(prefix="llmtune-bench-async-"))
    work.mkdir(parents=True, exist_ok=True)
    (work / "secret").write_text(secrets.token_urlsafe(32))
    steps = args.steps or (6 if args.tiny else 10)
    tokens = args.max_new_tokens or (16 if args.tiny else 48)
    engine_core = None if args.engine_core < 0 else args.engine_core
    trainer_core = None if args.trainer_core < 0 else args.trainer_core
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    dtype = args.engine_dtype or ("float32" if args.tiny else "bfloat16")
    passes = (args.passes or 3) if args.shape == "balanced" else 1
    path = recipe(work, args.tiny, steps, args.eval_every, url, tokens, dtype, passes)
    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
           "engine_core": engine_core, "trainer_core": trainer_core, "steps": steps, "max_new_tokens": tokens,
           "engine_dtype": dtype, "shape": args.shape, "passes": passes,
           "command": " ".join(["python", "scripts/bench_async.py", *(argv if argv is not None else sys.argv[1:])])}
    print(f"bench async rollouts: {args.reps} alternated pair(s); {env}", flush=True)
    server = start_server(work, path, port, engine_core)
    try:
        wait_healthy(url, (work / "secret").read_text().strip(), server, 900, work / "server.log")
        runs: dict[int, list[dict]] = {0: [], 1: []}
        for rep in range(args.reps):
            for staleness in ((0, 1) if rep % 2 == 0 else (1, 0)):  # A B, then B A
                # max_staleness counts optimizer steps: one iteration ahead = `passes` steps
                runs[staleness].append(run(work, path, staleness * passes, f"rep{rep}", trainer_core, args.timeout))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)
    speedups = [s["s_per_iteration"] / a["s_per_iteration"] for s, a in zip(runs[0], runs[1])]
    med = lambda xs: statistics.median(xs)  # noqa: E731
    S = med([r["S"] for r in runs[0] if r["S"] is not None] or [float("nan")])
    T = med([r["T"] for r in runs[0] if r["T"] is not None] or [float("nan")])
    ideal = (S + T) / max(S, T)
    report = {"env": env, "runs": {"sync": runs[0], "async": runs[1]},
              "speedup": {"median": statistics.median(speedups), "min": min(speedups), "max": max(speedups),
                          "pairs": speedups},
              "S": S, "T": T, "ideal_speedup": ideal, "share_of_ideal": statistics.median(speedups) / ideal,
              "balanced": abs(S - T) <= 0.2 * max(S, T), "load_average": os.getloadavg()}
    print(f"\nGRPO s/iteration | sync {med([r['s_per_iteration'] for r in runs[0]]):.2f} | async (max_staleness {passes}) "
          f"{med([r['s_per_iteration'] for r in runs[1]]):.2f} | speed-up {report['speedup']['median']:.2f}x "
          f"(pairs {min(speedups):.2f}-{max(speedups):.2f})")
    print(f"sync iteration = sampling S {S:.2f} s + the rest T {T:.2f} s ({'balanced' if report['balanced'] else 'not balanced'}: "
          f"|S - T| {'<=' if report['balanced'] else '>'} 20%) | ideal speed-up (S + T) / max(S, T) = {ideal:.2f}x | "
          f"achieved {report['speedup']['median']:.2f}x = {report['share_of_ideal']:.0%} of the ideal")
    print(f"engine busy share | sync {med([r['engine_busy_share'] for r in runs[0]]):.0%} | async "
          f"{med([r['engine_busy_share'] for r in runs[1]]):.0%}")
    for name, rs in (("sync", runs[0]), ("async", runs[1])):
        for r in rs:
            print(f"{name:5s} reward_mean per iteration {[round(x, 3) for x in r['reward_mean']]}; eval_reward "
                  f"{ {k: round(v, 3) for k, v in r['eval_reward'].items()} }")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
