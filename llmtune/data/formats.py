"""Format adapters: raw rows -> canonical rows, with row validation.

Canonical rows (plain dicts, so they can be stored as JSON or Arrow):

* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` — optional system
  first, then user/assistant alternating, ending with assistant (alpaca, sharegpt, messages formats);
* text: ``{"text": str}``;
* prompt/completion: ``{"prompt": str, "completion": str}`` (raw strings, no chat template).

Later data kinds reuse the same sources and report: preference rows will be
``{"prompt": messages, "chosen": messages, "rejected": messages}`` and prompt-only rows
``{"prompt": messages}``.

Column names are mapped with ``DatasetConfig.columns`` (canonical field -> column in the file); the
canonical fields of each format are listed in ``FORMAT_FIELDS``. An adapter raises
:class:`~llmtune.data.errors.RowError` with a reason naming the field and the expectation.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable

from llmtune.config.schema import DatasetConfig
from llmtune.data.errors import DataError, RowError
from llmtune.data.sources import RawSource

FORMAT_FIELDS: dict[str, dict[str, str]] = {
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system"},
    "sharegpt": {"messages": "conversations", "role": "from", "content": "value", "system": "system"},
    "messages": {"messages": "messages", "role": "role", "content": "content", "system": "system"},
    "text": {"text": "text"},
    "prompt_completion": {"prompt": "prompt", "completion": "completion"},
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "output"),
    "sharegpt": ("messages",),
    "messages": ("messages",),
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
}
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant",
}
ORDER = "roles out of order"
_JSON_TYPE = {
    dict: "an object", list: "an array", int: "a number", float: "a number", bool: "a boolean", type(None): "null",
}


def _type_name(value: Any) -> str:
    return _JSON_TYPE.get(type(value), type(value).__name__)


def resolve_columns(fmt: str, ds: DatasetConfig, key: str, builtin: dict[str, str] | None = None) -> dict[str, str]:
    """Canonical field -> column name for ``fmt``: defaults, then a builtin's mapping, then the recipe's.

    Raises:
        DataError: ``ds.columns`` names a field that ``fmt`` does not have (with a hint if it looks reversed).
    """
    fields = FORMAT_FIELDS[fmt]
    unknown = [k for k in ds.columns if k not in fields]
    if unknown:
        reversed_hint = [k for k in unknown if ds.columns[k] in fields]
        hint = (
            f" The mapping goes canonical -> your column, e.g. {{{ds.columns[reversed_hint[0]]}: {reversed_hint[0]}}}."
            if reversed_hint
            else ""
        )
        raise DataError(
            f"{key}.columns: {', '.join(map(repr, unknown))} not a field of format {fmt!r}; its fields are "
            f"{', '.join(fields)}.{hint}"
        )
    return {**fields, **(builtin or {}), **ds.columns}


def detect_format(raw: RawSource, ds: DatasetConfig, key: str) -> str:
    """Pick the format from the first row's columns (after the recipe's column mapping).

    Raises:
        DataError: the first row is not an object, or matches no format.
    """
    first = next(iter(raw.rows), None)
    if first is None:
        raise DataError(f"{raw.path} has no rows (nothing to detect the format from).")
    if not isinstance(first, dict):
        raise DataError(
            f"{raw.path} row {raw.row_ids[0]} is {_type_name(first)}; expected an object with named fields."
        )
    for fmt in ("messages", "sharegpt", "alpaca", "prompt_completion", "text"):
        mapped = {k: v for k, v in ds.columns.items() if k in FORMAT_FIELDS[fmt]}
        cols = {**FORMAT_FIELDS[fmt], **raw.columns_map, **mapped}
        if not all(cols[f] in first for f in REQUIRED[fmt]):
            continue
        if fmt in ("messages", "sharegpt"):
            turns = first[cols["messages"]]
            turn = turns[0] if isinstance(turns, list) and turns and isinstance(turns[0], dict) else None
            if turn is not None and not (cols["role"] in turn and cols["content"] in turn):
                continue  # e.g. {from, value} turns are sharegpt, not messages
            if turn is None and fmt == "messages" and cols["messages"] == "conversations":
                continue
        return fmt
    cols = ", ".join(first) or "(none)"
    raise DataError(
        f"{key}: cannot detect the format of {raw.path} from its first row (columns: {cols}). Set {key}.format to "
        f"one of {', '.join(FORMAT_FIELDS)} and map your columns with {key}.columns, e.g. "
        "{instruction: question, output: answer} or {messages: conversations, role: from, content: value}."
    )


def _field(row: dict, col: str, *, required: bool = True) -> str | None:
    """The string in column ``col`` (None when absent/null and not required)."""
    value = row.get(col)
    if value is None:
        if required:
            raise RowError(f"missing field '{col}'")
        return None
    if not isinstance(value, str):
        raise RowError("non-string content", f"field '{col}' must be a string, got {_type_name(value)}")
    return value


def _check_order(messages: list[dict]) -> None:
    roles = [m["role"] for m in messages]
    for t, role in enumerate(roles):
        if role == "system" and t != 0:
            raise RowError(ORDER, f"{ORDER}: system message at turn {t}; only turn 0 may be system")
    start = 1 if roles[0] == "system" else 0
    if start == len(roles):
        raise RowError(ORDER, f"{ORDER}: only a system message, no user/assistant turns")
    if roles[start] != "user":
        raise RowError(ORDER, f"{ORDER}: the conversation starts with assistant (turn {start}); expected user")
    for t in range(start + 1, len(roles)):
        if roles[t] == roles[t - 1]:
            raise RowError(ORDER, f"{ORDER}: two {roles[t]} turns in a row (turns {t - 1} and {t})")
    if roles[-1] != "assistant":
        raise RowError(ORDER, f"{ORDER}: the last turn ({len(roles) - 1}) is {roles[-1]}; expected assistant")
    for t, m in enumerate(messages):
        if m["role"] == "assistant" and not m["content"].strip():
            raise RowError("empty response", f"empty response: assistant turn {t} is empty")


def _with_system(messages: list[dict], system: str | None) -> list[dict]:
    if system is not None and (not messages or messages[0]["role"] != "system"):
        return [{"role": "system", "content": system}, *messages]
    return messages


def _alpaca(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    instruction = _field(row, cols["instruction"])
    extra = _field(row, cols["input"], required=False)
    output = _field(row, cols["output"])
    system = _field(row, cols["system"], required=False)
    if not output.strip():
        raise RowError("empty response", f"empty response: field '{cols['output']}' is empty")
    user = f"{instruction}\n\n{extra}" if extra and instruction else (instruction or extra or "")
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
    return {"messages": _with_system(messages, system if system is not None else ds.system_prompt)}


def _chat(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    turns = row.get(cols["messages"])
    if turns is None:
        raise RowError(f"missing field '{cols['messages']}'")
    if not isinstance(turns, list):
        raise RowError(
            "malformed conversation", f"field '{cols['messages']}' must be a list of turns, got {_type_name(turns)}"
        )
    if not turns:
        raise RowError("empty conversation", f"field '{cols['messages']}' is an empty list")
    messages = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError("malformed conversation", f"turn {t} is {_type_name(turn)}; expected an object with "
                           f"'{cols['role']}' and '{cols['content']}'")
        role = turn.get(cols["role"])
        if role is None:
            raise RowError(f"missing field '{cols['role']}'", f"turn {t} lacks field '{cols['role']}'")
        canonical = ROLE_ALIASES.get(role) if isinstance(role, str) else None
        if canonical is None:
            raise RowError("unknown role", f"turn {t} has unknown role {role!r} in field '{cols['role']}'; expected "
                           "system, user (or human) or assistant (or gpt)")
        content = turn.get(cols["content"])
        if content is None:
            raise RowError(f"missing field '{cols['content']}'", f"turn {t} lacks field '{cols['content']}'")
        if not isinstance(content, str):
            raise RowError(
                "non-string content",
                f"turn {t} ({canonical}) field '{cols['content']}' must be a string, got {_type_name(content)}",
            )
        messages.append({"role": canonical, "content": content})
    messages = _with_system(messages, _field(row, cols["system"], required=False) or ds.system_prompt)
    _check_order(messages)
    return {"messages": messages}


def _text(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    text = _field(row, cols["text"])
    if not text.strip():
        raise RowError("empty text", f"field '{cols['text']}' is empty")
    return {"text": text}


def _prompt_completion(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    prompt = _field(row, cols["prompt"])
    completion = _field(row, cols["completion"])
    if not completion.strip():
        raise RowError("empty response", f"empty response: field '{cols['completion']}' is empty")
    return {"prompt": prompt, "completion": completion}


ADAPTERS: dict[str, Callable[[dict, dict[str, str], DatasetConfig], dict]] = {
    "alpaca": _alpaca,
    "sharegpt": _chat,
    "messages": _chat,
    "text": _text,
    "prompt_completion": _prompt_completion,
}


def row_kind(row: dict) -> str:
    """``chat``, ``text`` or ``prompt_completion`` for a canonical row."""
    if "messages" in row:
        return "chat"
    return "text" if "text" in row else "prompt_completion"


def to_canonical(raw: RawSource, ds: DatasetConfig) -> tuple[str, list[tuple[int, dict]], list[tuple[int, RowError]]]:
    """Convert and validate every row of a source.

    Args:
        raw: the rows as read.
        ds: the source's config section.

    Returns:
        ``(format, valid, bad)``: the format used, ``[(row_id, canonical_row)]`` and ``[(row_id, RowError)]``
        (the latter includes rows the reader could not parse), both in file order.

    Raises:
        DataError: undetectable format, invalid column mapping, ``system_prompt`` on a non-chat format,
            or no valid row at all (the message names the schema problem and the columns found).
    """
    key = f"data.datasets[{raw.index}]"
    fmt = ds.format if ds.format != "auto" else (raw.format or detect_format(raw, ds, key))
    cols = resolve_columns(fmt, ds, key, raw.columns_map if fmt == raw.format else None)
    if ds.system_prompt is not None and fmt in ("text", "prompt_completion"):
        raise DataError(f"{key}.system_prompt applies to chat formats (alpaca, sharegpt, messages), not {fmt!r}.")
    adapter = ADAPTERS[fmt]
    valid: list[tuple[int, dict]] = []
    bad: list[tuple[int, RowError]] = list(raw.bad)
    for row_id, row in zip(raw.row_ids, raw.rows):
        try:
            if not isinstance(row, dict):
                raise RowError("not an object", f"row is {_type_name(row)}; expected an object with named fields")
            valid.append((row_id, adapter(row, cols, ds)))
        except RowError as err:
            bad.append((row_id, err))
    bad.sort(key=lambda item: item[0])
    if not valid and bad:
        raise DataError(schema_message(raw, fmt, cols, bad, key))
    return fmt, valid, bad


def schema_message(raw: RawSource, fmt: str, cols: dict[str, str], bad: list[tuple[int, RowError]], key: str) -> str:
    """Message for a source with no valid row: name the common problem, the columns found and the fix."""
    kinds = Counter(err.kind for _, err in bad)
    found = ", ".join(raw.columns) or "(none)"
    mapping = ", ".join(f"{f}: {c}" for f, c in cols.items())
    kind, count = kinds.most_common(1)[0]
    example = next(f"row {r}: {e.reason}" for r, e in bad if e.kind == kind)
    if count == len(bad) and kind.startswith("missing field"):
        field = kind.removeprefix("missing field ")
        canon = next((f for f, c in cols.items() if repr(c) == field or f"'{c}'" == field), None)
        fix = f", e.g. {{{canon}: <your column>}}" if canon else ""
        return (
            f"all {len(bad)} rows of {raw.path} lack field {field} (format {fmt}) — columns found: {found}; "
            f"map them with {key}.columns{fix}, or set {key}.format. Current mapping: {mapping}."
        )
    counts = "; ".join(f"{k}: {n}" for k, n in kinds.most_common())
    return (
        f"no valid rows in {raw.path} (format {fmt}, {len(bad)} rows): {counts}. First: {example}. "
        f"Columns found: {found}; current mapping: {mapping}. Map columns with {key}.columns or set {key}.format."
    )
