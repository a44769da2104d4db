"""A tiny model that calls a tool: what the multi-turn tests drive real engines with.

A random tiny model never writes a well-formed tool call, so the tests teach one a conversation by heart first:
under the chatml_tools template, "What is 2 + 3?" -> a <tool_call> of calculator {"expression": "2 + 3"} -> the tool
result -> "The answer is 5. #### 5". Trained with a plain cross-entropy loop on the assistant tokens of the full
render (the tool result and the template's text are not trained), until greedy decoding reproduces it. The model
directory holds the tokenizer with that template, so `llmtune grpo` and the vLLM server load it as any model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from llmtune.data.templates import BUILTIN_TEMPLATES

# chatml_tools with a terse tools block (the tiny model learns the conversation faster from a short prompt): the
# tool schemas between <tools> tags in the system turn; calls, results and everything else as chatml_tools
_FULL = BUILTIN_TEMPLATES["chatml_tools"]
TEMPLATE = (_FULL[:_FULL.index("{{- '# Tools")] + "{{- '<tools>' }}" + _FULL[_FULL.index("{%- for tool in tools %}"):
            _FULL.index("{{- '\n</tools>")] + "{{- '\n</tools><|im_end|>\n' }}"
            + _FULL[_FULL.index("{%- endif %}{%- for message in messages %}"):])

QUESTION = "What is 2 + 3?"
CALL = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}}}
CONVERSATION = [
    {"role": "user", "content": QUESTION},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "name": "calculator", "content": "5"},
    {"role": "assistant", "content": "The answer is 5. #### 5"},
]


def calculator_schema() -> list[dict]:
    from transformers.utils import get_json_schema

    from llmtune.tools import calculator

    return [get_json_schema(calculator)]


def assistant_mask(tok, conversation: list[dict], tools: list[dict]) -> tuple[list[int], list[int]]:
    """The full render's ids of ``conversation`` and a mask that is 1 on each assistant turn's tokens (after its
    generation prompt, through its end-of-turn token): what a policy samples."""
    ids = tok.apply_chat_template(conversation, tools=tools, tokenize=True, return_dict=False)
    mask = [0] * len(ids)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    for i, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        start = len(tok.apply_chat_template(conversation[:i], tools=tools, tokenize=True, return_dict=False,
                                            add_generation_prompt=True))
        end = ids.index(eot, start) + 1
        mask[start:end] = [1] * (end - start)
    return ids, mask


def tool_tokenizer():
    """The tiny tokenizer, trained on the conversation's text too (few tokens per conversation), with TEMPLATE."""
    from llmtune.models.tiny import make_tiny_tokenizer

    text = make_tiny_tokenizer().apply_chat_template(CONVERSATION, tools=calculator_schema(), tokenize=False,
                                                     chat_template=TEMPLATE)
    tok = make_tiny_tokenizer(corpus=[text], vocab_size=600)
    tok.chat_template = TEMPLATE
    return tok


def tool_calling_model(path: Path, steps: int = 600) -> Path:
    """Save a tiny Llama (hidden 128: vLLM's CPU attention needs head size 32) that has learned CONVERSATION, and its
    tokenizer with TEMPLATE, to ``path``. Training stops once the loss is below 0.01 (342 steps, 23 s on one core
    here; at 200 steps the loss is still 0.45 and greedy decoding writes no well-formed call)."""
    from llmtune.models.tiny import make_tiny_llama

    tok = tool_tokenizer()
    model = make_tiny_llama(tok, hidden_size=128, seed=0)
    ids, mask = assistant_mask(tok, CONVERSATION, calculator_schema())
    input_ids = torch.tensor([ids])
    labels = torch.tensor([[i if m else -100 for i, m in zip(ids, mask)]])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 0.03 s a step; with 2 OpenMP threads on 2 busy cores, 20x that
    try:
        _fit(model, optimizer, input_ids, labels, steps)
    finally:
        torch.set_num_threads(threads)
    model.eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _fit(model, optimizer, input_ids, labels, steps: int) -> None:
    for _ in range(steps):
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if float(loss.detach()) < 0.01:  # every assistant token far above the rest: greedy decoding reproduces it
            break
