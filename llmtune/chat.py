"""``llmtune chat``: talk to a run's result, formatting prompts with the chat template it was trained with.

Accepts a merged model directory, a run directory (uses ``merged/`` when exported, else base + adapter),
and stops generation at the template's EOS.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from llmtune.core import rundir as rd


def load_for_chat(path: str | Path):
    """``(model, tokenizer)`` from a merged model dir or a run dir (merged/ if present, else base + adapter).

    Raises:
        FileNotFoundError: the path is neither.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if (path / rd.LINEAGE).is_file():
        if (path / "merged" / "config.json").is_file():
            path = path / "merged"
        else:
            from llmtune.export import load_run_recipe, merge_adapter

            model, tokenizer = merge_adapter(path, load_run_recipe(path))
            return model.eval(), tokenizer
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is neither a model directory (config.json) nor a finished run (lineage.json)")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@torch.no_grad()
def reply(model, tokenizer, messages: list[dict], max_new_tokens: int = 256) -> str:
    """Greedy reply to ``messages`` (OpenAI role/content dicts), stopping at the template's EOS."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True).strip()


def chat_command(path: str, prompt: str | None, max_new_tokens: int, system: str | None) -> int:
    """One-shot (``--prompt``) or interactive chat; returns the exit code."""
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
