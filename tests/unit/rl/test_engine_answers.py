"""Nothing a rollout engine answers is trusted blindly (issue 30): malformed answers are engine errors (exit 69), a
non-finite log-prob is kept as NaN (weight 0, counted); and the one stop set of the trainer.

The malformed answers come from a stand-in HTTP server: a real vLLM engine cannot be made to send them (the real
engine's side of the contract is tested in tests/integration/test_vllm_engine.py)."""

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmtune.rl.engines import Policy
from llmtune.rl.engines.vllm_engine import RolloutEngineError, VLLMEngine, VLLMSettings, check_completions
from llmtune.rl.engines.vllm_client import VLLMClient
from llmtune.rl.types import SamplingParams


def answer(*completions):
    return {"completions": list(completions)}


def test_well_formed_answers_pass_and_nonfinite_logprobs_become_nan():
    ids, logps = check_completions(answer({"token_ids": [1, 2], "logprobs": [-0.5, None]},
                                          {"token_ids": [], "logprobs": []}), 2, 4, 10, True, "u")
    assert ids == [[1, 2], []] and logps[0][0] == -0.5 and math.isnan(logps[0][1]) and logps[1] == []
    ids, logps = check_completions(answer({"token_ids": [3]}), 1, 4, 10, False, "u")  # greedy: no log-probs needed
    assert ids == [[3]] and logps is None
    _, logps = check_completions(json.loads('{"completions": [{"token_ids": [1], "logprobs": [NaN]}]}'), 1, 4, 10,
                                 True, "u")
    assert math.isnan(logps[0][0])


@pytest.mark.parametrize("bad,message", [
    ({"answer": "no completions"}, "no 'completions' list for 1 prompts"),
    (answer(), "0 completions for 1 prompts"),
    (answer({"logprobs": [-1.0]}), "completion 0 has no 'token_ids' list of integers"),
    (answer({"token_ids": [1.5], "logprobs": [-1.0]}), "completion 0 has no 'token_ids' list of integers"),
    (answer({"token_ids": [1, 2, 3, 4, 5], "logprobs": [-1.0] * 5}), "5 tokens, more than max_tokens 4"),
    (answer({"token_ids": [1, 99], "logprobs": [-1.0] * 2}), r"token ids outside the vocabulary \[0, 10\)"),
    (answer({"token_ids": [1, 2], "logprobs": [-1.0]}), "completion 0 has 1 log-probs for 2 tokens"),
    (answer({"token_ids": [1, 2]}), "completion 0 has no 'logprobs' list for 2 tokens"),
    (answer({"token_ids": [1], "logprobs": ["x"]}), "log-prob 0 is 'x', not a number"),
    (answer({"token_ids": [3, 2, 5], "logprobs": [-1.0] * 3}), "goes on after the stop token 2 at position 1"),
])
def test_malformed_answers_are_engine_errors(bad, message):
    with pytest.raises(RolloutEngineError, match=message) as err:
        check_completions(bad, 1, 4, 10, True, "http://engine", stop_token_ids=(2,))
    assert err.value.exit_code == 69 and "http://engine sent a malformed answer" in str(err.value)


class _StandIn(BaseHTTPRequestHandler):
    """Answers like a rollout server of protocol 2, except that /generate drops token_ids (the fault)."""
    protocol_version = "HTTP/1.1"
    pushed: dict = {}

    def log_message(self, *args):
        return

    def _send(self, body):
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send({"status": "ok", "max_lora_rank": 8, "max_model_len": 64, "protocol": 2})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/adapter":
            _StandIn.pushed = {k: body[k] for k in ("adapter_id", "version", "sha256")}
            return self._send(_StandIn.pushed)
        return self._send({**_StandIn.pushed, "completions": [{"logprobs": [-1.0]} for _ in body["prompts"]]})


def test_an_answer_without_token_ids_is_exit_69_not_a_traceback():
    from peft import LoraConfig, get_peft_model

    from llmtune.models.tiny import make_tiny_llama

    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        policy = get_peft_model(make_tiny_llama(), LoraConfig(r=4, target_modules="all-linear"))
        client = VLLMClient(f"http://127.0.0.1:{server.server_address[1]}", 10)
        engine = VLLMEngine(client, Policy(policy, "default", lambda: 0), VLLMSettings())
        engine.sync(0)
        with pytest.raises(RolloutEngineError, match="completion 0 has no 'token_ids' list of integers") as err:
            engine.generate([[5, 6]], SamplingParams(4, (1,)))
        assert err.value.exit_code == 69
    finally:
        server.shutdown()


def test_the_stop_set_is_the_tokenizer_template_and_generation_config_eos():
    from transformers import GenerationConfig

    from llmtune.data.templates import stop_token_ids, template_eos_ids
    from llmtune.models.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    base = template_eos_ids(tok)
    assert stop_token_ids(tok) == base == stop_token_ids(tok, GenerationConfig())
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=[base[0], 7, 9])) == sorted({*base, 7, 9})
    assert stop_token_ids(tok, GenerationConfig(eos_token_id=11)) == sorted({*base, 11})
