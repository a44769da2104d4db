"""OpenAI's chat-completions wire format, as the rollout endpoint (:mod:`llmtune.rl.endpoint`) speaks it: a request
checked and turned into the chat template's messages, and the answers (a JSON body, or server-sent events when the
request streams). No HTTP and no sampling here.

What a request may ask (everything else OpenAI defines is ignored, as servers of OpenAI-compatible APIs do):

- ``messages``: ``system`` (``developer`` is read as ``system``), ``user``, ``assistant`` (with ``tool_calls``, whose
  ``arguments`` are JSON strings as OpenAI sends them; they reach the template as objects) and ``tool`` messages;
  content a string, null, or text parts (other parts, images and audio, are refused: 400).
- ``tools`` (``{"type": "function", "function": {name, description, parameters}}``, rendered by the template as
  they are) and ``tool_choice`` ``auto`` (the default) or ``none`` (the tools stay in the prompt; the answer is not
  read for calls); ``required`` and a named function need constrained decoding: refused (400).
- ``max_tokens`` / ``max_completion_tokens`` (within the rollout's budget), ``stop`` (up to 4 strings: the answer
  ends before the first), ``n`` (choices, each its own sample), ``stream`` (the whole answer as one chunk, then
  ``[DONE]``; ``stream_options.include_usage``), ``logprobs`` (the engine's log-prob of each sampled token; null
  where the engine reports none, the ``hf`` engine).
- Sampling settings the trainer does not own: ``temperature``, ``top_p``, ``presence_penalty``, ``frequency_penalty``
  and ``seed`` are replaced by the run's (``rollout.temperature``, ``top_p``, ``top_k``, the run's seeds): the loss and
  the engine-vs-trainer importance correction assume the run's sampling distribution. A request that asks for
  another value is answered with the run's and counted (``agent/sampling_overridden``). ``logit_bias`` and a
  ``response_format`` other than text would change the distribution in ways the trainer does not model: refused
  (400).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from llmtune.rl.types import LENGTH

ROLES = ("system", "user", "assistant", "tool")
MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_CHOICES = 16  # n at most
OVERRIDDEN = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed")


class APIError(Exception):
    """A request the endpoint refuses, in OpenAI's error format.

    Args:
        status: the HTTP status (400, 401, 404, 413, 500). message: what is wrong and how to fix it.
        param: the request field at fault. code: a machine-readable code (``context_length_exceeded`` ...).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(
            self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass
class ChatRequest:
    """A checked request.

    Attributes:
        messages: the conversation as the chat template takes it (``tool_calls`` with object arguments; a tool
            message has its tool's ``name`` when the call it answers named one).
        keys: one comparable key per message (:func:`message_key`): what "the same history" means.
        tools: the tool schemas as sent (None: none). tools_key: their canonical JSON.
        max_tokens: the request's own limit, or None. n: choices. stop: stop strings. tool_choice: auto | none.
        stream, include_usage, logprobs: how to answer. model: the name asked for (echoed).
        overridden: the sampling settings asked for that the run replaces (names, for metrics).
    """

    messages: list[dict]
    keys: list[tuple]
    tools: list[dict] | None
    tools_key: str
    max_tokens: int | None = None
    n: int = 1
    stop: list[str] = field(default_factory=list)
    tool_choice: str = "auto"
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    model: str = "policy"
    overridden: list[str] = field(default_factory=list)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, null (""), or OpenAI's text parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(400, f"{where}.content[{i}] is a {kind!r} part; only text parts are supported "
                               "(no images or audio during training)", f"{where}.content")
            parts.append(part["text"])
        return "".join(parts)
    raise APIError(400, f"{where}.content must be a string, null or a list of text parts", f"{where}.content")


def _arguments(value: Any) -> Any:
    """A call's arguments as the template takes them: the JSON string decoded to an object (kept as it is when it is
    not valid JSON: the template shows what the model wrote)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value if value is not None else {}


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str)


def message_key(message: dict) -> tuple:
    """What makes two messages the same for joining (a template message, :func:`parse_request`'s form): role, text
    and name, and each tool call's function name and arguments (as canonical JSON); call ids and fields a template
    does not render (``refusal``, ``annotations``) are left out, so an agent that sends back the answer as the client
    library gives it (``choices[0].message``) matches it."""
    calls = tuple((c.get("function", c).get("name"), _canonical(_arguments(c.get("function", c).get("arguments"))))
                  for c in message.get("tool_calls") or [])
    return message["role"], message.get("content") or "", message.get("name") or "", calls


def _message(raw: Any, i: int, call_names: dict[str, str]) -> dict:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise APIError(400, f"{where} must be an object with a role", where)
    role = raw.get("role")
    role = "system" if role == "developer" else role
    if role not in ROLES:
        raise APIError(400, f"{where}.role is {raw.get('role')!r}; one of system, developer, user, assistant, tool",
                       f"{where}.role")
    message: dict = {"role": role, "content": _text(raw.get("content"), where)}
    if role == "assistant" and raw.get("tool_calls"):
        calls = raw["tool_calls"]
        if not isinstance(calls, list):
            raise APIError(400, f"{where}.tool_calls must be a list", f"{where}.tool_calls")
        message["tool_calls"] = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise APIError(400, f"{where}.tool_calls[{j}] must be {{type: function, function: {{name, arguments}}}}",
                               f"{where}.tool_calls")
            entry = {"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))}}
            if isinstance(call.get("id"), str):
                entry["id"] = call["id"]
                call_names[call["id"]] = fn["name"]
            message["tool_calls"].append(entry)
    if role == "tool":
        call_id = raw.get("tool_call_id")
        if isinstance(call_id, str):
            message["tool_call_id"] = call_id
        name = raw.get("name") if isinstance(raw.get("name"), str) else call_names.get(call_id or "")
        if name:
            message["name"] = name
    elif isinstance(raw.get("name"), str) and role != "assistant":
        message["name"] = raw["name"]
    return message


def _positive_int(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise APIError(400, f"{name} must be a positive integer, got {value!r}", name)
    return value


def parse_request(body: Any, temperature: float, top_p: float) -> ChatRequest:
    """Check a chat-completions request body and turn it into a :class:`ChatRequest`.

    Args:
        body: the decoded JSON body. temperature, top_p: the run's (a request asking for other values is answered
            with these, and says so in ``overridden``).

    Raises:
        APIError: 400 naming the field: no messages, an unknown role, non-text content, malformed tool calls or
            tools, an unsupported ``tool_choice`` / ``response_format`` / ``logit_bias``, bad numbers.
    """
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise APIError(400, "messages must be a non-empty list", "messages")
    call_names: dict[str, str] = {}
    messages = [_message(m, i, call_names) for i, m in enumerate(raw_messages)]
    tools = body.get("tools") or None
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str) for t in tools):
            raise APIError(400, "tools must be a list of {type: function, function: {name, description, parameters}}",
                           "tools")
    choice = body.get("tool_choice")
    choice = "auto" if choice is None else choice
    if choice not in ("auto", "none"):
        raise APIError(400, f"tool_choice {choice!r} is not supported during training (it needs constrained decoding, "
                       "which changes the policy's distribution); use auto or none", "tool_choice")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise APIError(400, "response_format other than text is not supported during training (structured outputs "
                       "constrain sampling: the trained distribution would not be the one sampled)", "response_format")
    if body.get("logit_bias"):
        raise APIError(400, "logit_bias is not supported during training (it changes the sampling distribution the "
                       "trainer's loss assumes)", "logit_bias")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"stop must be a string or a list of at most {MAX_STOP} non-empty strings", "stop")
    n = _positive_int(body, "n") or 1
    if n > MAX_CHOICES:
        raise APIError(400, f"n is {n}; at most {MAX_CHOICES} choices per request", "n")
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    overridden = []
    asked = {"temperature": temperature, "top_p": top_p, "presence_penalty": 0.0, "frequency_penalty": 0.0}
    for name in OVERRIDDEN:
        value = body.get(name)
        if value is None:
            continue
        if name == "seed" or isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isclose(
                float(value), asked[name]):
            overridden.append(name)
    options = body.get("stream_options") or {}
    return ChatRequest(messages, [message_key(m) for m in messages], tools, _canonical(tools), max_tokens, n, stop,
                       choice, bool(body.get("stream")), bool(isinstance(options, dict) and options.get(
                           "include_usage")), bool(body.get("logprobs")), str(body.get("model") or "policy"),
                       overridden)


# ---------------------------------------------------------------------------------------------------------- answers
@dataclass
class Choice:
    """One sampled answer, read: ``message`` in OpenAI's format (``content``, ``tool_calls`` with JSON-string
    arguments), ``finish_reason`` (stop, length, tool_calls), the number of sampled tokens and their engine log-probs
    (token text, log-prob) or None."""

    message: dict
    finish_reason: str
    tokens: int
    logprobs: list[tuple[str, float]] | None = None


def assistant_message(content: str, calls: list, malformed: list[str], tool_choice: str) -> tuple[dict, dict]:
    """A sampled turn as OpenAI's assistant message and as the chat template's (what the final conversation and the
    reward functions get).

    Args:
        content: the text without the markup of the well-formed calls. calls: the well-formed calls
            (:class:`llmtune.rl.tool_calls.ToolCall`). malformed: the text of each malformed call as the model wrote
            it (it stays in the content, as the built-in loop keeps it). tool_choice: ``none``: no call is read.
    """
    text = "\n".join(p for p in [content, *malformed] if p)
    template: dict = {"role": "assistant", "content": text}
    wire: dict = {"role": "assistant", "content": text or (None if calls else "")}
    if calls and tool_choice != "none":
        template["tool_calls"] = [c.as_message() for c in calls]
        wire["tool_calls"] = [{"id": c.id or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                              for c in calls]
    return wire, template


def finish_reason(sampled_finish: str, message: dict) -> str:
    """OpenAI's finish reason of a choice: ``length`` (cut by max_tokens or the budget), ``tool_calls``, ``stop``."""
    if sampled_finish == LENGTH:
        return LENGTH
    return "tool_calls" if message.get("tool_calls") else "stop"


def completion_body(request: ChatRequest, choices: list[Choice], prompt_tokens: int) -> dict:
    """The ``chat.completion`` answer."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "system_fingerprint": "llmtune",
            "choices": [{"index": i, "message": c.message, "finish_reason": c.finish_reason,
                         "logprobs": _logprobs(c) if request.logprobs else None} for i, c in enumerate(choices)],
            "usage": _usage(choices, prompt_tokens)}


def _usage(choices: list[Choice], prompt_tokens: int) -> dict:
    completion = sum(c.tokens for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _logprobs(choice: Choice) -> dict | None:
    if choice.logprobs is None:
        return None
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                        for t, lp in choice.logprobs]}


def stream_events(request: ChatRequest, choices: list[Choice], prompt_tokens: int) -> list[bytes]:
    """The answer as server-sent events: per choice one chunk with the whole message (tool calls with their index),
    one with its finish reason, then the usage chunk (``stream_options.include_usage``) and ``[DONE]``."""
    base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk", "created": int(time.time()),
            "model": request.model, "system_fingerprint": "llmtune"}
    events = []

    def emit(payload: dict) -> None:
        events.append(b"data: " + json.dumps({**base, **payload}, ensure_ascii=False).encode() + b"\n\n")

    for i, c in enumerate(choices):
        delta: dict = {"role": "assistant", "content": c.message.get("content")}
        if c.message.get("tool_calls"):
            delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(c.message["tool_calls"])]
        emit({"choices": [{"index": i, "delta": delta, "finish_reason": None,
                           "logprobs": _logprobs(c) if request.logprobs else None}]})
        emit({"choices": [{"index": i, "delta": {}, "finish_reason": c.finish_reason, "logprobs": None}]})
    if request.include_usage:
        emit({"choices": [], "usage": _usage(choices, prompt_tokens)})
    events.append(b"data: [DONE]\n\n")
    return events
