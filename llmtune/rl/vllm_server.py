"""The vLLM rollout engine core and its HTTP server. Imports only vLLM and the standard library, so that it runs in a
venv of its own (vLLM pins transformers below llmtune's lock): run it as a script, never import llmtune from it.

    $LLMTUNE_VLLM_PYTHON llmtune/rl/vllm_server.py --model ROLLOUT_BASE_DIR --port 8000 --max-lora-rank 16 \
        --max-model-len 640 --dtype float32 --seed 0

(``llmtune rollout-server RECIPE`` builds ROLLOUT_BASE_DIR from the recipe, prints this line and runs it.)

The engine (:class:`RolloutCore`) is a ``vllm.LLM`` with LoRA enabled (``max_loras=1``: one policy version at a
time), no tokenizer (``skip_tokenizer_init``: prompts and completions are token ids, so the trainer's tokenizer is
the only one and the transformers versions of the two venvs cannot disagree about it), ``logprobs_mode =
processed_logprobs`` (the log-prob of each sampled token under the distribution it was sampled from: after
temperature, top-k and top-p, as TRL's vLLM path requests), and ``generation_config="vllm"`` (the model's
generation_config.json never changes the sampling settings the trainer sends). ``enforce_eager`` on CPU.

Protocol (JSON over HTTP; every error answer is ``{"error": message}``):

- ``GET /health`` -> 200 ``{"status": "ok", "version": V | null, "max_lora_rank", "max_model_len", "model",
  "base_id", "protocol"}`` (``base_id``: the ``--base-id`` it was started with, null without; trainers refuse a
  server whose base is not theirs) once the engine runs; 503 ``{"status": "starting"}`` while it starts.
- ``POST /adapter`` ``{"version": V, "adapter_config": {...}, "adapter_model": base64 safetensors}`` (a plain peft
  adapter: ``adapter_config.json`` and ``adapter_model.safetensors``, uploaded: no shared file system) -> 200
  ``{"version": V}``. The adapter becomes LoRA request ``policy-vV`` (id V + 1); the previous one is removed.
- ``POST /generate`` ``{"version": V, "prompts": [[ids]], "sampling": {"temperature", "top_p", "top_k",
  "max_tokens", "stop_token_ids", "seeds": [one per prompt]}}`` -> 200 ``{"version": V, "completions":
  [{"token_ids": [...], "logprobs": [...]}]}``; 409 when the loaded adapter is not version V (stale weights: never
  sampled from). ``temperature`` 0 = greedy. A completion ends with its stop token when it stopped on one.
- ``POST /sleep``, ``POST /wake_up`` (GPU, ``--enable-sleep-mode``): free / restore weights and KV cache while
  the trainer trains (vLLM's sleep level 1).

Engine calls are serialized by one lock; ``/health`` answers while a generate request runs.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PROTOCOL = 1
# vLLM accepts only these LoRA ranks as max_lora_rank (vllm.config.lora.LoRAConfig)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
CPU_KV_CACHE_BYTES = 1 << 30


def engine_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of rank ``rank``."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


class StaleVersionError(RuntimeError):
    """A generate request asked for a policy version the engine does not hold."""


class RolloutCore:
    """One ``vllm.LLM`` that samples from a base model + the trainer's current LoRA adapter.

    Args:
        model: directory of the rollout base (safetensors + config.json).
        max_lora_rank: the largest adapter rank it accepts (rounded up to a rank vLLM supports).
        max_model_len: tokens of prompt + completion per sequence.
        dtype: ``float32`` | ``bfloat16`` | ``float16`` | ``auto``.
        seed: the engine's seed (every request also carries its own seed).
        gpu_memory_utilization: fraction of the GPU for weights + KV cache (GPU only; None = vLLM's default).
        enable_sleep_mode: allow :meth:`sleep`/:meth:`wake_up` (GPU only).
        engine_args: further ``vllm.LLM`` keyword arguments (e.g. ``tensor_parallel_size``).
        workdir: where uploaded adapters are written (a temporary directory by default).
    """

    def __init__(self, model: str, *, max_lora_rank: int, max_model_len: int, dtype: str = "auto", seed: int = 0,
                 gpu_memory_utilization: float | None = None, enable_sleep_mode: bool = False,
                 engine_args: dict | None = None, workdir: str | None = None):
        from vllm import LLM

        self.model, self.max_model_len = model, max_model_len
        self.max_lora_rank = engine_lora_rank(max_lora_rank)
        self.version: int | None = None
        self.lora = None
        self.workdir = workdir or tempfile.mkdtemp(prefix="llmtune-vllm-adapters-")
        kwargs = dict(model=model, enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1, max_cpu_loras=2,
                      dtype=dtype, max_model_len=max_model_len, seed=seed, skip_tokenizer_init=True,
                      logprobs_mode="processed_logprobs", generation_config="vllm", enforce_eager=_on_cpu())
        if gpu_memory_utilization is not None and not _on_cpu():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if enable_sleep_mode and not _on_cpu():
            kwargs["enable_sleep_mode"] = True
        if _on_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            # on CPU vLLM reserves gpu_memory_utilization x the node's memory (0.92 by default) unless the KV cache
            # size is given: 1 GiB (VLLM_CPU_KVCACHE_SPACE=<GiB> sets another size)
            kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        kwargs.update(engine_args or {})
        self.llm = LLM(**kwargs)

    def load_adapter(self, version: int, adapter_config: dict, adapter_model: bytes) -> None:
        """Make the adapter (peft ``adapter_config.json`` content + ``adapter_model.safetensors`` bytes) the one
        every request samples with, as policy version ``version``.

        Raises:
            ValueError: its rank is above the engine's ``max_lora_rank`` or vLLM cannot load it.
        """
        from vllm.lora.request import LoRARequest

        ranks = [int(adapter_config.get("r", 0)), *map(int, (adapter_config.get("rank_pattern") or {}).values())]
        if max(ranks) > self.max_lora_rank:
            raise ValueError(f"the adapter's LoRA rank {max(ranks)} is above the engine's max_lora_rank "
                             f"{self.max_lora_rank}; restart the rollout server with --max-lora-rank {max(ranks)} "
                             "(rollout.vllm.max_lora_rank)")
        path = os.path.join(self.workdir, f"v{version}")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(adapter_config, f)
        with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
            f.write(adapter_model)
        # a new id per version: vLLM caches adapters by id, so reusing one would sample from the old weights
        lora = LoRARequest(f"policy-v{version}", version + 1, path)
        if not self.llm.llm_engine.add_lora(lora):
            raise ValueError(f"vLLM could not load the adapter of version {version}")
        old, self.lora, self.version = self.lora, lora, version
        if old is not None and old.lora_int_id != lora.lora_int_id:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def generate(self, prompts: list[list[int]], *, version: int, temperature: float, top_p: float, top_k: int,
                 max_tokens: int, stop_token_ids: list[int], seeds: list[int]) -> list[dict]:
        """Sample one completion per prompt with the adapter of ``version``.

        Args:
            prompts: token ids of each prompt (no padding).
            temperature: 0 = greedy. top_k: 0 = off. max_tokens: completion tokens at most.
            stop_token_ids: a completion ends after the first of these (it is part of the completion).
            seeds: one per prompt.

        Returns:
            One ``{"token_ids": [...], "logprobs": [...]}`` per prompt (log-probs of the sampled tokens under the
            processed distribution: after temperature/top-k/top-p).

        Raises:
            StaleVersionError: the loaded adapter is not ``version``.
        """
        from vllm import SamplingParams, TokensPrompt

        if self.version != version:
            raise StaleVersionError(f"the rollout engine holds policy version {self.version}, the request asks for "
                                    f"version {version}: push that version's adapter first (POST /adapter)")
        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                                 max_tokens=max_tokens, stop_token_ids=list(stop_token_ids), seed=seed, logprobs=0,
                                 detokenize=False, skip_special_tokens=False) for seed in seeds]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                    lora_request=self.lora, use_tqdm=False)
        result = []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            logprobs = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or [])]
            result.append({"token_ids": ids, "logprobs": logprobs})
        return result

    def sleep(self) -> None:
        """Free the KV cache and move the weights off the GPU (vLLM sleep level 1) while the trainer trains."""
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        """Undo :meth:`sleep`; the current adapter is loaded again from its files (its GPU copy may be gone)."""
        self.llm.wake_up()
        if self.lora is not None:
            self.llm.llm_engine.remove_lora(self.lora.lora_int_id)
            self.llm.llm_engine.add_lora(self.lora)


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class _State:
    core: RolloutCore | None = None
    lock = threading.Lock()
    args: argparse.Namespace | None = None
    base_id: str | None = None


def _handler(state: _State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # one line per request on stderr is noise at one request per step
            return

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path != "/health":
                return self._send(404, {"error": f"no endpoint GET {self.path}"})
            core = state.core
            if core is None:
                return self._send(503, {"status": "starting"})
            self._send(200, {"status": "ok", "version": core.version, "max_lora_rank": core.max_lora_rank,
                             "max_model_len": core.max_model_len, "model": core.model, "base_id": state.base_id,
                             "protocol": PROTOCOL})

        def do_POST(self):
            core = state.core
            if core is None:
                return self._send(503, {"error": "the engine is still starting"})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                with state.lock:
                    if self.path == "/adapter":
                        core.load_adapter(int(body["version"]), body["adapter_config"],
                                          base64.b64decode(body["adapter_model"]))
                        return self._send(200, {"version": core.version})
                    if self.path == "/generate":
                        s = body["sampling"]
                        completions = core.generate(
                            body["prompts"], version=int(body["version"]), temperature=float(s["temperature"]),
                            top_p=float(s["top_p"]), top_k=int(s["top_k"]), max_tokens=int(s["max_tokens"]),
                            stop_token_ids=s["stop_token_ids"], seeds=s["seeds"])
                        return self._send(200, {"version": core.version, "completions": completions})
                    if self.path in ("/sleep", "/wake_up"):
                        getattr(core, self.path[1:])()
                        return self._send(200, {"status": self.path[1:]})
                return self._send(404, {"error": f"no endpoint POST {self.path}"})
            except StaleVersionError as exc:
                return self._send(409, {"error": str(exc)})
            except (KeyError, TypeError, ValueError) as exc:
                return self._send(400, {"error": f"{type(exc).__name__}: {exc}"})
            except Exception as exc:  # noqa: BLE001 - the engine failed: say so to the trainer, keep serving health
                traceback.print_exc()
                return self._send(500, {"error": f"{type(exc).__name__}: {exc}"})

    return Handler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="llmtune's vLLM rollout server (LoRA versions pushed by the trainer)")
    p.add_argument("--model", required=True, help="rollout base directory (safetensors + config.json)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port (written to --port-file)")
    p.add_argument("--port-file", default=None, help="write the port here once listening")
    p.add_argument("--max-lora-rank", type=int, required=True)
    p.add_argument("--max-model-len", type=int, required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--enable-sleep-mode", action="store_true")
    p.add_argument("--engine-args", default=None, help="JSON object of further vllm.LLM keyword arguments")
    p.add_argument("--base-id", default=None, help="identity of the base (llmtune's base_identity of the recipe), "
                   "stated in /health so that a trainer of another model refuses this server")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    state = _State()
    state.base_id = args.base_id
    server = ThreadingHTTPServer((args.host, args.port), _handler(state))
    server.daemon_threads = True
    port = server.server_address[1]
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"rollout server listening on http://{args.host}:{port} (starting the engine)", file=sys.stderr, flush=True)
    try:
        state.core = RolloutCore(args.model, max_lora_rank=args.max_lora_rank, max_model_len=args.max_model_len,
                                 dtype=args.dtype, seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
                                 enable_sleep_mode=args.enable_sleep_mode,
                                 engine_args=json.loads(args.engine_args) if args.engine_args else None)
    except Exception as exc:  # noqa: BLE001 - the trainer reads this line from the log
        traceback.print_exc()
        print(f"rollout engine failed to start: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        server.shutdown()
        return 1
    print(f"rollout server ready on http://{args.host}:{port}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # shut the engine's worker processes down too
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        shutil.rmtree(state.core.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
