"""The OpenAI wire format of the agent endpoint (llmtune.rl.openai_api), without a model: what a request may ask and
what is refused (400 naming the field), the sampling settings the run replaces, and what "the same message" means
for joining (an answer sent back as the openai client gives it matches what was answered)."""

import json

import pytest

from llmtune.rl.openai_api import APIError, assistant_message, message_key, parse_request
from llmtune.rl.tool_calls import ToolCall

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]


def request(**body):
    return parse_request({"model": "m", "messages": [{"role": "user", "content": "Hi"}], **body}, 1.0, 1.0)


def test_messages_become_the_templates_with_object_arguments_and_tool_names():
    r = parse_request({"messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calculator",
                                                              "arguments": "{\"expression\": \"2 + 3\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}], "tools": TOOLS}, 1.0, 1.0)
    assert r.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}},
             "id": "call_1"}]},
        {"role": "tool", "content": "5", "tool_call_id": "call_1", "name": "calculator"}]
    assert (r.tools, r.n, r.tool_choice, r.stream, r.overridden) == (TOOLS, 1, "auto", False, [])


@pytest.mark.parametrize("body,param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "calculator"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"logit_bias": {"11": 5}}, "logit_bias"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"n": 0}, "n"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_what_cannot_be_honoured_is_refused_with_its_field(body, param):
    with pytest.raises(APIError) as err:
        parse_request({"messages": [{"role": "user", "content": "Hi"}], **body}, 1.0, 1.0)
    assert err.value.status == 400 and err.value.param == param
    assert err.value.body()["error"]["type"] == "invalid_request_error"


def test_the_runs_sampling_settings_replace_the_requests_and_say_so():
    assert request(temperature=1.0, top_p=1).overridden == []  # what the run samples with anyway
    assert request(temperature=0.2, top_p=0.9, seed=3, presence_penalty=0.0).overridden == ["temperature", "top_p",
                                                                                           "seed"]
    r = request(max_completion_tokens=7, max_tokens=99, stop="###", n=2, stream=True,
                stream_options={"include_usage": True})
    assert (r.max_tokens, r.stop, r.n, r.stream, r.include_usage) == (7, ["###"], 2, True, True)


def test_an_answer_sent_back_as_the_client_gives_it_is_the_same_message():
    openai = pytest.importorskip("openai")
    from openai.types.chat import ChatCompletion

    call = ToolCall("calculator", {"expression": "2 + 3"}, "<tool_call>...</tool_call>")
    wire, template = assistant_message("Let me compute.", [call], [], "auto")
    assert json.loads(wire["tool_calls"][0]["function"]["arguments"]) == {"expression": "2 + 3"}
    # the client's object, appended to messages as agents do, serialised by the client as it sends it
    body = {"id": "x", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": wire}]}
    message = ChatCompletion.model_validate(body).choices[0].message
    sent = json.loads(json.dumps(message.model_dump(mode="json")))
    again = parse_request({"messages": [{"role": "user", "content": "Hi"}, sent]}, 1.0, 1.0).messages[1]
    assert message_key(again) == message_key(template)
    assert openai.__version__
    # a different call, or different text, is another message
    other = dict(sent, content="Let me think.")
    assert message_key(parse_request({"messages": [other]}, 1.0, 1.0).messages[0]) != message_key(template)


def test_tool_choice_none_keeps_the_text_and_reads_no_call():
    call = ToolCall("calculator", {"expression": "1"}, "<tool_call>...</tool_call>")
    wire, template = assistant_message("text", [call], ["<tool_call>{bad</tool_call>"], "none")
    assert "tool_calls" not in wire and "tool_calls" not in template
    assert wire["content"] == "text\n<tool_call>{bad</tool_call>"
