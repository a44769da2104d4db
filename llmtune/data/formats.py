"""Format adapters: raw rows -> canonical rows, with row validation.

Canonical rows (plain dicts, so they can be stored as JSON or Arrow):

* chat: ``{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`` — optional system
  first, then user/assistant alternating, ending with assistant (alpaca, sharegpt, messages formats); messages and
  sharegpt rows may be tool conversations (assistant ``tool_calls``, ``tool`` turns, ``"tools": [JSON schemas]``
  beside ``messages``; :mod:`llmtune.data.toolchat`);
* text: ``{"text": str}``;
* prompt/completion: ``{"prompt": str, "completion": str}`` (raw strings, no chat template).

* preference: ``{"prompt": str | messages, "chosen": str, "rejected": str}``: the prompt (a raw string, or
  messages ending with a user turn) shared by both completions; ``chosen``/``rejected`` are the final
  assistant texts (formats preference, preference_messages, hh; see :func:`to_canonical` with
  ``kind="preference"``). An empty completion is kept (with a chat template it still renders the
  end-of-turn token: "say nothing" is a legitimate preferred answer in HH-RLHF).

* unpaired (``kind="unpaired"``, KTO): ``{"prompt": str | messages, "completion": str, "label": bool}`` (format
  ``unpaired``); the preference formats are read as pairs there and split into a desirable and an undesirable
  row by :mod:`llmtune.data.unpaired`.

* prompt-only (``kind="prompt"``, PPO): ``{"prompt": messages, "reference": str | None}``: the conversation to
  generate from (optional system, user/assistant alternating, ending with a non-empty user turn) and what the
  data says the answer is (the dropped final assistant turn, alpaca ``output``, ``completion``, the chosen
  response of a pair, or the ``reference`` column of format ``prompt``), None when there is none. Every format
  except ``text`` gives prompts (see :data:`PROMPT_ADAPTERS`); a bare ``{prompt}`` column is format ``prompt``
  (a string = one user turn, or a list of messages).

Column names are mapped with ``DatasetConfig.columns`` (canonical field -> column in the file); the
canonical fields of each format are listed in ``FORMAT_FIELDS``. An adapter raises
:class:`~llmtune.data.errors.RowError` with a reason naming the field and the expectation.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any, Callable

from llmtune.config.schema import DatasetConfig
from llmtune.data.errors import DataError, RowError
from llmtune.data.sources import RawSource
from llmtune.data.toolchat import (CALL_ROLE, ORDER, TOOL_ROLES, calls_from_text, check_calls_known, check_tool_order,
                                   conversation_start, is_tool_conversation, json_type_name, parse_tool_calls,
                                   parse_tools, tool_turn)

FORMAT_FIELDS: dict[str, dict[str, str]] = {
    "alpaca": {"instruction": "instruction", "input": "input", "output": "output", "system": "system"},
    "sharegpt": {"messages": "conversations", "role": "from", "content": "value", "system": "system", "tools": "tools"},
    "messages": {"messages": "messages", "role": "role", "content": "content", "system": "system", "tools": "tools"},
    "text": {"text": "text"},
    "prompt_completion": {"prompt": "prompt", "completion": "completion"},
    "preference": {"prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "system": "system"},
    "preference_messages": {
        "prompt": "prompt", "chosen": "chosen", "rejected": "rejected", "role": "role", "content": "content",
        "system": "system",
    },
    "hh": {"chosen": "chosen", "rejected": "rejected"},
    "prompt": {"prompt": "prompt", "reference": "reference", "role": "role", "content": "content", "system": "system"},
    "unpaired": {
        "prompt": "prompt", "messages": "messages", "completion": "completion", "label": "label", "role": "role",
        "content": "content", "system": "system",
    },
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "alpaca": ("instruction", "output"),
    "sharegpt": ("messages",),
    "messages": ("messages",),
    "text": ("text",),
    "prompt_completion": ("prompt", "completion"),
    "preference": ("prompt", "chosen", "rejected"),
    "preference_messages": ("chosen", "rejected"),
    "hh": ("chosen", "rejected"),
    "prompt": ("prompt",),
    "unpaired": ("completion", "label"),
}
KIND_FORMATS: dict[str, tuple[str, ...]] = {
    "sft": ("alpaca", "sharegpt", "messages", "text", "prompt_completion"),
    "preference": ("preference", "preference_messages", "hh"),
    "prompt": (
        "messages", "sharegpt", "alpaca", "prompt_completion", "prompt", "preference", "preference_messages", "hh",
    ),
    # KTO: unpaired rows, or pairs (each becomes a desirable and an undesirable row)
    "unpaired": ("unpaired", "preference", "preference_messages", "hh"),
}
KIND_NAMES = {"sft": "SFT rows", "preference": "preference pairs", "prompt": "prompts",
              "unpaired": "unpaired rows {prompt | messages, completion, label} or preference pairs"}
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant", "bard": "assistant",
    "model": "assistant",
}
PROMPT_MISMATCH = "prompt mismatch"
SAME_PAIR = "chosen equals rejected"
HH_ASSISTANT = "\n\nAssistant:"
_HH_TURN = re.compile(r"\n\n(Human|Assistant):")
HH_ROLES = {"Human": "user", "Assistant": "assistant"}
_type_name = json_type_name


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


TURN_FIELDS = ("role", "content")  # mapped to keys inside each turn of a message list, not to row columns


def row_columns(raw: RawSource) -> set[str]:
    """The columns of any dict row of ``raw``."""
    present: set[str] = set()
    for row in raw.rows:
        if isinstance(row, dict):
            present.update(row)
    return present


def check_column_mapping(raw: RawSource, ds: DatasetConfig, key: str, present: set[str] | None = None) -> None:
    """Every column that ``ds.columns`` names must exist: in some row of the file for row fields, in the turns of
    the first conversation for ``role``/``content``.

    Args:
        raw: the source's rows (its first dict row gives the turn keys).
        present: the columns of every row of the source, when ``raw`` holds only its first rows (default: the
            columns of ``raw``'s rows).

    Raises:
        DataError: naming the file, the mapping key, the missing column and the columns that exist.
    """
    import difflib

    if not ds.columns:
        return
    present = row_columns(raw) if present is None else present
    if not present:
        return
    turn_keys: set[str] = set()
    for value in next((r for r in raw.rows if isinstance(r, dict)), {}).values():
        if isinstance(value, list) and value and all(isinstance(t, dict) for t in value):
            turn_keys.update(k for t in value for k in t)
    canonical = {f for fields in FORMAT_FIELDS.values() for f in fields}
    for field_name, column in ds.columns.items():
        if field_name not in canonical:  # not a field of any format: resolve_columns explains (reversed mapping...)
            continue
        have = turn_keys if field_name in TURN_FIELDS else present
        if not have or column in have:
            continue
        close = difflib.get_close_matches(column, sorted(have), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        where = "the turns of its conversations have the keys" if field_name in TURN_FIELDS else "its columns are"
        raise DataError(
            f"{key}.columns.{field_name}: column {column!r} is not in {raw.path} ({where}: "
            f"{', '.join(sorted(have))}){hint or '.'} Fix the mapping (canonical field -> your column)."
        )


def detect_format(raw: RawSource, ds: DatasetConfig, key: str, kind: str = "sft") -> str:
    """Pick the format of ``kind`` (``sft`` or ``preference``) from the first row's columns (after the
    recipe's column mapping).

    Raises:
        DataError: the first row is not an object, or matches no format of ``kind``.
    """
    from llmtune.config.validate import column_key_problems

    wrong = column_key_problems(ds.columns, key)  # a misspelled field would end in "cannot detect" below
    if wrong:
        raise DataError("; ".join(f"{path}: {msg}" for path, msg in wrong))
    first = next(iter(raw.rows), None)
    if first is None:
        raise DataError(f"{raw.path} has no rows (nothing to detect the format from).")
    if not isinstance(first, dict):
        raise DataError(
            f"{raw.path} row {raw.row_ids[0]} is {_type_name(first)}; expected an object with named fields."
        )
    if kind in ("preference", "unpaired"):
        if kind == "unpaired" and {**FORMAT_FIELDS["unpaired"], **ds.columns}["label"] in first:
            return "unpaired"
        return _detect_preference(first, raw, ds, key, kind)
    if kind == "prompt":
        return _detect_prompt(first, raw, ds, key)
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
        f"one of {', '.join(KIND_FORMATS['sft'])} and map your columns with {key}.columns, e.g. "
        "{instruction: question, output: answer} or {messages: conversations, role: from, content: value}."
        + (" (chosen/rejected pairs are preference data, for llmtune rm / dpo.)" if "chosen" in first else "")
    )


def _detect_preference(first: dict, raw: RawSource, ds: DatasetConfig, key: str, kind: str = "preference") -> str:
    fields = FORMAT_FIELDS["preference_messages"]
    cols = {**fields, **{k: v for k, v in ds.columns.items() if k in fields}}
    chosen, rejected = first.get(cols["chosen"]), first.get(cols["rejected"])
    if isinstance(chosen, list) and isinstance(rejected, list):
        return "preference_messages"
    if isinstance(chosen, str) and isinstance(rejected, str):
        if HH_ASSISTANT in chosen and chosen.lstrip().startswith("Human:"):
            return "hh"
        if cols["prompt"] in first:
            return "preference"
    found = ", ".join(first) or "(none)"
    raise DataError(
        f"{key}: cannot detect a preference format in {raw.path} from its first row (columns: {found}). Preference "
        "data is {prompt, chosen, rejected} strings (format preference), {chosen, rejected} message lists with an "
        "optional prompt (preference_messages), or HH-RLHF transcripts {chosen, rejected} "
        f"('\\n\\nHuman: ... \\n\\nAssistant: ...', hh). Set {key}.format and map your columns with {key}.columns, "
        "e.g. {prompt: question, chosen: response_j, rejected: response_k}."
        + (" KTO also reads unpaired rows {prompt | messages, completion, label: true|false} (format unpaired)."
           if kind == "unpaired" else "")
    )


def _detect_prompt(first: dict, raw: RawSource, ds: DatasetConfig, key: str) -> str:
    """Prompt-only data: a preference format when the row has chosen/rejected, else an SFT format, else
    ``prompt`` (a bare prompt column) or ``alpaca`` (an instruction without output)."""
    cols = {**FORMAT_FIELDS["preference_messages"], **FORMAT_FIELDS["prompt"], **raw.columns_map, **ds.columns}
    if cols["chosen"] in first and cols["rejected"] in first:
        return _detect_preference(first, raw, ds, key)
    try:
        return detect_format(raw, ds, key, "sft")
    except DataError:
        if cols["prompt"] in first:
            return "prompt"
        if {**FORMAT_FIELDS["alpaca"], **ds.columns}["instruction"] in first:
            return "alpaca"
        raise DataError(
            f"{key}: cannot detect a prompt format in {raw.path} from its first row (columns: "
            f"{', '.join(first) or '(none)'}). Prompts are {{prompt}} (a string or a message list), messages / "
            "sharegpt conversations (a final assistant turn is dropped), alpaca {instruction, input}, "
            f"prompt_completion or preference data. Set {key}.format and map your columns with {key}.columns, "
            "e.g. {prompt: question, reference: answer}."
        ) from None


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


def _check_order(messages: list[dict], *, last: str = "assistant", what: str = "conversation",
                 check_empty: bool = True) -> None:
    """Check turn order: optional system first, then user/assistant alternating, ending with ``last``.

    ``what`` names the checked part in messages ("conversation", "prompt"); ``check_empty`` rejects empty
    assistant turns (they would be trained on). Conversations with tool turns are checked by
    :func:`~llmtune.data.toolchat.check_tool_order`.
    """
    if is_tool_conversation(messages):
        check_tool_order(messages, last=last, what=what, check_empty=check_empty)
        return
    roles = [m["role"] for m in messages]
    start = conversation_start(roles, what)
    for t in range(start + 1, len(roles)):
        if roles[t] == roles[t - 1]:
            raise RowError(ORDER, f"{ORDER}: two {roles[t]} turns in a row (turns {t - 1} and {t})")
    if roles[-1] != last:
        where = "" if what == "conversation" else f" of the {what}"
        raise RowError(ORDER, f"{ORDER}: the last turn ({len(roles) - 1}){where} is {roles[-1]}; expected {last}")
    for t, m in enumerate(messages if check_empty else []):
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
    messages = [{"role": "user", "content": _alpaca_user(instruction, extra)}, {"role": "assistant", "content": output}]
    return {"messages": _with_system(messages, system if system is not None else ds.system_prompt)}


def _alpaca_user(instruction: str, extra: str | None) -> str:
    return f"{instruction}\n\n{extra}" if extra and instruction else (instruction or extra or "")


def _parse_turns(turns: Any, cols: dict[str, str], field: str, where: str = "", tools: bool = False) -> list[dict]:
    """Canonical ``{role, content}`` messages from the list of turns in column ``field``.

    ``where`` prefixes turn-level reasons (e.g. ``"'chosen' "`` -> "'chosen' turn 1 lacks field 'content'").
    With ``tools`` (SFT conversations and prompts), assistant turns may carry ``tool_calls`` and ``tool`` turns are
    read (:mod:`llmtune.data.toolchat`); elsewhere (preference pairs, KTO) they are a bad row.
    """
    if turns is None:
        raise RowError(f"missing field '{field}'")
    if not isinstance(turns, list):
        raise RowError("malformed conversation", f"field '{field}' must be a list of turns, got {_type_name(turns)}")
    if not turns:
        raise RowError("empty conversation", f"field '{field}' is an empty list")
    messages = []
    for t, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError("malformed conversation", f"{where}turn {t} is {_type_name(turn)}; expected an object "
                           f"with '{cols['role']}' and '{cols['content']}'")
        role = turn.get(cols["role"])
        if role is None:
            raise RowError(f"missing field '{cols['role']}'", f"{where}turn {t} lacks field '{cols['role']}'")
        tool_role = isinstance(role, str) and (role in TOOL_ROLES or role == CALL_ROLE or bool(turn.get("tool_calls")))
        if tool_role and not tools:
            raise RowError("tool turn", f"{where}turn {t} is a tool call or result (role {role!r}); tool "
                           "conversations are read from formats messages and sharegpt (SFT rows, prompts), not "
                           "here; remove the tool turns from this data")
        canonical = (ROLE_ALIASES.get(role) or (TOOL_ROLES.get(role) if tools else None)
                     if isinstance(role, str) else None)
        if role == CALL_ROLE and tools:
            at = f"{where}turn {t} ({role})"
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": calls_from_text(turn.get(cols["content"]), at)})
            continue
        if canonical is None:
            known = ("system, user (or human), assistant (or gpt), tool (or observation) or function_call" if tools
                     else "system, user (or human) or assistant (or gpt)")
            raise RowError("unknown role", f"{where}turn {t} has unknown role {role!r} in field '{cols['role']}'; "
                           f"expected {known}")
        content = turn.get(cols["content"])
        if canonical == "tool":
            messages.append(tool_turn(turn, content, t, where, cols["content"]))
            continue
        calls = parse_tool_calls(turn.get("tool_calls"), f"{where}turn {t} ({canonical})") if tools else []
        if calls and canonical != "assistant":
            raise RowError("malformed tool_calls", f"{where}turn {t} is {canonical} but has 'tool_calls'; only "
                           "assistant turns call tools")
        if calls and content is None:  # OpenAI writes content: null beside tool calls
            content = ""
        if content is None:
            raise RowError(f"missing field '{cols['content']}'", f"{where}turn {t} lacks field '{cols['content']}'")
        if not isinstance(content, str):
            raise RowError(
                "non-string content",
                f"{where}turn {t} ({canonical}) field '{cols['content']}' must be a string, got {_type_name(content)}",
            )
        messages.append({"role": canonical, "content": content, **({"tool_calls": calls} if calls else {})})
    return messages


def _chat(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    """A conversation, with tool calls, tool results and a ``tools`` column of JSON schemas where the row has them
    (:mod:`llmtune.data.toolchat`): ``{"messages": [...], "tools"?: [...]}``."""
    messages = _parse_turns(row.get(cols["messages"]), cols, cols["messages"], tools=True)
    messages = _with_system(messages, _field(row, cols["system"], required=False) or ds.system_prompt)
    _check_order(messages)
    tools = parse_tools(row.get(cols["tools"]), cols["tools"])
    if tools:
        check_calls_known(messages, tools, cols["tools"])
        return {"messages": messages, "tools": tools}
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


def _same_pair() -> RowError:
    return RowError(SAME_PAIR, f"{SAME_PAIR}: the two completions are identical, so the pair prefers nothing")


def _preference(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    prompt = _field(row, cols["prompt"])
    chosen, rejected = _field(row, cols["chosen"]), _field(row, cols["rejected"])
    if chosen == rejected:
        raise _same_pair()
    system = _field(row, cols["system"], required=False) or ds.system_prompt
    if system is not None:  # a system message needs the chat template: the prompt becomes messages
        prompt = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _preference_messages(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    """``chosen``/``rejected`` message lists: the prompt is everything before the final assistant turn and
    must be the same in both. An explicit ``prompt`` (messages or a string = one user turn) is put in front
    of lists that do not already start with it (TRL's explicit-prompt layout)."""
    prefix = _prompt_prefix(row, cols)
    prompts, completions = [], []
    for side in (cols["chosen"], cols["rejected"]):
        turns = _parse_turns(row.get(side), cols, side, f"'{side}' ")
        full = turns if turns[: len(prefix)] == prefix else prefix + turns
        if full[-1]["role"] != "assistant":
            raise RowError(ORDER, f"{ORDER}: the last turn of '{side}' is {full[-1]['role']}; expected the "
                           "assistant completion")
        prompts.append(full[:-1])
        completions.append(full[-1]["content"])
    if prompts[0] != prompts[1]:
        t = _first_difference(*prompts)
        raise RowError(
            PROMPT_MISMATCH,
            f"chosen and rejected do not share a prompt: the turns before their final assistant turn differ from "
            f"turn {t} on ({len(prompts[0])} prompt turns in '{cols['chosen']}', {len(prompts[1])} in "
            f"'{cols['rejected']}')",
        )
    prompt = _with_system(prompts[0], _field(row, cols["system"], required=False) or ds.system_prompt)
    if not prompt:
        raise RowError("empty prompt", f"no prompt: '{cols['chosen']}' has only the final assistant turn and "
                       f"there is no '{cols['prompt']}' column")
    _check_order(prompt, last="user", what="prompt", check_empty=False)
    if completions[0] == completions[1]:
        raise _same_pair()
    return {"prompt": prompt, "chosen": completions[0], "rejected": completions[1]}


def _prompt_prefix(row: dict, cols: dict[str, str]) -> list[dict]:
    """The explicit ``prompt`` column as messages: none -> ``[]``, a string -> one user turn, else its turns."""
    given = row.get(cols["prompt"])
    if given is None:
        return []
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    return _parse_turns(given, cols, cols["prompt"], f"'{cols['prompt']}' ")


def _hh_split(text: str, col: str) -> tuple[str, str]:
    """``(prompt transcript, completion)``: the text before the last ``"\\n\\nAssistant:"`` and the answer after it."""
    k = text.rfind(HH_ASSISTANT)
    if k < 0:
        raise RowError("malformed transcript", f"field '{col}' has no '\\n\\nAssistant:' turn")
    return text[:k], text[k + len(HH_ASSISTANT):].strip()


def _hh_messages(transcript: str) -> list[dict]:
    """Human -> user, Assistant -> assistant; consecutive turns of one speaker are joined with a blank line."""
    parts = _HH_TURN.split("\n\n" + transcript.lstrip())
    if parts[0].strip():
        raise RowError("malformed transcript", "the transcript does not start with '\\n\\nHuman:'")
    messages: list[dict] = []
    for speaker, content in zip(parts[1::2], parts[2::2]):
        role, content = HH_ROLES[speaker], content.strip()
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n\n" + content
        else:
            messages.append({"role": role, "content": content})
    return messages


def _hh(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    """HH-RLHF transcripts: the prompt is everything before the last ``"\\n\\nAssistant:"``, identical in both."""
    prompt_c, chosen = _hh_split(_field(row, cols["chosen"]), cols["chosen"])
    prompt_r, rejected = _hh_split(_field(row, cols["rejected"]), cols["rejected"])
    if prompt_c != prompt_r:
        i = _first_difference(prompt_c, prompt_r)
        raise RowError(
            PROMPT_MISMATCH,
            f"chosen and rejected do not share a prompt: the transcripts before their last '\\n\\nAssistant:' differ "
            f"from char {i} on (chosen: {prompt_c[max(0, i - 20):i + 40]!r}, rejected: "
            f"{prompt_r[max(0, i - 20):i + 40]!r})",
        )
    prompt = _with_system(_hh_messages(prompt_c), ds.system_prompt)
    if not any(m["role"] == "user" for m in prompt):
        raise RowError("empty prompt", "no '\\n\\nHuman:' turn before the last '\\n\\nAssistant:'")
    _check_order(prompt, last="user", what="prompt", check_empty=False)
    if chosen == rejected:
        raise _same_pair()
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _unpaired(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    """KTO rows: a prompt (``prompt``: a string or messages; or ``messages``: the prompt turns, optionally ending
    with the assistant completion), a ``completion`` (a string or one assistant message) and a boolean ``label``
    (true = desirable). Nothing is coerced: a label 1/"yes" is a bad row."""
    label_col, prompt_col, messages_col = cols["label"], cols["prompt"], cols["messages"]
    label = row.get(label_col)
    if label is None:
        raise RowError(f"missing field '{label_col}'", f"missing field '{label_col}': expected true (desirable) or "
                       f"false (undesirable); add it, or map your column with columns: {{label: <column>}}")
    if type(label).__name__ not in ("bool", "bool_"):  # Python or NumPy booleans only
        raise RowError("label not a boolean", f"field '{label_col}' must be true (desirable) or false (undesirable), "
                       f"got {'a string' if isinstance(label, str) else _type_name(label)} {label!r}; write a JSON boolean (numbers and strings are not "
                       "converted)")
    if row.get(prompt_col) is not None and row.get(messages_col) is not None:
        raise RowError("prompt and messages", f"the row has both '{prompt_col}' and '{messages_col}'; give the "
                       f"prompt once: '{prompt_col}' (a string or message list) or '{messages_col}' (the prompt turns)")
    if row.get(prompt_col) is None and row.get(messages_col) is None:
        raise RowError(f"missing field '{prompt_col}'", f"missing field '{prompt_col}' (or '{messages_col}'): "
                       "expected the prompt as a string or a list of {role, content} messages")
    if row.get(prompt_col) is not None:
        turns = _prompt_prefix(row, cols)
    else:
        turns = _parse_turns(row[messages_col], cols, messages_col, f"'{messages_col}' ")
    completion = row.get(cols["completion"])
    if completion is None and row.get(messages_col) is not None and turns[-1]["role"] == "assistant":
        completion = turns.pop()["content"]  # messages = the whole conversation, completion = its last turn
    elif completion is None:
        raise RowError(f"missing field '{cols['completion']}'", f"missing field '{cols['completion']}': expected the "
                       "completion as a string or [{role: assistant, content: ...}]")
    elif isinstance(completion, list):
        parsed = _parse_turns(completion, cols, cols["completion"], f"'{cols['completion']}' ")
        if len(parsed) != 1 or parsed[0]["role"] != "assistant":
            raise RowError("malformed completion", f"field '{cols['completion']}' must hold exactly one assistant "
                           f"message, got {len(parsed)} turn(s) ({', '.join(m['role'] for m in parsed)})")
        completion = parsed[0]["content"]
    elif not isinstance(completion, str):
        raise RowError("non-string content", f"field '{cols['completion']}' must be a string or one assistant "
                       f"message, got {_type_name(completion)}")
    system = _field(row, cols["system"], required=False) or ds.system_prompt
    if isinstance(row.get(prompt_col), str) and system is None:
        return {"prompt": row[prompt_col], "completion": completion, "label": bool(label)}
    prompt = _with_system(turns, system)
    if not prompt:
        raise RowError("empty prompt", f"no prompt: '{messages_col}' has only the completion turn")
    _check_order(prompt, last="user", what="prompt", check_empty=False)
    return {"prompt": prompt, "completion": completion, "label": bool(label)}


ADAPTERS: dict[str, Callable[[dict, dict[str, str], DatasetConfig], dict]] = {
    "alpaca": _alpaca,
    "sharegpt": _chat,
    "messages": _chat,
    "text": _text,
    "prompt_completion": _prompt_completion,
    "preference": _preference,
    "preference_messages": _preference_messages,
    "hh": _hh,
    "unpaired": _unpaired,
}


def _prompt_row(messages: list[dict], reference: str | None, where: str) -> dict:
    """A canonical prompt-only row; ``where`` names the last user turn's field for the empty-prompt reason."""
    if not messages:
        raise RowError("empty prompt", "empty prompt: the conversation has no turn before its final assistant turn")
    _check_order(messages, last="user", what="prompt", check_empty=False)
    if not messages[-1]["content"].strip():
        raise RowError("empty prompt", f"empty prompt: {where} is empty")
    return {"prompt": messages, "reference": reference}


def _prompt_chat(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    """The conversation without its final assistant turn, which is the reference. A tool conversation's prompt ends
    with its last user turn; what follows (calls, results, the answer) is the policy's to produce, and the text of
    its final assistant turn is the reference."""
    messages = _parse_turns(row.get(cols["messages"]), cols, cols["messages"], tools=True)
    messages = _with_system(messages, _field(row, cols["system"], required=False) or ds.system_prompt)
    if is_tool_conversation(messages):
        last = messages[-1]
        _check_order(messages, last="user" if last["role"] == "user" else "assistant", check_empty=False)
        reference = last["content"] if last["role"] == "assistant" and not last.get("tool_calls") else None
        user = max(t for t, m in enumerate(messages) if m["role"] == "user")
        messages = messages[: user + 1]
    else:
        reference = messages.pop()["content"] if messages[-1]["role"] == "assistant" else None
    return _prompt_row(messages, reference, f"the last user turn (turn {len(messages) - 1}) of '{cols['messages']}'")


def _prompt_alpaca(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    user = _alpaca_user(_field(row, cols["instruction"]), _field(row, cols["input"], required=False))
    system = _field(row, cols["system"], required=False)
    messages = _with_system([{"role": "user", "content": user}], system if system is not None else ds.system_prompt)
    where = f"field '{cols['instruction']}' (with '{cols['input']}')"
    return _prompt_row(messages, _field(row, cols["output"], required=False), where)


def _prompt_completion_prompt(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    messages = _with_system([{"role": "user", "content": _field(row, cols["prompt"])}], ds.system_prompt)
    return _prompt_row(messages, _field(row, cols["completion"], required=False), f"field '{cols['prompt']}'")


def _prompt_only(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    """Format ``prompt``: a string (one user turn) or a message list ending with a user turn, optional reference."""
    if row.get(cols["prompt"]) is None:
        raise RowError(f"missing field '{cols['prompt']}'")
    messages = _with_system(_prompt_prefix(row, cols), _field(row, cols["system"], required=False) or ds.system_prompt)
    single = isinstance(row[cols["prompt"]], str)
    where = f"field '{cols['prompt']}'" if single else f"the last turn of '{cols['prompt']}'"
    return _prompt_row(messages, _field(row, cols["reference"], required=False), where)


def _prompt_preference(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    """Prompt of a ``preference`` pair; the reference is the chosen response (rejected is not read)."""
    system = _field(row, cols["system"], required=False) or ds.system_prompt
    messages = _with_system([{"role": "user", "content": _field(row, cols["prompt"])}], system)
    return _prompt_row(messages, _field(row, cols["chosen"]), f"field '{cols['prompt']}'")


def _prompt_preference_messages(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    """The turns of ``chosen`` (after an explicit prompt) before its final assistant turn, which is the reference."""
    prefix = _prompt_prefix(row, cols)
    turns = _parse_turns(row.get(cols["chosen"]), cols, cols["chosen"], f"'{cols['chosen']}' ")
    full = turns if turns[: len(prefix)] == prefix else prefix + turns
    if full[-1]["role"] != "assistant":
        raise RowError(ORDER, f"{ORDER}: the last turn of '{cols['chosen']}' is {full[-1]['role']}; expected the "
                       "assistant completion")
    messages = _with_system(full[:-1], _field(row, cols["system"], required=False) or ds.system_prompt)
    return _prompt_row(messages, full[-1]["content"], f"the last user turn before the completion in '{cols['chosen']}'")


def _prompt_hh(row: dict, cols: dict[str, str], ds: DatasetConfig) -> dict:
    """The ``chosen`` transcript before its last ``"\\n\\nAssistant:"``; the reference is the chosen answer."""
    transcript, chosen = _hh_split(_field(row, cols["chosen"]), cols["chosen"])
    messages = _with_system(_hh_messages(transcript), ds.system_prompt)
    if not any(m["role"] == "user" for m in messages):
        raise RowError("empty prompt", "no '\\n\\nHuman:' turn before the last '\\n\\nAssistant:'")
    if messages[-1]["role"] == "assistant":  # 2 of HH harmless-base's 1,800: "  Human:" inline in an answer
        raise RowError(ORDER, f"{ORDER}: the '{cols['chosen']}' transcript before its last '\\n\\nAssistant:' ends "
                       "with an Assistant turn, not a Human one (an inline 'Human:' without a blank line before it?)")
    return _prompt_row(messages, chosen, f"the last Human turn of '{cols['chosen']}'")


PROMPT_ADAPTERS: dict[str, Callable[[dict, dict[str, str], DatasetConfig], dict]] = {
    "alpaca": _prompt_alpaca,
    "sharegpt": _prompt_chat,
    "messages": _prompt_chat,
    "prompt_completion": _prompt_completion_prompt,
    "prompt": _prompt_only,
    "preference": _prompt_preference,
    "preference_messages": _prompt_preference_messages,
    "hh": _prompt_hh,
}


def row_kind(row: dict) -> str:
    """``chat``, ``text``, ``prompt_completion``, ``preference`` or ``prompt`` (prompt-only) for a canonical row."""
    if "messages" in row:
        return "chat"
    if "reference" in row:
        return "prompt"
    if "label" in row:
        return "unpaired"
    if "chosen" in row:
        return "preference"
    return "text" if "text" in row else "prompt_completion"


def source_format(raw: RawSource, ds: DatasetConfig, kind: str = "sft") -> tuple[str, dict[str, str], Callable]:
    """The format of a source, its column mapping and its row adapter, from its first rows (``raw``: at least its
    first row, as :func:`detect_format` needs).

    Raises:
        DataError: undetectable format, a format of another kind, invalid column mapping, ``system_prompt`` on a
            non-chat format.
    """
    key = f"data.datasets[{raw.index}]"
    fmt = ds.format if ds.format != "auto" else (raw.format or detect_format(raw, ds, key, kind))
    if fmt not in KIND_FORMATS[kind]:
        other = next(k for k, formats in KIND_FORMATS.items() if fmt in formats)
        where = f"{key}.format: {fmt!r}" if ds.format != "auto" else f"{key}: {raw.path} (format {fmt!r})"
        if kind == "prompt" and fmt == "text":
            raise DataError(
                f"{where} is plain text, which has no prompt part to generate from. Prompts come from {{prompt}} "
                "rows, messages/sharegpt conversations, alpaca, prompt_completion or preference data; point "
                f"{key}.path at such data (or set {key}.format and {key}.columns)."
            )
        raise DataError(
            f"{where} is {KIND_NAMES[other]}, but this stage needs {KIND_NAMES[kind]}: one of the formats "
            f"{', '.join(KIND_FORMATS[kind])}. Point {key}.path at such data (or set {key}.format)."
        )
    cols = resolve_columns(fmt, ds, key, raw.columns_map if fmt == raw.format else None)
    if ds.system_prompt is not None and fmt in ("text", "prompt_completion") and kind != "prompt":
        raise DataError(f"{key}.system_prompt applies to chat formats (alpaca, sharegpt, messages), not {fmt!r}.")
    return fmt, cols, PROMPT_ADAPTERS[fmt] if kind == "prompt" else ADAPTERS[fmt]


def convert_rows(raw: RawSource, ds: DatasetConfig, cols: dict[str, str], adapter: Callable
                 ) -> tuple[list[tuple[int, dict]], list[tuple[int, RowError]]]:
    """Convert and validate the rows of ``raw`` (a whole source or a batch of one).

    Returns:
        ``(valid, bad)``: ``[(row_id, canonical_row)]`` and ``[(row_id, RowError)]`` (with the rows the reader
        could not parse), both in file order.
    """
    valid: list[tuple[int, dict]] = []
    bad: list[tuple[int, RowError]] = list(raw.bad)
    for row_id, row in zip(raw.row_ids, raw.rows):
        try:
            if not isinstance(row, dict):
                raise RowError("not an object", f"row is {_type_name(row)}; expected an object with named fields")
            valid.append((row_id, adapter(row, cols, ds)))
        except RowError as err:
            bad.append((row_id, err.detached()))
    bad.sort(key=lambda item: item[0])
    return valid, bad


def to_canonical(
    raw: RawSource, ds: DatasetConfig, kind: str = "sft"
) -> tuple[str, list[tuple[int, dict]], list[tuple[int, RowError]]]:
    """Convert and validate every row of a source held in memory (:func:`source_format`, then
    :func:`convert_rows`; the pipeline does the same batch by batch).

    Args:
        raw: the rows as read.
        ds: the source's config section.
        kind: ``sft`` (formats alpaca, sharegpt, messages, text, prompt_completion), ``preference``
            (preference, preference_messages, hh) or ``prompt`` (every format but text, plus ``prompt``; rows
            ``{"prompt": messages, "reference": str | None}``).

    Returns:
        ``(format, valid, bad)``: the format used, ``[(row_id, canonical_row)]`` and ``[(row_id, RowError)]``
        (the latter includes rows the reader could not parse), both in file order.

    Raises:
        DataError: undetectable format, a format of another kind, invalid column mapping, ``system_prompt`` on
            a non-chat format, or no valid row at all (the message names the schema problem and the columns found).
    """
    key = f"data.datasets[{raw.index}]"
    check_column_mapping(raw, ds, key)
    fmt, cols, adapter = source_format(raw, ds, kind)
    valid, bad = convert_rows(raw, ds, cols, adapter)
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
