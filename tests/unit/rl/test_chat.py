"""The ids the chat template puts between two assistant turns (llmtune.rl.chat), on the tiny ChatML tokenizer and the
embedded SmolLM2-135M-Instruct tokenizer with the chatml_tools template: turn by turn (prompt ids + each assistant turn
as sampled + ToolTurns.continuation_ids) they equal the full render of the conversation at every assistant -> tool ->
assistant junction; a naive suffix diff of two renders does not; templates that cannot render tools or that rewrite
history are refused naming data.chat_template."""

import pytest

from llmtune.config import RecipeError
from llmtune.data.prompts import prompt_ids
from llmtune.data.templates import BUILTIN_TEMPLATES, CHATML, stop_token_ids
from llmtune.models.tiny import make_tiny_tokenizer
from llmtune.data.templates import tool_probe_conversation
from llmtune.rl.chat import ToolTurns, check_tool_template

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]


def tiny():
    tok = make_tiny_tokenizer()
    tok.chat_template = BUILTIN_TEMPLATES["chatml_tools"]
    return tok


def smollm2():
    from llmtune.config.schema import ModelConfig
    from llmtune.models.load import load_tokenizer

    tok = load_tokenizer(ModelConfig(name_or_path="builtin:smollm2-135m-instruct"), convert=False)
    tok.chat_template = BUILTIN_TEMPLATES["chatml_tools"]
    return tok


def render_ids(tok):
    return lambda messages, tools, generation: prompt_ids(tok, messages, tools=tools, generation_prompt=generation)


def conversation_ids(tok, turns: ToolTurns, conversation: list[dict], naive: bool = False) -> list[int]:
    """The ids a multi-turn rollout of this conversation builds: the prompt, each assistant turn as a policy that
    writes exactly the template's text samples it (stop token included), and between turns the continuation ids
    (``naive``: a suffix diff of two renders of the real conversation instead)."""
    ids = prompt_ids(tok, conversation[:1], tools=turns.tools)
    i = 1
    while i < len(conversation):
        if conversation[i]["role"] == "assistant":
            before = turns.render(conversation[:i], generation_prompt=True)
            turn = turns.render(conversation[:i + 1])[len(before):]
            ids += turns.encode(turn[:turns.turn_end(turn)])
            i += 1
            continue
        j = i
        while j < len(conversation) and conversation[j]["role"] == "tool":
            j += 1
        if naive:
            upto = turns.render(conversation[:i])
            ids += turns.encode(turns.render(conversation[:j], generation_prompt=True)[len(upto):])
        else:
            ids += turns.continuation_ids(conversation[i:j])
        i = j
    return ids


@pytest.mark.parametrize("make", [tiny, smollm2], ids=["tiny", "smollm2"])
def test_turn_by_turn_ids_equal_the_full_render_at_every_junction(make):
    tok = make()
    turns = check_tool_template(tok, TOOLS, stop_token_ids(tok), render_ids(tok))
    conversation = tool_probe_conversation()
    full = prompt_ids(tok, conversation, tools=turns.tools, generation_prompt=False)
    ours = conversation_ids(tok, turns, conversation) + turns.encode(turns.tail)
    assert ours == full
    # every junction: the prefix up to each assistant turn's start equals the full render's prefix
    for k in (4, 6):  # after the first and the second round of tool results
        prefix = prompt_ids(tok, conversation[:k], tools=turns.tools)  # ends with the next assistant header
        assert ours[:len(prefix)] == prefix
    # ChatML: the "\n" after <|im_end|> is the template's, never sampled; a suffix diff of two renders drops it
    assert turns.tail == "\n"
    naive = conversation_ids(tok, turns, conversation, naive=True) + turns.encode(turns.tail)
    assert naive != full


def test_a_template_without_tools_is_refused_naming_the_fix():
    tok = make_tiny_tokenizer()
    tok.chat_template = CHATML  # renders role + content only: the tool schemas and the calls vanish
    with pytest.raises(RecipeError, match=r"data.chat_template: the chat template does not render the tool schemas "
                       r"and the tool calls .*data.chat_template: chatml_tools"):
        check_tool_template(tok, TOOLS, stop_token_ids(tok), render_ids(tok))


def test_a_template_that_drops_the_called_tools_name_is_refused():
    tok = tiny()
    tok.chat_template = BUILTIN_TEMPLATES["chatml_tools"].replace(
        """{"name": "' + call['name'] + '", "arguments": """, """{"arguments": """)
    assert tok.chat_template != BUILTIN_TEMPLATES["chatml_tools"]
    with pytest.raises(RecipeError, match="does not render the names of the called tools"):
        check_tool_template(tok, TOOLS, stop_token_ids(tok), render_ids(tok))


def test_a_template_that_rewrites_history_is_refused():
    """Qwen3-style: an earlier assistant turn's <think> block is stripped once later turns follow."""
    tok = tiny()
    tok.chat_template = BUILTIN_TEMPLATES["chatml_tools"].replace(
        "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}",
        "{%- set content = message['content'] or '' %}"
        "{%- if not loop.last and '</think>' in content %}{%- set content = content.split('</think>')[-1].lstrip() %}"
        "{%- endif %}{{- '<|im_start|>assistant\n' + content }}")
    assert tok.chat_template != BUILTIN_TEMPLATES["chatml_tools"]
    with pytest.raises(RecipeError, match="rewrites history"):
        check_tool_template(tok, TOOLS, stop_token_ids(tok), render_ids(tok))


def test_a_template_whose_turns_do_not_end_on_a_stop_token_is_refused():
    tok = tiny()
    with pytest.raises(RecipeError, match="does not end an assistant turn with one of the stop tokens"):
        ToolTurns(tok, TOOLS, [tok.convert_tokens_to_ids("<|im_start|>")])
