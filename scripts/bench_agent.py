#!/usr/bin/env python
"""Multi-turn agent rollouts with slow tools: each rollout on its own (the default) against lock-step
(``agent.lockstep: true``, the loop before issue 40) and against the ideal, on the real hf engine.

    taskset -c 1 python scripts/bench_agent.py --cpu     # SmolLM2-135M (builtin), LoRA r16, 16 rollouts x 3 tool
                                                         # turns + the answer, 16 tokens a turn, L = 0.5 s fixed,
                                                         # then L ~ exponential (mean 0.5 s)
    python scripts/bench_agent.py --tiny                 # tiny random model: the same path in a minute
    python scripts/bench.py --agent [--cpu|--tiny]       # the same, from the side-by-side benchmark

The work: B rollouts (GSM8K questions under the ``chatml_tools`` template), each K turns that call a tool, then a
final answer; ``agent.max_turns`` K + 1. Every turn samples exactly ``--tokens`` tokens for real (the engine's own
seeded sampling at the batch the turn lands in); the bench's engine wrapper then appends the tool call
``lookup(rollout, turn)`` (K turns) or the stop token (the answer): SmolLM2 makes no tool call on its own, and a fixed
number of sampled tokens makes both schedules do the same engine work (sampled text that mentions a tool, which
the policy writes once it has seen calls, is replaced by as many filler tokens: it would be read as a call). The tool sleeps its latency, fixed
(``--latency``) or drawn per (rollout, turn) from an exponential distribution of the same mean (seeded: the same
latencies in every run).

Measured per run: the wall time of ``AgentLoop.run`` (the rollout time). Per case, runs alternate lock-step /
on-their-own (``--reps`` pairs; medians). The ideal: every rollout waits only for its own turns and tools, all
rollouts overlapped: ``max over rollouts of (sum of the engine times of the calls its turns were sampled in + sum of
its tool latencies)`` (generation time = the measured engine time of each call, at the batch size that occurred in
the on-their-own run). Share = ideal / achieved. For reference, the lock-step time had it called the tools of a turn
concurrently (computed: ``sum over turns of (the turn's engine time + its slowest tool)``), and the engine's busy
time in the on-their-own run (the sum of its calls' seconds: one engine, so no schedule beats it). Results go to
``--out``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from llmtune.rl.engines.base import BackgroundEngine, RolloutEngine  # noqa: E402


def lookup(rollout: int, turn: int) -> str:
    """Look something up (slowly).

    Args:
        rollout: which rollout asks
        turn: which of its turns
    """
    time.sleep(LATENCIES[rollout][turn])
    return f"result {rollout}.{turn}"


LATENCIES: list[list[float]] = []  # (B, K) seconds, set per case


class ToolTurnEngine(RolloutEngine):
    """The hf engine, turned into a tool-calling policy: every turn samples ``tokens`` tokens for real (no stop
    token), then the tool call of the rollout's next turn (or, after K tool turns, the stop token) is appended.
    Records each call's batch size, engine seconds and the (rollout, turn) it served."""

    def __init__(self, engine, tok, prompts: list[list[int]], turns: int, tokens: int, stop: int):
        self.engine, self.tok, self.turns, self.tokens, self.stop = engine, tok, turns, tokens, stop
        self.index = {tuple(p): b for b, p in enumerate(prompts)}
        self.width = {len(p) for p in prompts}
        self.calls: list[dict] = []
        self.turn: dict[int, int] = {}  # rollout -> its turns served so far - 1 (cleared per run)

    seeds_per_prompt = True  # the batcher passes the per-turn seeds on

    def rollout_of(self, ids: list[int]) -> int:
        return next(self.index[tuple(ids[:w])] for w in sorted(self.width) if tuple(ids[:w]) in self.index)

    def generate(self, prompts, sampling, budgets=None, keys=None, version=None, seeds=None):
        from dataclasses import replace

        from llmtune.rl.types import STOP, Completion

        start = time.perf_counter()
        no_stop = () if isinstance(self, BackgroundEngine) else (-1,)  # hf: () would mean the model's EOS
        inner = replace(sampling, stop_token_ids=no_stop, max_new_tokens=self.tokens)  # exactly `tokens` tokens
        sampled = self.engine.generate(prompts, inner, [self.tokens] * len(prompts), keys=keys, version=version,
                                       **({"seeds": seeds} if seeds is not None else {}))
        served, out = [], []
        for ids, c in zip(prompts, sampled):
            b = self.rollout_of(ids)
            turn = self.turn[b] = self.turn.get(b, -1) + 1  # its requests come one turn after another
            served.append((b, turn))
            tail = (self.tok("\n<tool_call>\n" + json.dumps({"name": "lookup", "arguments": {"rollout": b,
                                                                                           "turn": turn}})
                             + "\n</tool_call>", add_special_tokens=False)["input_ids"] if turn < self.turns else [])
            ids = list(c.token_ids)
            if "tool" in self.tok.decode(ids):  # the policy imitating the calls it has seen: not a call of its own
                ids = self.tok(" a" * len(ids), add_special_tokens=False)["input_ids"][:len(ids)]
            out.append(Completion(ids + tail + [self.stop], None, STOP, c.version))
        self.calls.append({"size": len(prompts), "seconds": time.perf_counter() - start, "served": served})
        return out

    def sync(self, version):
        self.engine.sync(version)

    def close(self):
        self.engine.close()


class ToolTurnServer(ToolTurnEngine, BackgroundEngine):
    """The same over the vLLM engine (in another process: several calls may be in flight)."""

    def snapshot(self, version):
        return self.engine.snapshot(version)

    def push(self, snapshot):
        self.engine.push(snapshot)

    def session(self):
        return self.engine.session()


def setup(tiny: bool, work: Path, batch: int, turns: int, tokens: int, vllm: bool = False, workers: int = 1):
    """The policy (LoRA r16 on SmolLM2-135M or a tiny model), the tokenizer with the chatml_tools template, the
    prompt rows and an AgentLoop factory; ``vllm``: the colocated vLLM engine instead of hf (``workers`` calls in
    flight)."""
    import torch
    import transformers
    from bench_generation import _setup
    from transformers import AutoTokenizer

    from llmtune.data.prompts import prompt_ids
    from llmtune.data.templates import BUILTIN_TEMPLATES
    from llmtune.rl.agent import AgentLoop, AgentSettings
    from llmtune.rl.chat import ToolTurns
    from llmtune.rl.engines import Policy
    from llmtune.rl.engines.hf import HFEngine
    from llmtune.rl.toolbox import tool_schemas

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()  # eos_token_id -1 (no stop token: a fixed number of tokens) is meant
    model_dir, policy, _, _, eos_ids, pad = _setup(tiny, work, batch)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = BUILTIN_TEMPLATES["chatml_tools"]
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    if not isinstance(stop, int) or stop == tok.unk_token_id:
        stop = eos_ids[0]
    schemas = tool_schemas([lookup])
    rows = []
    for i in range(batch):
        messages = [{"role": "user", "content": f"What is {i} + {i % 7}?"}]
        rows.append({"input_ids": prompt_ids(tok, messages), "messages": json.dumps(messages), "prompt": "",
                     "reference": "", "index": i})
    handle = Policy(policy.eval(), "default", lambda: 0)
    if vllm:
        from llmtune.rl.engines.vllm_client import start_colocated
        from llmtune.rl.engines.vllm_engine import VLLMEngine, VLLMSettings

        settings = VLLMSettings(max_model_len=1024, max_lora_rank=16, dtype="float32", temperature=0.8,
                                startup_timeout_s=900, request_timeout_s=900)
        inner = VLLMEngine(start_colocated(Path(model_dir), settings, work), handle, settings, owns_process=True)
        inner.sync(0)
        engine = ToolTurnServer(inner, tok, [r["input_ids"] for r in rows], turns, tokens, stop)
    else:
        engine = ToolTurnEngine(HFEngine(handle, pad), tok, [r["input_ids"] for r in rows], turns, tokens, stop)
    turns_ids = ToolTurns(tok, schemas, [stop])

    def agent(lockstep: bool) -> AgentLoop:
        settings = AgentSettings(turns + 1, 64, 600.0, "hermes", False, None, (), max(batch, 1), lockstep,
                                 engine_workers=workers)
        return AgentLoop(engine, tok, turns_ids, [lookup], None, settings,
                         lambda m: prompt_ids(tok, m, tools=schemas), 4096)

    return engine, agent, rows, stop


def run_case(engine, agent, rows, stop, latencies: list[list[float]], reps: int, turns: int) -> dict:
    from llmtune.rl.types import SamplingParams

    LATENCIES[:] = latencies
    sampling = SamplingParams(4096, (stop,), temperature=0.8, seed=1)
    times = {"lockstep": [], "overlap": []}
    ideal, concurrent, batches, busy = [], [], [], []
    for rep in range(reps):
        for schedule in (("lockstep", "overlap") if rep % 2 == 0 else ("overlap", "lockstep")):
            engine.calls.clear()
            engine.turn.clear()
            loop = agent(schedule == "lockstep")
            start = time.perf_counter()
            out = loop.run(rows, sampling)
            seconds = time.perf_counter() - start
            assert all(t.turns == turns + 1 and t.finish_reason == "stop" for t in out), \
                [(t.turns, t.outcome.tool_calls, t.finish_reason) for t in out]
            times[schedule].append(seconds)
            if schedule == "overlap":
                own = [sum(lat) for lat in latencies]
                for call in engine.calls:
                    for b, _ in call["served"]:
                        own[b] += call["seconds"]
                ideal.append(max(own))
                batches.append([c["size"] for c in engine.calls])
                busy.append(sum(c["seconds"] for c in engine.calls))
            else:
                per_turn = [c["seconds"] for c in engine.calls]  # one call per turn
                slowest = [max(lat[t] for lat in latencies) for t in range(turns)]
                concurrent.append(sum(per_turn) + sum(slowest))
            print(f"  {schedule:8s} {seconds:7.2f} s", flush=True)
    achieved = statistics.median(times["overlap"])
    pairs = [a / b for a, b in zip(times["lockstep"], times["overlap"])]
    sizes = [s for run in batches for s in run]
    return {"lockstep_s": statistics.median(times["lockstep"]), "overlap_s": achieved,
            "speedup": statistics.median(pairs), "speedup_range": [min(pairs), max(pairs)],
            "ideal_s": statistics.median(ideal), "share": statistics.median(ideal) / achieved,
            "lockstep_concurrent_tools_s": statistics.median(concurrent),
            "engine_calls": statistics.median([len(r) for r in batches]), "mean_batch": statistics.mean(sizes),
            "engine_busy_s": statistics.median(busy),
            "runs": times}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", help="SmolLM2-135M on the CPU (default)")
    mode.add_argument("--tiny", action="store_true", help="tiny random model instead")
    ap.add_argument("--batch", type=int, default=16, help="rollouts (B)")
    ap.add_argument("--turns", type=int, default=3, help="tool turns per rollout (K), then the answer")
    ap.add_argument("--tokens", type=int, default=16, help="tokens sampled per turn")
    ap.add_argument("--latency", type=float, default=0.5, help="tool latency L (s); the variable case's mean")
    ap.add_argument("--reps", type=int, default=2, help="alternated run pairs per case")
    ap.add_argument("--cases", default="fixed,exponential", help="comma-separated: fixed, exponential")
    ap.add_argument("--vllm", action="store_true", help="the colocated vLLM engine (CPU build) instead of hf")
    ap.add_argument("--workers", type=int, default=1, help="vLLM: engine calls in flight at once")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args, _ = ap.parse_known_args(argv)
    work = Path(tempfile.mkdtemp(prefix="llmtune-bench-agent-"))
    engine, agent, rows, stop = setup(args.tiny, work, args.batch, args.turns, args.tokens, args.vllm, args.workers)
    from llmtune.rl.types import SamplingParams

    engine.engine.generate([rows[0]["input_ids"]], SamplingParams(4, (stop,)))  # warm-up
    rng = random.Random(0)
    cases = {"fixed": [[args.latency] * args.turns for _ in rows],
             "exponential": [[rng.expovariate(1 / args.latency) for _ in range(args.turns)] for _ in rows]}
    results = {}
    for name in args.cases.split(","):
        print(f"{name}: {args.batch} rollouts x {args.turns} tool turns + answer, {args.tokens} tokens/turn, "
              f"L {'= ' if name == 'fixed' else '~ exp, mean '}{args.latency} s", flush=True)
        results[name] = r = run_case(engine, agent, rows, stop, cases[name], args.reps, args.turns)
        print(f"{name}: lock-step {r['lockstep_s']:.2f} s | on their own {r['overlap_s']:.2f} s | speed-up "
              f"{r['speedup']:.2f}x ({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f}) | ideal "
              f"{r['ideal_s']:.2f} s | share {r['share']:.0%} | lock-step with concurrent tools (computed) "
              f"{r['lockstep_concurrent_tools_s']:.2f} s | engine calls {r['engine_calls']:.0f}, mean batch "
              f"{r['mean_batch']:.1f}, busy {r['engine_busy_s']:.2f} s", flush=True)
    engine.close()
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0 if all(math.isfinite(r["share"]) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
