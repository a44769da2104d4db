"""Tool calls in a sampled assistant turn: reading them in the format of the model's template family (Hermes/Qwen
``<tool_call>`` JSON, Llama-3.1 JSON, Mistral ``[TOOL_CALLS]``), with transformers' own response-template parser
where the tokenizer has one. Nothing the model writes is executed or can raise here: a call that cannot be read is a
:class:`ToolCall` with ``error`` set, which goes back to the model as a "malformed" tool result
(:meth:`llmtune.rl.toolbox.Toolbox.call`). A call's arguments are checked against its tool's JSON schema here too
(:func:`check_arguments`), before the toolbox runs it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "llama3", "mistral")
MESSAGE_CHARS = 300  # an exception message or a bad value shown to the model is cut to this many characters


def _exception_text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not end the run
        return "(its message cannot be shown)"


def _cut(text: str, limit: int = MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


_JSON_TYPE_NAMES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                    (dict, "object"), (type(None), "null"))


def _json_type(value: Any) -> str:
    return next((name for t, name in _JSON_TYPE_NAMES if isinstance(value, t)), type(value).__name__)




@dataclass
class ToolCall:
    """One tool call parsed from a model turn.

    Attributes:
        name: the tool's name (None when the call has none).
        arguments: the decoded JSON object of arguments (None when malformed).
        raw: the call's text as the model wrote it (for a call inside a JSON list: the item re-encoded as JSON).
        error: None, or why the call is malformed (invalid JSON, no string name, arguments not an object); such a
            call goes back to the model as a ``"malformed"`` result.
        id: the call's id when the format carries one (Mistral), else None.
    """

    name: str | None
    arguments: dict | None
    raw: str
    error: str | None = None
    id: str | None = None

    def as_message(self) -> dict:
        """The call as an entry of an assistant message's ``tool_calls`` (transformers' chat format)."""
        entry = {"type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return entry if self.id is None else {"id": self.id, **entry}


# --------------------------------------------------------------------------------------------------------- parsing


def detect_parser(tokenizer: Any) -> str | None:
    """The tool-call format of a chat template, from its text.

    ``<tool_call>`` -> ``"hermes"`` (Qwen2.5/Qwen3, Hermes); ``[TOOL_CALLS]`` -> ``"mistral"``; ``<|python_tag|>``,
    or Llama 3's header tokens with a ``"parameters"`` JSON key -> ``"llama3"`` (Llama 3.1-3.3).

    Args:
        tokenizer: a tokenizer (its ``chat_template``: a string, or a dict/list of named templates, all searched), or
            the template text itself.

    Returns:
        One of :data:`PARSERS`, or None when the template shows none of them (it may not support tools at all).
    """
    template = tokenizer if isinstance(tokenizer, str) else getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = "\n".join(map(str, template.values()))
    elif isinstance(template, list):
        template = "\n".join(str(t.get("template", "")) if isinstance(t, dict) else str(t) for t in template)
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return "llama3"
    return None


def resolve_tool_parser(setting: str, tokenizer: Any) -> tuple[str | None, bool]:
    """What reads the tool calls of a run (``agent.tool_parser``): ``(family, response_template)``.

    ``auto``: the tokenizer's own response template when it has one (``response_template``; the family the template
    shows, if any, then only finds which call was malformed), else the family :func:`detect_parser` finds. An explicit
    family (``hermes``, ``llama3``, ``mistral``) is used as it is, response template or not.

    Args:
        setting: ``auto`` or one of :data:`PARSERS`. tokenizer: the policy's tokenizer (its chat template applied).

    Returns:
        ``(family or None, whether to parse with the tokenizer's response template)``; pass the tokenizer to
        :func:`parse_tool_calls` only when the second is True.

    Raises:
        RecipeError: ``auto`` finds neither a response template nor a family in the chat template
            (``agent.tool_parser``).
    """
    if setting != "auto":
        return setting, False
    response_template = getattr(tokenizer, "response_template", None) is not None
    family = detect_parser(tokenizer)
    if family is None and not response_template:
        from llmtune.config import RecipeError

        raise RecipeError([("agent.tool_parser", "auto cannot tell the tool-call format of this chat template (no "
                            "<tool_call>, <|python_tag|> or [TOOL_CALLS] in it, no response template in the "
                            "tokenizer): set agent.tool_parser to hermes, llama3 or mistral")])
    return family, response_template


def parse_tool_calls(
    text: str, parser: str | None, tokenizer: Any = None, *, prefix: str = "", tools: list[dict] | None = None
) -> tuple[str, list[ToolCall]]:
    """Split one sampled assistant turn into its text and its tool calls (never raises on the model's text).

    With a ``tokenizer`` that has a ``response_template`` (transformers >= 5.24; none of the embedded tokenizers has
    one; pass it only when the run asks for it: :func:`resolve_tool_parser`), transformers' own parser is used
    (``tokenizer.get_response_parser``, the streaming form of ``tokenizer.parse_response``); when it cannot parse the
    turn (it raises on the first invalid JSON block), the family parser finds which call is malformed, or, without a
    family, the whole turn is one malformed call.
    Otherwise the family parser:

    - ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any whitespace around the JSON, several
      blocks; an unclosed block at the end of the turn counts (as in vLLM and transformers).
    - ``llama3``: a turn that starts with ``<|python_tag|>`` or ``{`` is JSON calls ``{"name": ...,
      "parameters": {...}}`` (``"arguments"`` accepted too) separated by ``;`` or whitespace; text after them is
      content. Llama's built-in-tool syntax (``<|python_tag|>brave_search.call(...)``) is not supported (malformed).
    - ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id"?: ...}, ...]``, or the newer
      ``[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}`` / ``[TOOL_CALLS]name[ARGS]{...}``, repeated.

    A missing ``arguments``/``parameters`` key means no arguments (``{}``). A block that is not valid JSON, has no
    string name or has arguments that are not a JSON object becomes a :class:`ToolCall` with ``error`` set.

    Args:
        text: one assistant turn as sampled: decoded with special tokens kept, the end-of-turn token stripped.
        parser: one of :data:`PARSERS` (:func:`detect_parser`), or None when the tokenizer's response template is
            the only parser.
        tokenizer: a tokenizer whose ``response_template`` is used when it has one, or None: the family parser only
            (an explicit ``agent.tool_parser``).
        prefix: response-template path only: the rendered prompt before the turn (it may pre-write part of the
            turn, e.g. ``<think>``); ``""`` = the turn starts clean.
        tools: response-template path only: the tools' schemas, with which transformers casts string argument
            values (``"7"`` -> ``7`` for an integer parameter; needed by formats that write every value as text).

    Returns:
        ``(content, calls)``: the turn's text without the tool-call markup (stripped; on the response-template path
        the template's ``content`` pieces joined by newlines, without fields such as ``reasoning_content``), and the
        calls in order (empty when the turn has no tool-call markup).

    Raises:
        ValueError: ``parser`` is not one of :data:`PARSERS` and there is no response template (a caller's error).
    """
    if tokenizer is not None and getattr(tokenizer, "response_template", None) is not None:
        parsed = _parse_with_response_template(text, tokenizer, prefix, tools)
        if not isinstance(parsed, str):
            return parsed
        if parser is None:
            return "", [ToolCall(None, None, text, f"could not parse the turn: {_cut(parsed.splitlines()[0])}")]
    if parser not in _FAMILY_PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}; one of {', '.join(PARSERS)}")
    return _FAMILY_PARSERS[parser](text)


def _parse_with_response_template(text: str, tokenizer: Any, prefix: str, tools: list[dict] | None):
    """``(content, calls)`` from transformers' response parser, or the parser's error message (str).

    The streaming parser is used (not ``parse_response``) to keep every piece of content: ``parse_response`` returns
    one ``content`` value, so text before a tool call is replaced by text after it (transformers 5.24)."""
    try:
        stream = tokenizer.get_response_parser(prefix=prefix, tools=tools)
        events = [*stream.initial_events, *stream.feed(text)]
        message, final = stream.finalize()
    except Exception as exc:  # noqa: BLE001 - it raises ValueError on a bad block, and the text is the model's
        return f"{type(exc).__name__}: {_exception_text(exc)}"
    pieces = [e["value"] for e in [*events, *final] if e["type"] == "region_close" and e["field"] == "content"]
    content = "\n".join(str(p).strip() for p in pieces if p not in (None, ""))
    calls = []
    for item in message.get("tool_calls") or []:
        fn = item.get("function", item) if isinstance(item, dict) else item
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):  # a template that leaves them as text
            fn = {**fn, "arguments": _json_or_text(fn["arguments"])}
        raw = json.dumps(fn, ensure_ascii=False, default=str)
        call_id = item.get("id") if isinstance(item, dict) else None
        calls.append(_call_from(fn, raw, ("arguments",), call_id))
    return content.strip(), calls


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_from(obj: Any, raw: str, argument_keys: tuple[str, ...], call_id: Any = None) -> ToolCall:
    """A ToolCall from a decoded JSON value, or a malformed one saying what is wrong."""
    shape = f'{{"name": "<tool>", "{argument_keys[0]}": {{...}}}}'
    if not isinstance(obj, dict):
        return ToolCall(None, None, raw, f"expected a JSON object {shape}, got {_json_type(obj)}")
    call_id = obj.get("id", call_id)
    call_id = call_id if isinstance(call_id, str) else None
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCall(None, None, raw, f'no "name" string; write {shape}', call_id)
    key = next((k for k in argument_keys if k in obj), None)
    arguments = {} if key is None else obj[key]
    if not isinstance(arguments, dict):
        return ToolCall(name, None, raw, f'"{key}" must be a JSON object, got {_json_type(arguments)}', call_id)
    return ToolCall(name, arguments, raw, None, call_id)


def _bad_json(raw: str, exc: json.JSONDecodeError) -> ToolCall:
    return ToolCall(None, None, raw, f"not valid JSON ({exc.msg} at character {exc.pos})")


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    calls = []
    for m in _HERMES.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError as exc:
            calls.append(_bad_json(m.group(0), exc))
            continue
        calls.append(_call_from(obj, m.group(0), ("arguments",)))
    return _HERMES.sub("", text).strip(), calls


_PYTHON_TAG = "<|python_tag|>"


def _parse_llama3(text: str) -> tuple[str, list[ToolCall]]:
    body = text.lstrip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG):]
    elif not body.startswith("{"):
        return text.strip(), []
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
        if pos >= len(body) or body[pos] != "{":
            break
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as exc:
            calls.append(_bad_json(body[pos:], exc))
            pos = len(body)
            break
        calls.append(_call_from(obj, body[pos:end], ("parameters", "arguments")))
        pos = end
    if tagged and not calls:
        return "", [ToolCall(None, None, text, 'expected JSON {"name": "<tool>", "parameters": {...}} after '
                                               f"{_PYTHON_TAG}")]
    return body[pos:].strip(), calls


_TOOL_CALLS, _ARGS, _CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"


def _parse_mistral(text: str) -> tuple[str, list[ToolCall]]:
    content, *segments = text.split(_TOOL_CALLS)
    decoder, calls, rest = json.JSONDecoder(), [], []
    for segment in segments:
        seg = segment.strip()
        if seg.startswith("["):  # [{"name": ..., "arguments": {...}}, ...]
            try:
                items, end = decoder.raw_decode(seg)
            except json.JSONDecodeError as exc:
                calls.append(_bad_json(_TOOL_CALLS + segment, exc))
                continue
            if not items:
                calls.append(ToolCall(None, None, _TOOL_CALLS + segment, "an empty list of calls"))
            calls += [_call_from(item, json.dumps(item, ensure_ascii=False), ("arguments",)) for item in items]
            rest.append(seg[end:])
        elif _ARGS in seg:  # name[CALL_ID]id[ARGS]{...}
            head, _, tail = seg.partition(_ARGS)
            name, _, call_id = head.partition(_CALL_ID)
            tail = tail.lstrip()
            try:
                arguments, end = decoder.raw_decode(tail)
            except json.JSONDecodeError as exc:
                calls.append(_bad_json(_TOOL_CALLS + segment, exc))
                continue
            obj = {"name": name.strip(), "arguments": arguments, "id": call_id.strip() or None}
            calls.append(_call_from(obj, _TOOL_CALLS + segment, ("arguments",)))
            rest.append(tail[end:])
        else:
            calls.append(ToolCall(None, None, _TOOL_CALLS + segment, 'expected [{"name": "<tool>", "arguments": '
                                                                     f"{{...}}}}] or <tool>{_ARGS}{{...}}"))
    return "\n".join(p.strip() for p in [content, *rest] if p.strip()), calls


_FAMILY_PARSERS = {"hermes": _parse_hermes, "llama3": _parse_llama3, "mistral": _parse_mistral}


# ---------------------------------------------------------------------------- arguments against a schema


def check_arguments(arguments: dict, schema: dict) -> tuple[dict, list[str]]:
    """Check a call's arguments against a tool's JSON schema (the subset :func:`transformers.utils.get_json_schema`
    writes: ``type`` as a name or a list, ``nullable``, ``enum``, ``anyOf``, ``items``, ``prefixItems``,
    ``additionalProperties``; ``{}`` accepts anything).

    Args:
        arguments: the decoded JSON object of the call.
        schema: ``{"type": "function", "function": {"name", "parameters": {...}}}``.

    Returns:
        ``(arguments, problems)``: the arguments to pass (integers written as ``3.0`` become ``3``), and every problem
        as a short phrase for the model (empty when the arguments fit).
    """
    parameters = schema["function"].get("parameters", {})
    properties = parameters.get("properties", {})
    problems = [f"unknown argument {_cut(repr(k))}" for k in arguments if k not in properties]
    problems += [f"missing required argument {k!r}" for k in parameters.get("required", []) if k not in arguments]
    out = {}
    for k, v in arguments.items():
        if k in properties:
            out[k], problem = _conform(v, properties[k], repr(k))
            if problem:
                problems.append(problem)
    return out, problems


def _is_type(value: Any, name: str) -> bool:
    if name == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)) or (
            isinstance(value, float) and value.is_integer())
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    checks = {"string": str, "boolean": bool, "array": list, "object": dict, "null": type(None)}
    return isinstance(value, checks[name]) if name in checks else True  # other types (image, audio): unchecked


def _conform(value: Any, schema: dict, where: str) -> tuple[Any, str | None]:
    """(value to pass, problem or None) for one JSON value against one schema."""
    if value is None and schema.get("nullable"):
        return None, None
    if "anyOf" in schema:
        for option in schema["anyOf"]:
            converted, problem = _conform(value, option, where)
            if problem is None:
                return converted, None
        return value, f"{where} must be {_describe(schema)}, {_got(value)}"
    types = schema.get("type")
    if types is not None:
        types = [types] if isinstance(types, str) else list(types)
        matched = next((t for t in types if _is_type(value, t)), None)
        if matched is None:
            return value, f"{where} must be {_describe(schema)}, {_got(value)}"
        if matched == "integer" and isinstance(value, float):
            value = int(value)
        if matched == "array" and isinstance(schema.get("items"), dict):
            value, problem = _conform_all(value, [schema["items"]] * len(value), where)
            if problem:
                return value, problem
        if matched == "array" and isinstance(schema.get("prefixItems"), list):
            if len(value) != len(schema["prefixItems"]):
                return value, f"{where} must have {len(schema['prefixItems'])} items, got {len(value)}"
            value, problem = _conform_all(value, schema["prefixItems"], where)
            if problem:
                return value, problem
        if matched == "object" and isinstance(schema.get("additionalProperties"), dict):
            items, problem = _conform_all(list(value.values()), [schema["additionalProperties"]] * len(value), where)
            if problem:
                return value, problem
            value = dict(zip(value, items))
    if "enum" in schema and not any(value == e and isinstance(value, bool) == isinstance(e, bool)
                                    for e in schema["enum"]):
        return value, f"{where} must be {_describe(schema)}, {_got(value)}"
    return value, None


def _got(value: Any) -> str:
    return f"got {_json_type(value)} {_cut(json.dumps(value, ensure_ascii=False, default=str), 60)}"


def _conform_all(values: list, schemas: list[dict], where: str) -> tuple[list, str | None]:
    out = []
    for i, (v, s) in enumerate(zip(values, schemas)):
        converted, problem = _conform(v, s, f"{where}[{i}]")
        if problem:
            return values, problem
        out.append(converted)
    return out, None


def _describe(schema: dict) -> str:
    """A parameter's type in a few words: ``integer``, ``string or null``, ``array of number``."""
    if "anyOf" in schema:
        text = " or ".join(_describe(s) for s in schema["anyOf"])
    else:
        types = schema.get("type", "any")
        text = " or ".join([types] if isinstance(types, str) else types)
        if isinstance(schema.get("items"), dict):
            text += f" of {_describe(schema['items'])}"
        if isinstance(schema.get("enum"), list):
            text += f" in {_cut(json.dumps(schema['enum'], ensure_ascii=False), 120)}"
    return text + (" or null" if schema.get("nullable") else "")


def _signature(schema: dict) -> str:
    """``name(a: integer, b?: string)``: how to call a tool, for an error message (``?`` = optional)."""
    fn = schema["function"]
    parameters = fn.get("parameters", {})
    required = set(parameters.get("required", []))
    args = [f"{k}{'' if k in required else '?'}: {_describe(s)}" for k, s in parameters.get("properties", {}).items()]
    return f"{fn['name']}({', '.join(args)})"


