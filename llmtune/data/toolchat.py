"""Tool conversations in chat rows: tool calls, tool results and tool schemas, parsed and checked.

The form is transformers' chat format (what ``apply_chat_template(messages, tools=...)`` renders and TRL's
``SFTTrainer`` reads):

* an assistant turn may carry ``tool_calls``: ``[{"type": "function", "function": {"name": str, "arguments":
  {...}}}, ...]`` (the OpenAI form; ``arguments`` may also be a JSON string holding an object, as OpenAI exports
  write it, and a call may be the bare ``{"name", "arguments"}``; both are read into the form above, an optional
  ``id`` is kept). Its ``content`` may then be empty or null;
* a ``tool`` turn (``{"role": "tool", "content": str, "name"?: str, "tool_call_id"?: str}``) is the result of one
  call; the results of an assistant turn's calls follow it directly, one per call, and the assistant answers them;
* a row's ``tools`` column lists the JSON schemas the template renders (``[{"type": "function", "function": {"name",
  "description", "parameters"}}]``, as ``transformers.utils.get_json_schema`` writes them; a bare ``{"name", ...}``
  schema is read into that form, a JSON string holding the list is parsed).

ShareGPT rows (LLaMA-Factory's layout) write a call as a ``function_call`` turn whose value is the JSON of one call
or a list of calls, and a result as an ``observation`` (or ``tool``) turn.

Every check raises :class:`~llmtune.data.errors.RowError` with the turn, the field, what was expected and the fix.
"""

from __future__ import annotations

import json
from typing import Any

from llmtune.data.errors import RowError

ORDER = "roles out of order"
TOOL_ROLES = {"tool": "tool", "observation": "tool"}  # role names of a tool result -> canonical "tool"
CALL_ROLE = "function_call"  # ShareGPT (LLaMA-Factory): an assistant turn whose value is the JSON of its call(s)
MALFORMED_CALLS = "malformed tool_calls"
MALFORMED_TOOLS = "malformed tools"
NO_CALL = "tool result without a tool call"
RESULT_COUNT = "tool results do not match the calls"
UNKNOWN_TOOL = "unknown tool"
UNKNOWN_CALL_ID = "unknown tool_call_id"
_JSON_TYPE = {
    dict: "an object", list: "an array", int: "a number", float: "a number", bool: "a boolean", type(None): "null",
}


def json_type_name(value: Any) -> str:
    """How a JSON value's type is named in messages ("an object", "a number", ...)."""
    return _JSON_TYPE.get(type(value), type(value).__name__)


def is_tool_conversation(messages: list[dict]) -> bool:
    """True when a canonical conversation has a tool turn or an assistant turn with tool calls."""
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def is_tool_row(row: dict) -> bool:
    """True for a canonical chat row (or prompt row) with a ``tools`` column, tool calls or tool results."""
    messages = row.get("messages") or (row["prompt"] if isinstance(row.get("prompt"), list) else [])
    return bool(row.get("tools")) or is_tool_conversation(messages)


def _arguments(value: Any, where: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(MALFORMED_CALLS, f"{where} 'arguments' is a string but not JSON ({exc.msg} at char "
                           f"{exc.pos}); write the arguments as an object, e.g. {{\"expression\": \"2 + 3\"}}") from None
    if not isinstance(value, dict):
        raise RowError(MALFORMED_CALLS, f"{where} 'arguments' must be an object of argument name -> value (or a "
                       f"JSON string of one), got {json_type_name(value)}; use {{}} for a call without arguments")
    return value


def parse_tool_calls(value: Any, where: str) -> list[dict]:
    """The calls of one assistant turn in the canonical form ``{"type": "function", "function": {"name", "arguments":
    dict}}`` (plus ``id`` when given).

    Args:
        value: the turn's ``tool_calls`` (a list of calls; None or ``[]`` = no calls).
        where: names the turn in messages, e.g. ``"turn 1 (assistant)"``.

    Raises:
        RowError: (malformed tool_calls) not a list of objects, a call without a string ``name``, ``arguments`` not
            an object (or a JSON string of one), a ``type`` other than ``function``.
    """
    if value is None:
        return []
    if not isinstance(value, list):
        raise RowError(MALFORMED_CALLS, f"{where} 'tool_calls' must be a list of calls, got {json_type_name(value)}; "
                       "write [{\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": {...}}}]")
    calls = []
    for k, call in enumerate(value):
        at = f"{where} tool call {k}"
        if not isinstance(call, dict):
            raise RowError(MALFORMED_CALLS, f"{at} is {json_type_name(call)}; expected an object "
                           "{\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": {...}}}")
        if call.get("type", "function") != "function":
            raise RowError(MALFORMED_CALLS, f"{at} has type {call['type']!r}; only \"function\" calls are supported")
        function = call.get("function", call)
        if not isinstance(function, dict):
            raise RowError(MALFORMED_CALLS, f"{at} 'function' must be an object {{name, arguments}}, got "
                           f"{json_type_name(function)}")
        name = function.get("name")
        if not isinstance(name, str) or not name.strip():
            raise RowError(MALFORMED_CALLS, f"{at} lacks a 'name' (a non-empty string naming the tool), got "
                           f"{json_type_name(name) if name is not None else 'none'}")
        if "arguments" not in function:
            raise RowError(MALFORMED_CALLS, f"{at} ({name!r}) lacks 'arguments'; give an object ({{}} for none)")
        canonical: dict = {"type": "function",
                           "function": {"name": name, "arguments": _arguments(function["arguments"], at)}}
        if call.get("id") is not None:
            if not isinstance(call["id"], str):
                raise RowError(MALFORMED_CALLS, f"{at} 'id' must be a string, got {json_type_name(call['id'])}")
            canonical["id"] = call["id"]
        calls.append(canonical)
    return calls


def calls_from_text(value: Any, where: str) -> list[dict]:
    """The calls of a ShareGPT ``function_call`` turn: its value is the JSON of one call or of a list of calls.

    Raises:
        RowError: (malformed tool_calls) the value is not a JSON string of a call or a list of calls.
    """
    if not isinstance(value, str):
        raise RowError(MALFORMED_CALLS, f"{where} value must be the JSON of a call {{\"name\": ..., \"arguments\": "
                       f"{{...}}}} (a string), got {json_type_name(value)}")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise RowError(MALFORMED_CALLS, f"{where} value is not JSON ({exc.msg} at char {exc.pos}); a function_call "
                       "turn holds {\"name\": ..., \"arguments\": {...}} or a list of them") from None
    calls = parse_tool_calls(parsed if isinstance(parsed, list) else [parsed], where)
    if not calls:
        raise RowError(MALFORMED_CALLS, f"{where} holds an empty list of calls")
    return calls


def tool_turn(turn: dict, content: Any, t: int, where: str, content_col: str) -> dict:
    """The canonical tool-result message of a ``tool`` turn: ``{"role": "tool", "content", "name"?,
    "tool_call_id"?}``.

    Raises:
        RowError: content missing or not a string; ``name`` / ``tool_call_id`` not strings.
    """
    if content is None:
        raise RowError(f"missing field '{content_col}'", f"{where}turn {t} (tool) lacks field '{content_col}' (the "
                       "tool's result as a string)")
    if not isinstance(content, str):
        raise RowError("non-string content", f"{where}turn {t} (tool) field '{content_col}' must be a string, got "
                       f"{json_type_name(content)}; write a structured result as its JSON text (json.dumps)")
    message = {"role": "tool", "content": content}
    for field in ("name", "tool_call_id"):
        value = turn.get(field)
        if value is None:
            continue
        if not isinstance(value, str):
            raise RowError(MALFORMED_CALLS, f"{where}turn {t} (tool) field '{field}' must be a string, got "
                           f"{json_type_name(value)}")
        message[field] = value
    return message


def parse_tools(value: Any, col: str) -> list[dict] | None:
    """A row's ``tools`` column as a list of JSON schemas ``{"type": "function", "function": {...}}`` (None when
    absent or empty).

    Args:
        value: the column's value: a list of schemas, or a JSON string holding one (how Arrow/CSV files store it).
        col: the column's name (for messages).

    Raises:
        RowError: (malformed tools) not a list (or JSON of one) of objects, a schema without a string name, a
            ``type`` other than ``function``, ``parameters`` not an object, two tools with one name.
    """
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(MALFORMED_TOOLS, f"field '{col}' is a string but not JSON ({exc.msg} at char {exc.pos}); "
                           "expected a list of JSON schemas [{\"type\": \"function\", \"function\": {\"name\": ..., "
                           "\"description\": ..., \"parameters\": {...}}}]") from None
    if not isinstance(value, list):
        raise RowError(MALFORMED_TOOLS, f"field '{col}' must be a list of JSON schemas, got {json_type_name(value)}; "
                       "e.g. [transformers.utils.get_json_schema(my_tool)]")
    tools, names = [], []
    for k, schema in enumerate(value):
        at = f"field '{col}' item {k}"
        if not isinstance(schema, dict):
            raise RowError(MALFORMED_TOOLS, f"{at} is {json_type_name(schema)}; expected a JSON schema object "
                           "{\"type\": \"function\", \"function\": {\"name\": ..., \"parameters\": {...}}}")
        if schema.get("type", "function") != "function":
            raise RowError(MALFORMED_TOOLS, f"{at} has type {schema['type']!r}; only \"function\" tools are "
                           "supported")
        function = schema.get("function", schema)
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name.strip():
            raise RowError(MALFORMED_TOOLS, f"{at} has no 'name' (a non-empty string); a schema is {{\"type\": "
                           "\"function\", \"function\": {\"name\": ..., \"description\": ..., \"parameters\": {...}}}")
        if not isinstance(function.get("parameters", {}), dict):
            raise RowError(MALFORMED_TOOLS, f"{at} ({name!r}) 'parameters' must be a JSON schema object, got "
                           f"{json_type_name(function['parameters'])}")
        if name in names:
            raise RowError(MALFORMED_TOOLS, f"{at}: two tools are named {name!r}; the model calls tools by name")
        names.append(name)
        tools.append({"type": "function", "function": function} if "function" not in schema else schema)
    return tools or None


def conversation_start(roles: list[str], what: str) -> int:
    """The index of a conversation's first user turn (after an optional system turn at 0).

    Raises:
        RowError: a system turn elsewhere than turn 0, nothing but a system turn, or a first turn that is not user.
    """
    for t, role in enumerate(roles):
        if role == "system" and t != 0:
            raise RowError(ORDER, f"{ORDER}: system message at turn {t}; only turn 0 may be system")
    start = 1 if roles[0] == "system" else 0
    if start == len(roles):
        raise RowError(ORDER, f"{ORDER}: only a system message, no user/assistant turns")
    if roles[start] != "user":
        raise RowError(ORDER, f"{ORDER}: the {what} starts with {roles[start]} (turn {start}); expected user")
    return start


def check_tool_order(messages: list[dict], *, last: str = "assistant", what: str = "conversation",
                     check_empty: bool = True) -> None:
    """Turn order of a conversation with tool turns: optional system first, then a user turn; user and assistant
    alternate, except that an assistant turn with ``tool_calls`` is followed by exactly one ``tool`` turn per call
    and then by an assistant turn (its answer to the results); the conversation ends with ``last`` (an SFT
    conversation may end with an assistant turn's calls, with no results after them).

    Raises:
        RowError: roles out of order, a tool turn after no tool-calling assistant turn, more or fewer tool results
            than calls, a ``tool_call_id`` that names no call, an empty assistant turn without calls.
    """
    roles = [m["role"] for m in messages]
    start = conversation_start(roles, what)
    caller = None  # the assistant turn whose calls are being answered
    results = 0
    for t in range(start + 1, len(roles)):
        role = roles[t]
        if role == "tool":
            if caller is None:
                raise RowError(NO_CALL, f"{NO_CALL}: turn {t} is a tool result, but the turn before it ({t - 1}) is "
                               f"{_describe(messages[t - 1])}; a tool turn answers a call of the assistant turn just "
                               "before it (or follows another result of it): give that assistant turn its tool_calls, "
                               "or remove the tool turn")
            calls = messages[caller]["tool_calls"]
            if results == len(calls):
                raise RowError(RESULT_COUNT, f"more tool results than calls: assistant turn {caller} makes "
                               f"{len(calls)} call(s) but turn {t} is tool result {results + 1}; give one tool turn "
                               "per call")
            _check_call_id(messages[t], calls, caller, t)
            results += 1
            continue
        if caller is not None:
            _check_results(messages, caller, results, f"turn {t} is {role}")
            if role != "assistant":
                raise RowError(ORDER, f"{ORDER}: turn {t} is {role}, but the tool results before it (turns "
                               f"{caller + 1}-{t - 1}) must be answered by an assistant turn")
            caller = None
        elif role == roles[t - 1]:
            raise RowError(ORDER, f"{ORDER}: two {role} turns in a row (turns {t - 1} and {t})")
        if role == "assistant" and messages[t].get("tool_calls"):
            caller, results = t, 0
    if caller is not None and results:  # results follow the calls but the conversation ends with them
        _check_results(messages, caller, results, "the conversation ends")
    if roles[-1] != last:
        where = "" if what == "conversation" else f" of the {what}"
        raise RowError(ORDER, f"{ORDER}: the last turn ({len(roles) - 1}){where} is {roles[-1]}; expected {last}")
    for t, m in enumerate(messages if check_empty else []):
        if m["role"] == "assistant" and not m["content"].strip() and not m.get("tool_calls"):
            raise RowError("empty response", f"empty response: assistant turn {t} is empty (no text, no tool_calls)")


def _describe(message: dict) -> str:
    return "an assistant turn without tool_calls" if message["role"] == "assistant" else message["role"]


def _check_results(messages: list[dict], caller: int, results: int, then: str) -> None:
    calls = len(messages[caller]["tool_calls"])
    if results < calls:
        raise RowError(RESULT_COUNT, f"fewer tool results than calls: assistant turn {caller} makes {calls} call(s) "
                       f"but {results} tool turn(s) follow it ({then}); give one tool turn per call, in order")


def _check_call_id(message: dict, calls: list[dict], caller: int, t: int) -> None:
    wanted = message.get("tool_call_id")
    ids = [c["id"] for c in calls if "id" in c]
    if wanted is not None and ids and wanted not in ids:
        raise RowError(UNKNOWN_CALL_ID, f"turn {t} (tool) answers tool_call_id {wanted!r}, but the calls of assistant "
                       f"turn {caller} have the ids {', '.join(map(repr, ids))}; fix the id or the call")


def check_calls_known(messages: list[dict], tools: list[dict], col: str) -> None:
    """Every tool call names a tool of the row's ``tools`` (the model would learn to call tools it was not shown).

    Raises:
        RowError: (unknown tool) naming the turn, the call and the tools the row has.
    """
    names = [schema["function"]["name"] for schema in tools]
    for t, m in enumerate(messages):
        for call in m.get("tool_calls") or []:
            if call["function"]["name"] not in names:
                raise RowError(UNKNOWN_TOOL, f"{UNKNOWN_TOOL}: assistant turn {t} calls {call['function']['name']!r}, "
                               f"which is not in the row's '{col}' ({', '.join(map(repr, names))}); add its schema to "
                               f"'{col}' or fix the call's name")
