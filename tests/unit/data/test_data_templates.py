"""Builtin chat templates (exact masks) and apply_chat_template_config."""

from __future__ import annotations

import pytest

from llmtune.config.schema import DataConfig
from llmtune.data import DataError, apply_chat_template_config, render_labels
from llmtune.data.templates import BUILTIN_TEMPLATES
from llmtune.data.tokenize import SFTTokenizer
from llmtune.models.tiny import make_tiny_tokenizer

from chat_fixture import CHAT  # noqa: E402
# Rendered with the ChatML tiny tokenizer (BOS text <|im_start|>, EOS <|im_end|>); «» = trained.
EXPECTED = {
    "chatml": "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    "«I am fine.<|im_end|>»\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n«It is 5.<|im_end|>»\n",
    # without tools and tool messages chatml_tools renders exactly as chatml
    "chatml_tools": "<|im_start|>system\nBe nice.<|im_end|>\n<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
    "«I am fine.<|im_end|>»\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n«It is 5.<|im_end|>»\n",
    "llama2": "<|im_start|>[INST] <<SYS>>\nBe nice.\n<</SYS>>\n\nHello! [/INST]« I am fine. <|im_end|>»"
    "<|im_start|>[INST] What is 2 + 3? [/INST]« It is 5. <|im_end|>»",
    "llama3": "<|im_start|><|start_header_id|>system<|end_header_id|>\n\nBe nice.<|eot_id|><|start_header_id|>user"
    "<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n«I am fine.<|eot_id|>»"
    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 2 + 3?<|eot_id|><|start_header_id|>assistant<|end_header_id|>"
    "\n\n«It is 5.<|eot_id|>»",
    "alpaca": "Be nice.\n\n### Instruction:\nHello!\n\n### Response:\n«I am fine.<|im_end|>»\n\n### Instruction:\n"
    "What is 2 + 3?\n\n### Response:\n«It is 5.<|im_end|>»\n\n",
    "zephyr": "<|system|>\nBe nice.<|im_end|>\n<|user|>\nHello!<|im_end|>\n<|assistant|>\n«I am fine.<|im_end|>»\n"
    "<|user|>\nWhat is 2 + 3?<|im_end|>\n<|assistant|>\n«It is 5.<|im_end|>»\n",
}


@pytest.mark.parametrize("name", sorted(BUILTIN_TEMPLATES))
def test_builtin_templates_mask_every_assistant_turn(name, tok):
    apply_chat_template_config(DataConfig(chat_template=name), tok)
    row = SFTTokenizer(tok, 512)({"messages": CHAT})
    assert render_labels(row.input_ids, row.labels, tok) == EXPECTED[name]


def test_apply_chat_template_config(tok):
    own = tok.chat_template
    apply_chat_template_config(DataConfig(chat_template=None), tok)
    assert tok.chat_template == own
    jinja = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    apply_chat_template_config(DataConfig(chat_template=jinja), tok)
    assert tok.chat_template == jinja
    with pytest.raises(DataError, match="'chatmll' is not a builtin template"):
        apply_chat_template_config(DataConfig(chat_template="chatmll"), tok)
    bare = make_tiny_tokenizer()
    bare.chat_template = None
    with pytest.raises(DataError, match="has no chat template"):
        apply_chat_template_config(DataConfig(), bare)
    apply_chat_template_config(DataConfig(chat_template="llama3"), bare)
    assert bare.chat_template == BUILTIN_TEMPLATES["llama3"]
