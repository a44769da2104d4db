"""The rollout server lets no one in (issue 32 section 5): every refusal over real HTTP, against the server's own
request handler (``vllm_server._handler``) on a socket. The engine core behind it records what reaches it: a refused
request must never reach it. The same checks against a real vLLM server: tests/integration/test_vllm_engine.py."""

import base64
import http.client
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save

from llmtune.rl.engines import vllm_server
from llmtune.rl.engines.vllm_client import RolloutEngineError, VLLMClient
from llmtune.rl.engines.vllm_server import (SECRET_ENV, check_safetensors_adapter, is_loopback, parse_args,
                                            server_secret)
from tests.unit.rl.stand_in_server import SECRET, serve

LORA = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}


@pytest.fixture
def server():
    with serve() as (port, core):
        yield port, core


def request(port, method, path, body=None, secret=SECRET, raw=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": "application/json"}
    if secret is not None:
        headers["Authorization"] = f"Bearer {secret}"
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def adapter_body(weights: bytes, config=LORA, version=1):
    return {"version": version, "adapter_id": f"run-v{version}", "adapter_config": config,
            "adapter_model": base64.b64encode(weights).decode()}


def lora_weights(n=4):
    return save({"base_model.model.q_proj.lora_A.weight": torch.zeros(4, n)})


def test_without_or_with_a_wrong_secret_every_endpoint_is_401(server):
    port, core = server
    for secret in (None, "", "wrong", SECRET + "x", SECRET[:-1]):
        assert request(port, "GET", "/health", secret=secret)[0] == 401
        code, answer = request(port, "POST", "/adapter", adapter_body(lora_weights()), secret=secret)
        assert code == 401 and "shared secret" in answer["error"]
        assert request(port, "POST", "/generate", {"prompts": [[1, 2]]}, secret=secret)[0] == 401
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)  # another scheme than Bearer
    conn.request("GET", "/health", headers={"Authorization": f"Basic {SECRET}"})
    assert conn.getresponse().status == 401
    conn.close()
    assert core.loaded == [] and core.generated == []  # nothing reached the engine
    # the right secret: served
    assert request(port, "GET", "/health")[0] == 200
    assert request(port, "POST", "/adapter", adapter_body(lora_weights()))[0] == 200
    assert core.loaded == [(1, "run-v1", len(lora_weights()))]


def test_waiting_for_a_server_stops_at_the_first_401(server):
    """A wrong secret is not a server that is still starting: the wait ends at once, not at startup_timeout_s."""
    import time

    port, _ = server
    start = time.monotonic()
    with pytest.raises(RolloutEngineError, match=r"refused this trainer's secret \(HTTP 401\)"):
        VLLMClient(f"http://127.0.0.1:{port}", 10, secret="wrong").wait_healthy(timeout_s=60)
    assert time.monotonic() - start < 5
    assert VLLMClient(f"http://127.0.0.1:{port}", 10, secret=SECRET).wait_healthy(timeout_s=60)["status"] == "ok"


def test_the_client_sends_its_secret_and_names_the_fix_on_401(server):
    port, _ = server
    assert VLLMClient(f"http://127.0.0.1:{port}", 10, secret=SECRET).health()["status"] == "ok"
    for secret in (None, "wrong"):
        with pytest.raises(RolloutEngineError, match=r"refused this trainer's secret \(HTTP 401\)") as err:
            VLLMClient(f"http://127.0.0.1:{port}", 10, secret=secret).health()
        assert SECRET_ENV in str(err.value) and "rollout.vllm.secret_file" in str(err.value)
        assert err.value.exit_code == 1  # a configuration problem: a retry cannot help (69 would invite one)
    assert SECRET not in repr(VLLMClient(f"http://127.0.0.1:{port}", 10, secret=SECRET))


def test_oversized_requests_and_adapters_are_413_and_never_loaded(server):
    port, core = server
    # a request body above --max-request-mb (64 KiB here): refused from its Content-Length, before it is read
    code, answer = request(port, "POST", "/generate", {"prompts": [[1] * 40_000]})
    assert code == 413 and "--max-request-mb" in answer["error"]
    # an adapter above --max-adapter-mb (16 KiB here) inside a request below the request cap
    big = lora_weights(n=1500)  # 4 x 1500 fp32 = 24 KB
    assert 16 << 10 < len(big) and len(json.dumps(adapter_body(big))) < 64 << 10
    code, answer = request(port, "POST", "/adapter", adapter_body(big))
    assert code == 413 and "--max-adapter-mb" in answer["error"]
    assert core.loaded == [] and core.generated == []
    assert request(port, "GET", "/health")[0] == 200  # and the server still serves


def test_only_safetensors_lora_adapters_are_accepted(server):
    port, core = server
    import io
    import pickle

    buffer = io.BytesIO()
    torch.save({"lora_A": torch.zeros(2, 2)}, buffer)  # a pickle (torch's zip format)
    cases = {
        "torch pickle": adapter_body(buffer.getvalue()),
        "plain pickle": adapter_body(pickle.dumps({"a": 1})),
        "header past the end": adapter_body((10_000).to_bytes(8, "little") + b"{}"),
        "header not JSON": adapter_body((4).to_bytes(8, "little") + b"\x80abc"),
        "tensor past the end": adapter_body(bad_offsets()),
        "not LoRA": adapter_body(lora_weights(), config={"peft_type": "PREFIX_TUNING"}),
        "not base64": {**adapter_body(lora_weights()), "adapter_model": "@@not base64@@"},
    }
    for name, body in cases.items():
        code, answer = request(port, "POST", "/adapter", body)
        assert code == 400, (name, code, answer)
    assert core.loaded == []


def bad_offsets() -> bytes:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    return len(header).to_bytes(8, "little") + header + b"\0" * 8  # 8 bytes of data for a 16-byte tensor


def test_check_safetensors_adapter_accepts_what_peft_writes(tmp_path):
    from peft import LoraConfig, get_peft_model

    from llmtune.models.tiny import make_tiny_llama

    model = get_peft_model(make_tiny_llama(), LoraConfig(r=4, target_modules="all-linear"))
    model.save_pretrained(tmp_path, safe_serialization=True)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    check_safetensors_adapter(config, (tmp_path / "adapter_model.safetensors").read_bytes())  # no error


def test_loopback_and_the_secret_a_server_starts_with(tmp_path, monkeypatch):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("::")
    monkeypatch.delenv(SECRET_ENV, raising=False)
    base = ["--model", "m", "--max-lora-rank", "8", "--max-model-len", "64"]
    secret, generated = server_secret(parse_args(base))  # loopback without a secret: one is generated
    assert generated and len(secret) >= 32
    assert server_secret(parse_args(base))[0] != secret
    with pytest.raises(SystemExit, match="not loopback"):
        server_secret(parse_args([*base, "--host", "0.0.0.0"]))
    file = tmp_path / "secret"
    file.write_text(SECRET + "\n")
    assert server_secret(parse_args([*base, "--host", "0.0.0.0", "--secret-file", str(file)])) == (SECRET, False)
    file.write_text("\n")
    with pytest.raises(SystemExit, match="is empty"):
        server_secret(parse_args([*base, "--host", "0.0.0.0", "--secret-file", str(file)]))
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert server_secret(parse_args([*base, "--host", "0.0.0.0"])) == ("from-env", False)


def test_the_server_refuses_a_non_loopback_bind_without_a_secret_before_listening():
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    proc = subprocess.run([sys.executable, vllm_server.__file__, "--model", "m", "--max-lora-rank", "8",
                           "--max-model-len", "64", "--host", "0.0.0.0", "--port", "0"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode != 0 and "not loopback" in proc.stderr and "Traceback" not in proc.stderr
    assert "listening" not in proc.stderr


def test_the_trainer_refuses_an_adapter_above_the_servers_cap_before_sending(server):
    from peft import LoraConfig, get_peft_model

    from llmtune.models.tiny import make_tiny_llama
    from llmtune.rl.engines import Policy
    from llmtune.rl.engines.vllm_engine import VLLMEngine, VLLMSettings

    port, core = server
    client = VLLMClient(f"http://127.0.0.1:{port}", 10, secret=SECRET)
    assert client.health()["max_adapter_bytes"] == 16 << 10
    policy = get_peft_model(make_tiny_llama(), LoraConfig(r=8, target_modules="all-linear"))
    engine = VLLMEngine(client, Policy(policy, "default", lambda: 0), VLLMSettings())
    with pytest.raises(RolloutEngineError, match="above the rollout server's limit") as err:
        engine.sync(0)
    assert "--max-adapter-mb" in str(err.value) and core.loaded == []
