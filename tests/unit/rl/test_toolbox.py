"""Tools and environments of multi-turn rollouts (issue 31): loading and schemas, one environment instance per
rollout, the tool-call parsers of each template family and transformers' response-template parser, and calling a
tool so that every failure is a result for the model and nothing the model writes is evaluated."""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
from transformers.utils import get_json_schema

from llmtune.rl.tool_calls import ToolCall, detect_parser, parse_tool_calls
from llmtune.rl.toolbox import (
    InfrastructureError,
    ToolSetupError,
    abandoned_tool_threads,
    check_reset_columns,
    load_environment,
    load_tools,
    make_toolbox,
    tool_schemas,
)

TOOLS_PY = '''
import asyncio
import threading
from typing import Literal
from llmtune.rl.toolbox import InfrastructureError

released = threading.Event()


def add(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def pack(key: str, flags: list[int] | None = None, mode: Literal["fast", "safe"] = "safe") -> dict:
    """Pack a key and flags into an object.

    Args:
        key: the key
        flags: optional flags
        mode: how
    """
    return {"key": key, "flags": flags}


def echo(text: str) -> str:
    """Return the text unchanged.

    Args:
        text: any text
    """
    return text


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: numerator
        b: denominator
    """
    return a / b


def hang(seconds: float) -> str:
    """Wait, then answer.

    Args:
        seconds: how long to wait
    """
    released.wait(seconds)
    return "late"


async def slow_add(a: int, b: int) -> int:
    """Add two integers, asynchronously.

    Args:
        a: the first number
        b: the second number
    """
    await asyncio.sleep(0.01)
    return a + b


cancelled = threading.Event()


async def stall(seconds: float) -> str:
    """Wait asynchronously, then answer.

    Args:
        seconds: how long to wait
    """
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        cancelled.set()
        raise
    return "late"


def sandbox() -> str:
    """Run in a sandbox that is down."""
    raise InfrastructureError("sandbox unreachable")


def exits() -> str:
    """Exit the process (from a tool)."""
    raise SystemExit(3)


def no_args_section(x: int) -> int:
    """Double x."""
    return 2 * x


def no_hint(x) -> int:
    """Double x.

    Args:
        x: a number
    """
    return 2 * x
'''

ENV_PY = '''
from llmtune.rl.toolbox import InfrastructureError


class Counter:
    """Counts; one instance per rollout."""

    instances = 0

    def __init__(self):
        Counter.instances += 1
        self.count = 0
        self.seen = None

    def reset(self, question: str, level: int = 1) -> str:
        self.seen = {"question": question, "level": level}
        return f"Count to {level}: {question}"

    def increment(self, by: int = 1) -> int:
        """Increase the counter.

        Args:
            by: how much to add
        """
        self.count += by
        return self.count

    @staticmethod
    def shout(text: str) -> str:
        """Upper-case a text.

        Args:
            text: the text
        """
        return text.upper()

    def reward(self, messages) -> float:
        return float(self.count)

    def _helper(self) -> int:
        return 0

    limit = 3


class TakesAll:
    def reset(self, **row):
        self.row = row

    def look(self) -> str:
        """Look around."""
        return "a room"


class NeedsAnswer:
    """reset takes every column, and needs one by name."""

    def reset(self, answer, **row):
        self.answer, self.row = answer, row

    def look(self) -> str:
        """Look around."""
        return "a room"


class AsyncRoom:
    async def reset(self, question: str) -> str:
        self.doors = 1
        return f"You are in a room. {question}"

    async def look(self) -> str:
        """Look around."""
        return f"a room with {self.doors} door"


class PositionalReset:
    def reset(self, answer, /, **row):
        self.answer = answer

    def look(self) -> str:
        """Look around."""
        return "a room"


class NeedsArgs:
    def __init__(self, url):
        self.url = url

    def look(self) -> str:
        """Look around."""
        return "a room"


class NoTools:
    def reset(self, **row):
        return None


class BrokenReset:
    def reset(self, **row):
        raise RuntimeError("disk full")

    def look(self) -> str:
        """Look around."""
        return "a room"


class BadMethod:
    def look(self, where) -> str:
        """Look around.

        Args:
            where: the place
        """
        return where
'''


@pytest.fixture
def recipe_dir(tmp_path, monkeypatch):
    """A recipe directory with tools.py and envs.py (sys.path restored afterwards)."""
    (tmp_path / "tools.py").write_text(TOOLS_PY)
    (tmp_path / "envs.py").write_text(ENV_PY)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path.parent)
    yield tmp_path
    sys.modules.pop("envs", None)  # imported as a module by name: the next test's envs.py is another file


@pytest.fixture
def tools(recipe_dir):
    names = ["add", "pack", "echo", "divide", "hang", "slow_add", "stall", "sandbox", "exits"]
    fns = load_tools([f"tools.py:{n}" for n in names], recipe_dir)
    yield {fn.__name__: fn for fn in fns}
    fns[0].__globals__["released"].set()  # let an abandoned `hang` thread finish


# ------------------------------------------------------------------------------------------------ loading, schemas


def test_tool_schemas_are_transformers_json_schemas(recipe_dir):
    fns = load_tools(["tools.py:add", "envs:Counter.shout"], recipe_dir)  # a file, and a module with an attr path
    assert [fn.__name__ for fn in fns] == ["add", "shout"]
    assert tool_schemas(fns) == [get_json_schema(fn) for fn in fns]
    assert tool_schemas(fns)[0] == {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {
            "a": {"type": "integer", "description": "the first number"},
            "b": {"type": "number", "description": "the second number"}}, "required": ["a"]},
        "return": {"type": "number"}}}


def test_tools_without_a_schema_are_refused_all_at_once_with_the_fix(recipe_dir):
    with pytest.raises(ToolSetupError) as info:
        load_tools(["tools.py:add", "tools.py:no_args_section", "tools.py:no_hint", "tools.py:ad", "tools"],
                   recipe_dir, key="agent.tools")
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert problems[0].startswith("agent.tools.1: 'tools.py:no_args_section': no JSON schema:")
    assert "no description for the argument 'x'" in problems[0] and "'Args:' section" in problems[0]
    assert problems[1].startswith("agent.tools.2: 'tools.py:no_hint': no JSON schema:")
    assert "missing a type hint" in problems[1] and "give every parameter a type hint" in problems[1]
    assert problems[2].startswith("agent.tools.3: 'tools.py:ad':") and "did you mean add?" in problems[2]
    assert problems[3].startswith("agent.tools.4: 'tools' is not 'module:name'")
    assert info.value.exit_code == 1


def test_a_missing_module_a_duplicate_name_and_a_method_are_refused(recipe_dir):
    with pytest.raises(ToolSetupError) as info:
        load_tools(["no_such_tools_module:f", "tools.py:add", "tools.py:add", "envs.py:Counter.increment"], recipe_dir)
    first, second, third = info.value.problems
    assert first.startswith("agent.tools.0: 'no_such_tools_module:f': cannot import module 'no_such_tools_module'")
    assert "agent.tools.2" in second and "a second tool named 'add' (agent.tools.1 is one)" in second
    assert third.startswith("agent.tools.3: 'envs.py:Counter.increment' is a method (its first parameter is self)")


def test_environment_public_methods_are_its_tools(recipe_dir):
    cls = load_environment("envs.py:Counter", recipe_dir)
    schemas = tool_schemas([], cls)
    assert [s["function"]["name"] for s in schemas] == ["increment", "shout"]  # not reset, reward, _helper, limit
    assert schemas == [get_json_schema(cls.increment), get_json_schema(cls.shout)]
    toolbox, _ = make_toolbox([], cls, {"question": "q"})
    assert toolbox.schemas == schemas and sorted(toolbox.tools) == ["increment", "shout"]


@pytest.mark.parametrize(("name", "expected"), [
    ("NeedsArgs", "NeedsArgs(url) needs arguments; llmtune creates one instance per rollout with NeedsArgs()"),
    ("NoTools", "has no tools: its public methods"),
    ("BadMethod", "method look: no JSON schema: Argument where is missing a type hint"),
])
def test_unusable_environments_are_refused(recipe_dir, name, expected):
    with pytest.raises(ToolSetupError, match="agent.environment: 'envs.py:") as info:
        load_environment(f"envs.py:{name}", recipe_dir)
    assert expected in str(info.value)


def test_a_function_is_not_an_environment(recipe_dir):
    with pytest.raises(ToolSetupError, match="is function, not a class"):
        load_environment("tools.py:add", recipe_dir)


def test_one_fresh_environment_per_toolbox_and_reset_gets_the_row(recipe_dir):
    cls = load_environment("envs.py:Counter", recipe_dir)
    before = cls.instances
    row = {"question": "how many?", "level": 2, "answer": "2"}  # `answer` is not a reset parameter
    first, first_text = make_toolbox([], cls, row)
    second, second_text = make_toolbox([], cls, {"question": "again"})
    assert cls.instances == before + 2 and first.environment is not second.environment
    assert first.environment.seen == {"question": "how many?", "level": 2}
    assert (first_text, second_text) == ("Count to 2: how many?", "Count to 1: again")
    for _ in range(3):
        first.call(ToolCall("increment", {"by": 2}, ""), timeout_s=5)
    assert first.call(ToolCall("increment", {}, ""), timeout_s=5).content == "7"
    assert second.call(ToolCall("increment", {}, ""), timeout_s=5).content == "1"  # no state from the first rollout


def test_reset_with_kwargs_gets_every_column_and_may_return_none(recipe_dir):
    cls = load_environment("envs.py:TakesAll", recipe_dir)
    toolbox, text = make_toolbox([], cls, {"a": 1, "b": [2]})
    assert text is None and toolbox.environment.row == {"a": 1, "b": [2]}


def test_reset_needing_a_missing_column_is_a_setup_error(recipe_dir):
    cls = load_environment("envs.py:Counter", recipe_dir)
    check_reset_columns(cls, ["question", "answer"])
    with pytest.raises(ToolSetupError, match=r"agent.environment: Counter.reset needs question, which the prompt rows "
                       r"do not have; reset receives the columns prompt\. Give that parameter a default, or add a "
                       r"column of that name to every row of the data"):
        check_reset_columns(cls, ["prompt"])
    with pytest.raises(ToolSetupError, match=r"receives the columns prompt, answer\. .* \(only some rows have "
                                             r"question\)$"):
        check_reset_columns(cls, ["prompt", "answer"], some_rows=["answer", "question"])


def test_reset_with_kwargs_still_needs_its_named_parameters(recipe_dir):
    """reset(self, answer, **row): **kwargs does not make `answer` optional; without the column every rollout would
    fail in reset (as an infrastructure failure), so the recipe check refuses it, naming what reset receives."""
    cls = load_environment("envs.py:NeedsAnswer", recipe_dir)
    columns = ["prompt", "messages", "reference", "index"]
    with pytest.raises(ToolSetupError, match=r"NeedsAnswer.reset needs answer, which the prompt rows do not have; "
                                             r"reset receives the columns prompt, messages, reference, index\."):
        check_reset_columns(cls, columns)
    with pytest.raises(ToolSetupError, match="NeedsAnswer.reset needs answer"):  # a recipe error, not a rollout's
        make_toolbox([], cls, dict.fromkeys(columns))
    check_reset_columns(cls, [*columns, "answer"])
    toolbox, _ = make_toolbox([], cls, {"prompt": "p", "answer": 5})
    assert toolbox.environment.answer == 5 and toolbox.environment.row == {"prompt": "p"}
    with pytest.raises(ToolSetupError, match=r"PositionalReset.reset takes answer positionally only"):
        check_reset_columns(load_environment("envs.py:PositionalReset", recipe_dir), [*columns, "answer"])


def test_a_failing_reset_is_an_infrastructure_error_with_its_cause(recipe_dir):
    cls = load_environment("envs.py:BrokenReset", recipe_dir)
    with pytest.raises(InfrastructureError, match="BrokenReset failed in reset: RuntimeError: disk full") as info:
        make_toolbox([], cls, {})
    assert isinstance(info.value.__cause__, RuntimeError)


def test_a_tool_name_in_both_functions_and_environment_is_refused(recipe_dir):
    fns = load_tools(["envs.py:Counter.shout"], recipe_dir)
    with pytest.raises(ToolSetupError, match="'shout' are both a function tool and a method of Counter"):
        tool_schemas(fns, load_environment("envs.py:Counter", recipe_dir))


# ---------------------------------------------------------------------------------------------------------- parsers

ADD = {"name": "add", "arguments": {"a": 1, "b": 2}}
ECHO = {"name": "echo", "arguments": {"text": "hi"}}


def _hermes(obj) -> str:
    return f"<tool_call>\n{json.dumps(obj)}\n</tool_call>"


def _llama(obj) -> str:
    return json.dumps({"name": obj["name"], "parameters": obj["arguments"]})


def _mistral(*objs) -> str:
    return "[TOOL_CALLS]" + json.dumps(list(objs))


def _calls(calls):
    return [(c.name, c.arguments, c.error) for c in calls]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), [
    ("hermes", "Let me add.\n" + _hermes(ADD), "Let me add.", [("add", ADD["arguments"], None)]),
    ("hermes", _hermes(ADD) + "\n" + _hermes(ECHO) + "\nThen echo.", "Then echo.",
     [("add", ADD["arguments"], None), ("echo", ECHO["arguments"], None)]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}</tool_call>', "", [(None, None, "not valid JSON")]),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', "", [(None, None, 'no "name" string')]),
    ("hermes", '<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "",
     [("add", None, '"arguments" must be a JSON object, got array')]),
    ("hermes", 'The answer is {"x": 1}. No call.', 'The answer is {"x": 1}. No call.', []),
    ("hermes", '<tool_call>{"name": "now"}', "", [("now", {}, None)]),  # unclosed at the end; no arguments: {}
    ("llama3", _llama(ADD), "", [("add", ADD["arguments"], None)]),
    ("llama3", "<|python_tag|>" + _llama(ADD) + "; " + _llama(ECHO) + "\n", "",
     [("add", ADD["arguments"], None), ("echo", ECHO["arguments"], None)]),
    ("llama3", _llama(ADD) + "\nDone.", "Done.", [("add", ADD["arguments"], None)]),
    ("llama3", '{"name": "add", "parameters": {"a": 1,}}', "", [(None, None, "not valid JSON")]),
    ("llama3", '{"parameters": {"a": 1}}', "", [(None, None, 'no "name" string')]),
    ("llama3", '{"name": "add", "parameters": "a=1"}', "", [("add", None, '"parameters" must be a JSON object')]),
    ("llama3", "The answer is 4.", "The answer is 4.", []),
    ("mistral", "Adding. " + _mistral(ADD), "Adding.", [("add", ADD["arguments"], None)]),
    ("mistral", _mistral(ADD, ECHO), "", [("add", ADD["arguments"], None), ("echo", ECHO["arguments"], None)]),
    ("mistral", '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}[TOOL_CALLS]echo[ARGS]{"text": "hi"}', "",
     [("add", ADD["arguments"], None), ("echo", ECHO["arguments"], None)]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}', "", [(None, None, "not valid JSON")]),
    ("mistral", '[TOOL_CALLS][{"arguments": {}}, 5]', "",
     [(None, None, 'no "name" string'), (None, None, "expected a JSON object")]),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": 7}]', "", [("add", None, "must be a JSON object")]),
    ("mistral", "No tools needed: 4.", "No tools needed: 4.", []),
])
def test_family_parsers(parser, text, content, calls):
    got_content, got = parse_tool_calls(text, parser)
    assert got_content == content
    assert [(n, a) for n, a, _ in _calls(got)] == [(n, a) for n, a, _ in calls]
    for (_, _, error), call in zip(calls, got):
        assert (call.error is None) if error is None else (error in call.error), call.error


def test_raw_text_and_ids_are_kept():
    _, (call,) = parse_tool_calls("x " + _hermes(ADD) + " y", "hermes")
    assert call.raw == _hermes(ADD)
    _, (call,) = parse_tool_calls('[TOOL_CALLS]add[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}', "mistral")
    assert (call.name, call.id, call.arguments) == ("add", "a1b2c3d4e", {"a": 1})
    assert call.as_message() == {"id": "a1b2c3d4e", "type": "function",
                                 "function": {"name": "add", "arguments": {"a": 1}}}


def test_an_unknown_parser_is_a_callers_error():
    with pytest.raises(ValueError, match="unknown tool-call parser 'json'"):
        parse_tool_calls("hi", "json")


LLAMA31_SNIPPET = ("{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{{- '{\"name\": \"' + "
                   "tool_call.name + '\", ' }}{{- '\"parameters\": ' }}{{- tool_call.arguments | tojson }}")


@pytest.mark.parametrize(("template", "expected"), [
    ("{%- if tools %}<tools>{{ tool | tojson }}</tools>{% endif %}<tool_call>\\n", "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' + tool_calls | tojson }}", "mistral"),
    (LLAMA31_SNIPPET, "llama3"),
    ("{{- '<|python_tag|>' + tool_call.name + '.call(' }}", "llama3"),
    ("{% for m in messages %}<|im_start|>{{ m.role }}\\n{{ m.content }}<|im_end|>{% endfor %}", None),
    ({"default": "plain", "tool_use": "x <tool_call> y"}, "hermes"),
    (None, None),
])
def test_detect_parser(template, expected):
    class Tok:
        chat_template = template

    assert detect_parser(Tok()) == expected
    if isinstance(template, str):
        assert detect_parser(template) == expected


# transformers 5.24's own response template for Qwen2 models (transformers/cli/serving/utils.py
# _RESPONSE_TEMPLATE_FALLBACKS), the shape a tokenizer_config.json "response_template" has
QWEN_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close": "</think>", "content": "text"},
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>|<\|eot_id\|>)", "content": "text"},
    },
}


@pytest.fixture
def qwen_tokenizer():
    """A real transformers tokenizer (its vocabulary does not matter to parsing) with the Qwen response template."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.response_template = QWEN_RESPONSE_TEMPLATE
    return tok


def test_a_response_template_goes_through_transformers_parser(qwen_tokenizer, monkeypatch):
    used = []
    real = type(qwen_tokenizer).get_response_parser
    monkeypatch.setattr(type(qwen_tokenizer), "get_response_parser",
                        lambda self, *a, **k: used.append(k) or real(self, *a, **k))
    seven = _hermes({"name": "add", "arguments": {"a": "7"}})
    text = "<think>add them</think>\nFirst.\n" + _hermes(ADD) + "\n" + seven + "\nThen done."
    schema = tool_schemas([_add_stub])
    content, calls = parse_tool_calls(text, None, qwen_tokenizer, tools=schema)
    assert used and used[0]["tools"] == schema
    assert content == "First.\nThen done."  # text before AND after the calls; reasoning is a separate field
    # transformers casts "7" to 7 for an integer parameter: the family parser would not
    assert _calls(calls) == [("add", {"a": 1, "b": 2}, None), ("add", {"a": 7}, None)]


def test_response_template_malformed_calls(qwen_tokenizer):
    text = _hermes(ADD) + '\n<tool_call>{"name": "add", "arguments": {</tool_call>'
    # transformers raises on the bad block; the family parser then says which call it was
    content, calls = parse_tool_calls(text, "hermes", qwen_tokenizer)
    assert [c.name for c in calls] == ["add", None] and calls[0].error is None and "not valid JSON" in calls[1].error
    content, calls = parse_tool_calls(text, None, qwen_tokenizer)  # no family: the whole turn is one malformed call
    assert content == "" and len(calls) == 1 and calls[0].raw == text
    assert calls[0].error.startswith("could not parse the turn: ValueError: json parser could not parse region")
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', None, qwen_tokenizer)
    assert _calls(calls) == [("add", None, '"arguments" must be a JSON object, got array')]


def test_a_template_of_its_own_markup_is_used_without_a_family(qwen_tokenizer):
    qwen_tokenizer.response_template = {
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {"tool_calls": {"open": "<call>", "close": "</call>", "repeats": True, "content": "json"},
                   "content": {"content": "text"}}}
    content, calls = parse_tool_calls('Sure. <call>{"name": "echo", "arguments": {"text": "hi"}}</call>', None,
                                      qwen_tokenizer)
    assert content == "Sure." and _calls(calls) == [("echo", {"text": "hi"}, None)]


def _add_stub(a: int, b: float = 1.0) -> float:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


_add_stub.__name__ = "add"


# ------------------------------------------------------------------------------------------------------------- call


def test_good_calls_return_text(tools):
    box, _ = make_toolbox(list(tools.values()), None, {})
    res = box.call(ToolCall("add", {"a": 2, "b": 0.5}, ""), timeout_s=5)
    assert (res.content, res.error, res.infrastructure, res.name) == ("2.5", None, False, "add")
    assert 0 <= res.seconds < 5
    assert box.call(ToolCall("add", {"a": 3.0, "b": 4}, ""), timeout_s=5).content == "7"  # 3.0 passed as int 3
    assert box.call(ToolCall("pack", {"key": "k", "flags": [1, 2]}, ""), 5).content == '{"key": "k", "flags": [1, 2]}'
    assert box.call(ToolCall("echo", {"text": "naïve"}, ""), timeout_s=5).content == "naïve"
    assert box.call(ToolCall("pack", {"key": "k", "flags": None}, ""), 5).as_message() == {
        "role": "tool", "name": "pack", "content": '{"key": "k", "flags": null}'}


def test_unknown_tool_names_the_available_ones(tools):
    box, _ = make_toolbox([tools["add"], tools["echo"]], None, {})
    res = box.call(ToolCall("calculator", {}, ""), timeout_s=5)
    assert (res.error, res.content) == ("unknown_tool", "Error: unknown tool 'calculator'; available tools: add, echo")


@pytest.mark.parametrize(("arguments", "problems"), [
    ({}, "missing required argument 'a'"),
    ({"a": 1, "c": 2}, "unknown argument 'c'"),
    ({"a": "7"}, "'a' must be integer, got string \"7\""),
    ({"a": True}, "'a' must be integer, got boolean true"),
    ({"a": 1.5}, "'a' must be integer, got number 1.5"),
    ({"b": "x", "z": 0}, "unknown argument 'z'; missing required argument 'a'; 'b' must be number, got string \"x\""),
])
def test_bad_arguments_say_what_to_fix(tools, arguments, problems):
    box, _ = make_toolbox([tools["add"]], None, {})
    res = box.call(ToolCall("add", arguments, ""), timeout_s=5)
    assert res.error == "bad_arguments" and not res.infrastructure
    assert res.content == f"Error: bad arguments for add: {problems}. Call it as add(a: integer, b?: number)"


def test_nested_types_are_checked(tools):
    box, _ = make_toolbox([tools["pack"]], None, {})
    res = box.call(ToolCall("pack", {"key": "k", "flags": [1, "2"]}, ""), timeout_s=5)
    signature = 'pack(key: string, flags?: array of integer or null, mode?: string in ["fast", "safe"])'
    problem = "'flags'[1] must be integer, got string \"2\""
    assert res.content == f"Error: bad arguments for pack: {problem}. Call it as {signature}"
    res = box.call(ToolCall("pack", {"key": "k", "mode": "slow"}, ""), timeout_s=5)
    problem = "'mode' must be string in [\"fast\", \"safe\"], got string \"slow\""
    assert res.content == f"Error: bad arguments for pack: {problem}. Call it as {signature}"
    assert box.call(ToolCall("pack", {"key": "k", "flags": [1.0]}, ""), 5).content == '{"key": "k", "flags": [1]}'


def test_a_malformed_call_is_an_error_result(tools):
    box, _ = make_toolbox([tools["add"]], None, {})
    _, (call,) = parse_tool_calls("<tool_call>{oops}</tool_call>", "hermes")
    res = box.call(call, timeout_s=5)
    assert res.error == "malformed" and res.content.startswith("Error: malformed tool call: not valid JSON")


def test_a_raising_tool_is_an_error_result(tools):
    box, _ = make_toolbox(list(tools.values()), None, {})
    res = box.call(ToolCall("divide", {"a": 1, "b": 0}, ""), timeout_s=5)
    assert (res.error, res.infrastructure) == ("raised", False)
    assert res.content == "Error: divide raised ZeroDivisionError: division by zero"
    res = box.call(ToolCall("exits", {}, ""), timeout_s=5)  # SystemExit in a tool ends neither the run nor silently
    assert (res.error, res.content) == ("raised", "Error: exits raised SystemExit: 3")


def test_a_tool_past_its_timeout_is_abandoned(tools):
    box, _ = make_toolbox(list(tools.values()), None, {})
    start = time.monotonic()
    res = box.call(ToolCall("hang", {"seconds": 30}, ""), timeout_s=0.2)
    assert time.monotonic() - start < 2
    assert (res.error, res.content) == ("timeout", "Error: hang did not return within 0.2 s")
    assert 0.2 <= res.seconds < 2 and box.abandoned == 1 and abandoned_tool_threads() >= 1
    thread = next(t for t in threading.enumerate() if t.name == "llmtune-tool-hang")
    assert thread.daemon  # never blocks the interpreter's exit
    assert tools["hang"].__globals__ is tools["add"].__globals__  # one module per file: tools share its globals
    tools["hang"].__globals__["released"].set()
    thread.join(5)
    assert not thread.is_alive()
    assert box.call(ToolCall("add", {"a": 1}, ""), timeout_s=5).content == "2.0"  # the toolbox still works
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        box.call(ToolCall("add", {"a": 1}, ""), timeout_s=0)


def test_an_async_tool_is_awaited_and_cancelled_at_its_timeout(tools):
    """An async def tool runs on its own event loop in its worker thread: its result goes back (not the text of a
    coroutine object); past the timeout it is cancelled, so its thread ends and nothing is abandoned."""
    box, _ = make_toolbox(list(tools.values()), None, {})
    res = box.call(ToolCall("slow_add", {"a": 2, "b": 3}, ""), timeout_s=5)
    assert (res.content, res.error) == ("5", None)
    assert box.call(ToolCall("slow_add", {"a": 2}, ""), timeout_s=5).error == "bad_arguments"  # same schema checks
    before = abandoned_tool_threads()
    start = time.monotonic()
    res = box.call(ToolCall("stall", {"seconds": 30}, ""), timeout_s=0.2)
    assert time.monotonic() - start < 2
    assert (res.error, res.content) == ("timeout", "Error: stall did not return within 0.2 s")
    assert tools["stall"].__globals__["cancelled"].wait(2)  # the coroutine was cancelled, not left running
    assert box.abandoned == 0 and abandoned_tool_threads() == before
    assert not any(t.name == "llmtune-tool-stall" and t.is_alive() for t in threading.enumerate())


def test_async_environment_reset_and_methods_are_awaited(recipe_dir):
    cls = load_environment("envs.py:AsyncRoom", recipe_dir)
    toolbox, text = make_toolbox([], cls, {"question": "where?"})
    assert text == "You are in a room. where?"
    assert toolbox.call(ToolCall("look", {}, ""), timeout_s=5).content == "a room with 1 door"


def test_an_infrastructure_error_marks_the_result(tools):
    box, _ = make_toolbox(list(tools.values()), None, {})
    res = box.call(ToolCall("sandbox", {}, ""), timeout_s=5)
    assert (res.error, res.infrastructure) == ("raised", True)
    assert "InfrastructureError: sandbox unreachable" in res.content


def test_nothing_in_the_models_text_is_evaluated(tools, tmp_path):
    marker = tmp_path / "PWNED"
    payload = f"__import__('os').system('touch {marker}')"
    box, _ = make_toolbox(list(tools.values()), None, {})
    text = "<tool_call>" + json.dumps({"name": "echo", "arguments": {"text": payload}}) + "</tool_call>"
    _, (call,) = parse_tool_calls(text, "hermes")
    assert box.call(call, timeout_s=5).content == payload  # passed as the plain string it is
    res = box.call(ToolCall("add", {"a": payload}, ""), timeout_s=5)
    assert res.error == "bad_arguments"  # an expression for an integer is not computed
    _, calls = parse_tool_calls(f'<tool_call>{{"name": "add", "arguments": {{"a": {payload}}}}}</tool_call>', "hermes")
    assert calls[0].error.startswith("not valid JSON")
    _, calls = parse_tool_calls(f"<|python_tag|>{payload}", "llama3")
    assert calls[0].error.startswith("expected JSON")
    assert not marker.exists()


def test_environment_tools_are_called_on_their_instance(recipe_dir):
    cls = load_environment("envs.py:Counter", recipe_dir)
    box, _ = make_toolbox([], cls, {"question": "q"})
    assert box.call(ToolCall("shout", {"text": "hi"}, ""), timeout_s=5).content == "HI"
    assert box.call(ToolCall("reset", {}, ""), timeout_s=5).error == "unknown_tool"  # reset is no tool
    assert box.call(ToolCall("_helper", {}, ""), timeout_s=5).error == "unknown_tool"
    assert box.environment.reward([]) == 0.0


async def stubborn(seconds: float) -> str:
    """Ignore every cancellation until the time is up.

    Args:
        seconds: how long
    """
    import asyncio

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            pass
    return "late"


async def quits() -> str:
    """Exit the process (from an async tool)."""
    raise SystemExit(4)


def test_acall_awaits_async_tools_on_the_running_loop_with_the_same_results(tools):
    """Toolbox.acall (the agent loop's way, many rollouts at once): an async def tool runs on the caller's event loop
    (no thread of its own), with call's checks, results, timeout (cancelled; one that ignores its cancellation is
    left running and counted) and SystemExit as a result; a plain tool runs in the given pool."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    box, _ = make_toolbox([*tools.values(), stubborn, quits], None, {})
    pool = ThreadPoolExecutor(1, thread_name_prefix="test-pool")
    threads_before = {t.name for t in threading.enumerate()}

    async def main():
        got = {"add": await box.acall(ToolCall("slow_add", {"a": 2, "b": 3}, ""), 5),
               "bad": await box.acall(ToolCall("slow_add", {"a": 2}, ""), 5),
               "stall": await box.acall(ToolCall("stall", {"seconds": 30}, ""), 0.2),
               "quits": await box.acall(ToolCall("quits", {}, ""), 5),
               "plain": await box.acall(ToolCall("add", {"a": 1}, ""), 5, pool)}
        before = abandoned_tool_threads()
        got["stubborn"] = await box.acall(ToolCall("stubborn", {"seconds": 1.8}, ""), 0.2)
        got["abandoned"] = abandoned_tool_threads() - before
        return got

    got = asyncio.run(main())
    assert (got["add"].content, got["add"].error) == ("5", None) and got["bad"].error == "bad_arguments"
    assert (got["stall"].error, got["stall"].content) == ("timeout", "Error: stall did not return within 0.2 s")
    assert tools["stall"].__globals__["cancelled"].is_set()
    assert (got["quits"].error, got["quits"].content) == ("raised", "Error: quits raised SystemExit: 4")
    assert (got["plain"].content, got["plain"].error) == ("2.0", None)
    assert got["stubborn"].error == "timeout" and got["abandoned"] == 1 and box.abandoned == 1
    assert not any(name.startswith("llmtune-tool-s") for name in {t.name for t in threading.enumerate()}
                   - threads_before)  # the async tools had no thread
    pool.shutdown()


def test_amake_toolbox_awaits_an_async_reset_on_the_loop_its_methods_run_on(recipe_dir):
    """The agent loop's set-up: an async reset and the async tool methods after it run on one event loop (an
    instance may keep loop-bound resources); a failing constructor is an InfrastructureError, as in make_toolbox."""
    import asyncio

    from llmtune.rl.toolbox import amake_toolbox

    cls = load_environment("envs.py:AsyncRoom", recipe_dir)
    loops = []
    real = cls.reset

    async def reset(self, question: str) -> str:
        loops.append(asyncio.get_running_loop())
        return await real(self, question)

    cls.reset = reset

    async def main():
        toolbox, text = await amake_toolbox([], cls, {"question": "where?"})
        return text, (await toolbox.acall(ToolCall("look", {}, ""), 5)).content, asyncio.get_running_loop()

    text, seen, loop = asyncio.run(main())
    assert (text, seen) == ("You are in a room. where?", "a room with 1 door") and loops == [loop]

    class Down:
        def __init__(self):
            raise OSError("no sandbox")

        def look(self) -> str:
            """Look around."""
            return ""

    with pytest.raises(InfrastructureError, match="environment Down failed in construction: OSError: no sandbox"):
        asyncio.run(amake_toolbox([], Down, {}))
