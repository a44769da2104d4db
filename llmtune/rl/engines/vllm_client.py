"""The trainer's side of a vLLM rollout server (:mod:`llmtune.rl.engines.vllm_server`): its HTTP client, starting
a server as a child process (colocate) and stopping it, and the errors (exit code 69). Standard library only, besides
torch for the device check."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import torch

from llmtune.errors import EXIT_ENGINE, EXIT_ERROR, LlmtuneError
from llmtune.utils import project_root
from llmtune.rl.engines.vllm_server import SECRET_ENV, engine_lora_rank

SERVER_SCRIPT = Path(__file__).with_name("vllm_server.py")
SERVER_LOG = "rollout_server.log"


class RolloutEngineError(LlmtuneError, RuntimeError):
    """The rollout engine cannot be used: not installed, failed to start, unreachable, died, or stale."""

    exit_code = EXIT_ENGINE


def vllm_venv_candidates() -> list[Path]:
    """Where ``scripts/setup.sh`` puts the vLLM venv, in the order :func:`vllm_python` looks: ``$LLMTUNE_VLLM_VENV``
    when set; else ``.venv-vllm`` beside the venv that runs llmtune (setup.sh's rule: beside ``$LLMTUNE_VENV``,
    the checkout's ``.venv`` by default), then in the llmtune checkout itself (:func:`llmtune.utils.project_root`)."""
    explicit = os.environ.get("LLMTUNE_VLLM_VENV")
    if explicit:
        return [Path(explicit)]
    found = [Path(sys.prefix).parent / ".venv-vllm"]
    root = project_root()
    if root is not None and root / ".venv-vllm" not in found:
        found.append(root / ".venv-vllm")
    return found


def vllm_python() -> str | None:
    """The python that runs the rollout server, or None when vLLM is not installed: ``$LLMTUNE_VLLM_PYTHON``, else
    ``bin/python`` of the first of :func:`vllm_venv_candidates` that has one, else llmtune's own python when it can
    import vllm."""
    explicit = os.environ.get("LLMTUNE_VLLM_PYTHON")
    if explicit:
        return explicit if Path(explicit).is_file() else None
    for venv in vllm_venv_candidates():
        candidate = venv / "bin" / "python"
        if candidate.is_file():
            return str(candidate)
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


class RolloutAuthError(RolloutEngineError):
    """The rollout server refused this trainer's secret (HTTP 401): a configuration problem, never retried as a
    server that is still starting. Exit code 1 like every configuration problem (69 tells a scheduler that a
    retry may help; it cannot here)."""

    exit_code = EXIT_ERROR


class EngineNotInstalledError(RolloutEngineError):
    """vLLM is not installed here: a setup problem (exit code 1, like every recipe/environment problem that
    ``llmtune validate`` reports), not an engine that is down (69: a scheduler may retry those)."""

    exit_code = EXIT_ERROR


def not_installed_error() -> RolloutEngineError:
    return EngineNotInstalledError(
        "rollout.engine: vllm, but vLLM is not installed: looked for "
        + " and ".join(str(v / "bin" / "python") for v in vllm_venv_candidates())
        + ". `bash scripts/setup.sh` sets it up in .venv-vllm beside .venv (or set LLMTUNE_VLLM_PYTHON to a python "
        "with vllm, LLMTUNE_VLLM_VENV to its venv), or use rollout.engine: hf")


class VLLMClient:
    """HTTP client of one rollout server; every failure is a :class:`RolloutEngineError` naming the fix.

    Args:
        url: ``http://host:port``. request_timeout_s: seconds per request.
        process: the server's process when this client started it (colocate), for its exit status and log.
        log_path: that process's log.
        secret: the server's shared secret (sent as ``Authorization: Bearer``; never logged), None = none.
    """

    def __init__(self, url: str, request_timeout_s: float = 600.0, process: subprocess.Popen | None = None,
                 log_path: Path | None = None, secret: str | None = None):
        self.url = url.rstrip("/")
        self.timeout = request_timeout_s
        self.process, self.log_path = process, log_path
        self._secret = secret

    def __repr__(self) -> str:  # never the secret
        return f"VLLMClient({self.url!r})"

    def _request(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self._secret:
            headers["Authorization"] = f"Bearer {self._secret}"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read()).get("error", "")
            except (ValueError, OSError):
                message = ""
            if err.code == 401:
                raise RolloutAuthError(
                    f"the rollout server {self.url} refused this trainer's secret (HTTP 401): give the trainer the "
                    f"server's secret (${SECRET_ENV}, or rollout.vllm.secret_file: a file holding it), then rerun the "
                    "same command") from None
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
        """Poll ``/health`` until the engine answers ok; raise when the process exits or the time is up, and at once
        when the server refuses the secret (:class:`RolloutAuthError`: waiting cannot fix that)."""
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
            except RolloutAuthError:
                raise
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

    def generate(self, prompts: list[list[int]], version: int, sampling: dict, adapter_id: str | None = None,
                 wait_s: float = 0.0) -> dict:
        """``POST /generate``. ``wait_s``: how long to keep asking while the server does not hold the adapter yet
        (409; a rank whose adapter another rank uploads), else 409 is an error at once.

        Raises:
            RolloutEngineError: stale weights (409 past ``wait_s``), the server failed or cannot be reached.
        """
        deadline, pause = time.monotonic() + wait_s, 0.02
        while True:
            try:
                return self._request("POST", "/generate", {"version": version, "adapter_id": adapter_id,
                                                           "prompts": prompts, "sampling": sampling})
            except _HTTPStatus as err:
                if err.code == 409 and time.monotonic() + pause < deadline:
                    time.sleep(pause)
                    pause = min(pause * 2, 0.5)
                    continue
                if err.code == 409:
                    waited = f" (waited {wait_s:g} s for it)" if wait_s else ""
                    raise RolloutEngineError(f"stale rollout weights{waited}: {err.message}") from None
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
    if "rollout.engine: hf" in cause:  # the server's own refusal names the fix (refuse_cpu_moe)
        return f"{cause[:400]} (log: {log_path})"
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


def server_command(python: str, base: Path | str, s, *, host: str = "127.0.0.1", port: int = 8000,
                   port_file: Path | None = None, base_id: str | None = None, parent_pid: int | None = None
                   ) -> list[str]:
    """The plain command line of a rollout server (runs in the vLLM venv, no llmtune needed there); ``base_id``:
    :func:`base_identity` of the recipe, stated by the server so that trainers can check it; ``parent_pid``: the
    server stops when that process is gone (a colocated engine and its trainer)."""
    cmd = [python, str(SERVER_SCRIPT), "--model", str(base), "--host", host, "--port", str(port),
           "--max-lora-rank", str(engine_lora_rank(s.max_lora_rank)), "--max-model-len", str(s.max_model_len),
           "--dtype", s.dtype, "--seed", str(s.seed)]
    if base_id:
        cmd += ["--base-id", base_id]
    if s.tensor_parallel_size > 1:
        cmd += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
    if torch.cuda.is_available():
        cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
        if s.enable_sleep_mode:
            cmd.append("--enable-sleep-mode")
    extra = os.environ.get("LLMTUNE_VLLM_ENGINE_ARGS")  # JSON of further vllm.LLM arguments (tests, experts)
    if extra:
        cmd += ["--engine-args", extra]
    if port_file is not None:
        cmd += ["--port-file", str(port_file)]
    if parent_pid is not None:
        cmd += ["--parent-pid", str(parent_pid)]
    return cmd


def server_env() -> dict[str, str]:
    """The server's environment: the trainer's, without its python path (the vLLM venv has its own packages)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    # the engine core in the server's own process: one python importing vLLM instead of three (starts ~2x faster
    # on CPU); the server process is already apart from the trainer
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return env


def start_colocated(base: Path, s, run_dir: Path, device_index: int | None = None) -> VLLMClient:
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
    secret = secrets.token_urlsafe(32)  # this run's only: in the child's environment, never on its command line
    env[SECRET_ENV] = secret
    if device_index is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(device_index)
    with log_path.open("w") as log:
        process = subprocess.Popen(server_command(python, base, s, port=0, port_file=port_file,
                                                  parent_pid=os.getpid()), stdout=log,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
    deadline = time.monotonic() + s.startup_timeout_s
    while not port_file.is_file():
        if process.poll() is not None or time.monotonic() > deadline:
            _stop(process)
            raise RolloutEngineError(f"the rollout engine failed to start (exit code {process.returncode}): "
                                     f"{_start_failure(log_path)}")
        time.sleep(0.1)
    client = VLLMClient(f"http://127.0.0.1:{port_file.read_text().strip()}", s.request_timeout_s, process, log_path,
                        secret)
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


