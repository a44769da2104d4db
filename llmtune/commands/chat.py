"""``llmtune chat``: talk to a run's result, formatting prompts with the chat template it was trained with.

Accepts a merged model directory or a run directory (its ``merged/`` model when exported, else base + adapter
as :func:`llmtune.export.merge.load_adapter_model` builds it), and stops generation at the chat template's end of turn
(:func:`llmtune.data.templates.template_eos_ids`) as well as the tokenizer's EOS. Reward models (``model_head: score``)
output one score, not text: chatting with them is refused with an explanation.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from llmtune.core import rundir as rd
from llmtune.errors import LlmtuneError


class ChatError(LlmtuneError, RuntimeError):
    """The directory holds no chat model (a reward model, or neither a run nor a model directory)."""


def _refuse_score_model(where: Path, what: str) -> None:
    raise ChatError(
        f"{where} is a reward model ({what}): it outputs one score per conversation, not text, so there is nothing "
        "to chat with. Chat with a policy run (sft, dpo, ppo) instead; score texts with the exported model's "
        "AutoModelForSequenceClassification."
    )


def load_for_chat(path: str | Path):
    """``(model, tokenizer)`` from a merged model dir or a run dir (merged/ if present, else base + adapter).

    Raises:
        ChatError: the path is neither, or holds a reward (sequence-classification) model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / rd.LINEAGE).is_file() and not (path / "config.json").is_file():
        path = _pipeline_model(path)
    if (path / rd.LINEAGE).is_file():
        head = json.loads((path / rd.LINEAGE).read_text()).get("model_head", "causal_lm")
        if head == "score":
            _refuse_score_model(path, "lineage.json: model_head score")
        if (path / "merged" / "config.json").is_file():
            path = path / "merged"
        else:
            from llmtune.export.merge import load_adapter_model, load_run_recipe

            model, tokenizer, _ = load_adapter_model(path, load_run_recipe(path))
            return model.eval(), tokenizer
    if not (path / "config.json").is_file():
        raise ChatError(f"{path} is neither a model directory (config.json) nor a finished run (lineage.json)")
    architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        _refuse_score_model(path, f"config.json architectures {architectures}")
    from llmtune.models.weight_files import check_weight_files

    check_weight_files(path)  # truncated / corrupt safetensors are named
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


def _pipeline_model(path: Path) -> Path:
    """A pipeline directory (``llmtune pipeline``'s ``pipeline.dir``): its exported ``merged/`` model; without one,
    the directory itself (the caller reports it).

    Raises:
        ChatError: a pipeline directory whose export has not run (names its finished policy steps).
    """
    if (path / "merged" / "config.json").is_file():
        return path / "merged"
    steps = sorted(p.name for p in path.iterdir() if (p / rd.LINEAGE).is_file()) if path.is_dir() else []
    if steps:
        raise ChatError(f"{path} is a pipeline directory without an exported merged/ model (the pipeline stopped "
                        f"before its export?); rerun the pipeline, or chat with one of its runs: "
                        + ", ".join(f"llmtune chat {path / s}" for s in steps))
    return path


def stop_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a reply: the chat template's end of turn, the tokenizer's and the model's EOS."""
    from llmtune.data.templates import stop_token_ids

    return stop_token_ids(tokenizer, getattr(model, "generation_config", None))


@torch.no_grad()
def generate_reply(model, tokenizer, messages: list[dict], max_new_tokens: int = 256) -> list[int]:
    """Greedy reply token ids to ``messages`` (OpenAI role/content dicts), ending with the stop token if one came."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    device = next(model.parameters()).device
    eos = stop_ids(model, tokenizer)
    out = model.generate(
        input_ids=enc["input_ids"].to(device), attention_mask=enc["attention_mask"].to(device),
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0],
    )
    return out[0, enc["input_ids"].shape[1]:].tolist()


def reply(model, tokenizer, messages: list[dict], max_new_tokens: int = 256) -> str:
    """Greedy reply text to ``messages``, stopping at the template's end of turn (special tokens removed)."""
    ids = generate_reply(model, tokenizer, messages, max_new_tokens)
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


def chat_command(path: str, prompt: str | None, max_new_tokens: int, system: str | None) -> int:
    """One-shot (``--prompt``) or interactive chat; returns the exit code.

    Raises:
        ChatError: see :func:`load_for_chat`.
    """
    model, tokenizer = load_for_chat(path)
    history: list[dict] = [{"role": "system", "content": system}] if system else []
    if prompt is not None:
        print(reply(model, tokenizer, [*history, {"role": "user", "content": prompt}], max_new_tokens))
        return 0
    print("interactive chat; an empty line or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            text = input("you> ").strip()
        except EOFError:
            return 0
        if not text:
            return 0
        history.append({"role": "user", "content": text})
        answer = reply(model, tokenizer, history, max_new_tokens)
        history.append({"role": "assistant", "content": answer})
        print(f"model> {answer}")
