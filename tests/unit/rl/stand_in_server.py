"""The rollout server's own HTTP handler (``vllm_server._handler``, with its secret, size caps and batcher) on a real
socket, in front of an engine core that records what reaches it: for tests of what the server and the trainer's
client do over HTTP (refusals, routing over several servers, batching). The vLLM engine itself is exercised in the
integration tests."""

import threading
from contextlib import contextmanager
from http.server import ThreadingHTTPServer

from llmtune.rl.engines.vllm_server import _handler, _State

SECRET = "s3cret-token-for-the-test"


class RecordingCore:
    """Records adapter loads and the prompts of each engine call (one call = one vLLM batch); answers every prompt
    with one token: its key, the prompt's last id (so a caller can tell which answer is whose)."""

    max_lora_rank, max_model_len, model = 8, 64, "tiny"

    def __init__(self, gate: threading.Event | None = None):
        self.adapters, self.loaded, self.generated, self.seeds = {}, [], [], []
        self.gate = gate  # when set: an engine call waits for it (to queue requests behind a running one)
        self.prompts_served = 0

    @property
    def latest(self):
        return next(reversed(self.adapters.values()), None)

    def load_adapter(self, version, adapter_id, adapter_config, adapter_model, sha256=None):
        self.loaded.append((version, adapter_id, len(adapter_model)))
        self.adapters[adapter_id] = {"adapter_id": adapter_id, "version": version, "sha256": sha256}
        return self.adapters[adapter_id]

    def prepare(self, prompts, *, version, adapter_id, **kwargs):
        from llmtune.rl.engines.vllm_server import StaleVersionError

        self.seeds.append(list(kwargs.get("seeds") or []))
        entry = self.adapters.get(adapter_id) if adapter_id is not None else self.latest
        if entry is None or entry["version"] != version:
            raise StaleVersionError(f"not holding {adapter_id} at {version}")
        return entry, prompts, None

    def run(self, jobs):
        if self.gate is not None:
            self.gate.wait(10)
        self.generated.append([p for _, prompts, _ in jobs for p in prompts])
        self.prompts_served += sum(len(prompts) for _, prompts, _ in jobs)
        return [(entry, [{"token_ids": [p[-1]], "logprobs": [-0.5], "finish_reason": "length"} for p in prompts])
                for entry, prompts, _ in jobs]


@contextmanager
def serve(core=None, secret: str = SECRET, max_request_bytes: int = 64 << 10, max_adapter_bytes: int = 16 << 10):
    """``(port, core)`` of a server on loopback for the block's duration."""
    state = _State()
    state.core, state.secret = core or RecordingCore(), secret.encode()
    state.max_request_bytes, state.max_adapter_bytes = max_request_bytes, max_adapter_bytes
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(state))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield httpd.server_address[1], state.core
    finally:
        httpd.shutdown()
