"""Tools and environments of multi-turn rollouts: loading them from a recipe and calling them so that nothing the
model writes can crash the run or be executed as code (reading the calls of a sampled turn: :mod:`llmtune.rl.tool_calls`).

What a user writes:

- **a tool**: a plain function (``def`` or ``async def``), named ``module:function`` or ``file.py:function``, with a
  type hint on every parameter and a Google-style docstring whose ``Args:`` section describes every parameter. Its JSON
  schema (what ``tokenizer.apply_chat_template(tools=...)`` shows the model) is
  :func:`transformers.utils.get_json_schema` of it. Plain functions are shared by every rollout (and may be called
  from several threads).
- **an environment**: a class ``module:Class`` that can be constructed without arguments. Each rollout gets a fresh
  instance; its optional ``reset(self, **row)`` receives the prompt row's columns (those it names, or all of them
  with ``**kwargs``: the dataset row's own columns and ``prompt``, ``messages``, ``reference``, ``index``) and may
  return the text of the first user turn; its public methods are the rollout's tools (same schema rule; ``reset``,
  ``reward`` and names starting with ``_`` are not tools); an optional ``reward(self, messages) -> float | None``
  scores the conversation. ``reset``, ``reward`` and the methods may be ``async def``.
- :class:`InfrastructureError` (or a subclass), raised by a tool, ``reset`` or the constructor when a failure is not
  the model's fault (a crashed sandbox, a server down): the rollout then abstains instead of being scored.

One rollout (the agent loop lives elsewhere)::

    toolbox, first_user_text = make_toolbox(functions, environment_cls, row)      # InfrastructureError: abstain
    prompt = apply_chat_template(messages, tools=toolbox.schemas, ...)
    content, calls = parse_tool_calls(turn_text, parser, tokenizer)                # never raises on model text
    results = [toolbox.call(c, timeout_s) for c in calls]                          # never raises on model text

Safety: tool arguments are JSON values decoded with :mod:`json` (never ``eval``) and passed as keyword arguments
after a check against the tool's schema; a tool runs in a worker thread bounded by ``timeout_s`` (an ``async def``
tool on its own event loop in that thread, cancelled at the timeout). A Python thread cannot be killed: a tool that
never returns keeps its (daemon) thread until the process ends, which :func:`abandoned_tool_threads` counts.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import inspect
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from llmtune.errors import LlmtuneError
from llmtune.rl.tool_calls import ToolCall, _cut, _exception_text, _signature, check_arguments  # noqa: F401
from llmtune.utils import AwaitTimeout, awaited

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "over_limit")
NOT_TOOLS = frozenset({"reset", "reward"})  # environment methods that are never tools (besides names starting with _)

_TYPES_FIX = ("give every parameter a type hint (str, int, float, bool, list[...], dict[str, ...], Literal[...], an "
              "Enum, or X | None)")
_DOC_FIX = ("give it a Google-style docstring: a one-line description, then an 'Args:' section with one line "
            "'name: what it is' per parameter")


class ToolSetupError(LlmtuneError):
    """A tool or environment named by the recipe cannot be loaded or has no usable schema (exit code 1).

    ``problems`` lists every problem found (one line each: the recipe key, the spec, what is wrong, the fix); the
    message is those lines joined, so that a recipe check can merge them into its all-at-once report.
    """

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class InfrastructureError(Exception):
    """Raise it (or a subclass) in a tool, an environment's ``reset`` or its constructor when the failure is not the
    model's fault (a crashed sandbox, an unreachable server). llmtune then abstains on the rollout: it is excluded
    from its group's statistics and counted, instead of being scored as a failure of the model."""


@dataclass
class ToolOutput:
    """What a tool (or an environment's tool method) may return instead of a plain value, to give the turn that
    called it a reward: a per-step reward of the environment (GRPO adds a rollout's per-turn rewards to its
    reward; PPO places each turn's reward at that turn's last sampled token: :mod:`llmtune.rewards.shaping`).

    Attributes:
        content: what goes back to the model (as a plain return value would: a str as it is, a dict/list as JSON).
        reward: this call's reward (a finite number), or None for none.
    """

    content: Any
    reward: float | None = None


@dataclass
class ToolResult:
    """What one :meth:`Toolbox.call` gives back.

    Attributes:
        name: the tool called (None for a malformed call without a name).
        content: the text that goes back to the model as the tool message's content.
        error: None (the tool returned), or one of :data:`ERROR_KINDS`.
        infrastructure: True when the tool raised :class:`InfrastructureError` (error is then ``"raised"``): the
            rollout abstains.
        seconds: wall-clock seconds the call took (including a timeout's wait).
        call_id: the call's id (:attr:`ToolCall.id`), for formats that pair results with calls.
        reward: the reward the tool returned with its result (:class:`ToolOutput`), or None.
    """

    name: str | None
    content: str
    error: str | None
    infrastructure: bool
    seconds: float
    call_id: str | None = None
    reward: float | None = None

    def as_message(self) -> dict:
        """The result as a ``{"role": "tool", ...}`` message (transformers' chat format)."""
        message = {"role": "tool", "name": self.name, "content": self.content}
        return message if self.call_id is None else {**message, "tool_call_id": self.call_id}


# ---------------------------------------------------------------------------------------------------------- loading


def load_tools(specs: Iterable[str], recipe_dir: Any = None, key: str = "agent.tools") -> list[Callable]:
    """Import the tool functions named by a recipe and check that each has a JSON schema.

    Args:
        specs: ``"package.module:function"`` or ``"path/to/file.py:function"`` each (an attribute path such as
            ``module:obj.function`` works too).
        recipe_dir: the directory of the recipe (str or Path; None: a recipe without a file). A relative module or
            file is looked for in the working directory, then there (as reward functions are:
            :func:`llmtune.rewards.functions.reward_search_dirs`).
        key: the recipe key of the list, for messages (``agent.tools.0``, ...).

    Returns:
        The functions, in order.

    Raises:
        ToolSetupError: listing every problem at once: a spec that is not ``module:function``; a module that cannot
            be imported or has no such attribute (close names suggested); not a function; ``*args``/``**kwargs`` or
            positional-only parameters; no schema (a parameter without a type hint, no docstring, or no ``Args:``
            line for a parameter: the fix is named); two tools with the same name.
    """
    problems: list[str] = []
    tools: list[Callable] = []
    seen: dict[str, str] = {}
    for i, spec in enumerate(specs):
        where = f"{key}.{i}"
        try:
            fn = _resolve(spec, recipe_dir, where)
            if inspect.isclass(fn) or not inspect.isroutine(fn):
                raise ToolSetupError(f"{where}: {spec!r} is {type(fn).__name__}, not a function; a tool is a function "
                                     "with type hints and an Args: docstring (a class with tool methods is an "
                                     "environment)")
            _checked_schema(fn, f"{where}: {spec!r}", method=False)
        except ToolSetupError as exc:
            problems += exc.problems
            continue
        if fn.__name__ in seen:
            problems.append(f"{where}: {spec!r}: a second tool named {fn.__name__!r} ({seen[fn.__name__]} is one); "
                            "the model calls tools by name: rename one")
            continue
        seen[fn.__name__] = where
        tools.append(fn)
    if problems:
        raise ToolSetupError(problems)
    return tools


def load_environment(spec: str, recipe_dir: Any = None, key: str = "agent.environment") -> type:
    """Import the environment class named by a recipe and check it.

    The class is not instantiated here (its constructor may start a sandbox); it must be constructible without
    arguments, since :func:`make_toolbox` creates one instance per rollout with ``Class()`` (per-rollout data reaches
    it through ``reset(**row)``).

    Args:
        spec: ``"package.module:Class"`` or ``"path/to/file.py:Class"``.
        recipe_dir: the directory of the recipe (see :func:`load_tools`).
        key: the recipe key, for messages.

    Returns:
        The class.

    Raises:
        ToolSetupError: listing every problem at once: not importable (as in :func:`load_tools`); not a class; a
            constructor that needs arguments; ``reset`` not a method; ``reward`` not callable as
            ``reward(messages)``; no public method (no tool); a public method without a schema (as for a tool).
    """
    where = f"{key}: {spec!r}"
    cls = _resolve(spec, recipe_dir, key)
    if not inspect.isclass(cls):
        raise ToolSetupError(f"{where} is {type(cls).__name__}, not a class; an environment is a class whose public "
                             "methods are the tools (a plain function is a tool: list it under the tools)")
    problems = []
    try:
        inspect.signature(cls).bind()
    except TypeError:
        problems.append(f"{where}: {cls.__name__}{inspect.signature(cls)} needs arguments; llmtune creates one "
                        f"instance per rollout with {cls.__name__}(): give them defaults, and take per-rollout data in "
                        "reset(self, **row)")
    except ValueError:  # no signature (a builtin base): found when the first rollout constructs it
        pass
    reset = inspect.getattr_static(cls, "reset", None)
    if reset is not None and not inspect.isfunction(reset):
        problems.append(f"{where}: reset is {type(reset).__name__}; write a method reset(self, **row) -> str | None")
    reward = inspect.getattr_static(cls, "reward", None)
    if inspect.isfunction(reward):
        try:
            inspect.signature(reward).bind(None, [])
        except TypeError:
            problems.append(f"{where}: reward{inspect.signature(reward)} cannot be called as reward(self, messages); "
                            "write reward(self, messages) -> float | None")
    elif reward is not None and not isinstance(reward, (staticmethod, classmethod)):
        problems.append(f"{where}: reward is {type(reward).__name__}; write a method reward(self, messages) -> "
                        "float | None")
    names = environment_tool_names(cls)
    if not names:
        problems.append(f"{where} has no tools: its public methods (names not starting with '_', other than reset "
                        "and reward) are the tools; add one")
    for name in names:
        try:
            method = inspect.isfunction(inspect.getattr_static(cls, name))  # not a static or class method
            _checked_schema(getattr(cls, name), f"{where}: method {name}", method)
        except ToolSetupError as exc:
            problems += exc.problems
    if problems:
        raise ToolSetupError(problems)
    return cls


def environment_tool_names(environment_cls: type) -> list[str]:
    """The tool names of an environment class, in definition order (base classes first): its public methods,
    static methods and class methods, except ``reset`` and ``reward`` (properties and attributes are not tools)."""
    names: dict[str, None] = {}
    for klass in reversed(environment_cls.__mro__[:-1]):  # without object
        for name, value in vars(klass).items():
            if name.startswith("_") or name in NOT_TOOLS:
                continue
            if inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod)):
                names[name] = None
            else:
                names.pop(name, None)  # a subclass may replace a method with an attribute
    return list(names)


def tool_schemas(functions: Iterable[Callable], environment_cls: type | None = None) -> list[dict]:
    """The JSON schemas of a rollout's tools without constructing anything: the functions', then the environment's
    methods' (what every :class:`Toolbox` of this recipe shows the model). For the recipe check at the start of a run
    (render a conversation with tool calls and results), before any rollout.

    Raises:
        ToolSetupError: an environment method has the name of a function tool.
    """
    schemas = [_schema(fn) for fn in functions]
    if environment_cls is not None:
        schemas += [_schema(getattr(environment_cls, name)) for name in environment_tool_names(environment_cls)]
    names = [s["function"]["name"] for s in schemas]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolSetupError(f"tool name(s) {', '.join(map(repr, twice))} are both a function tool and a method of "
                             f"{environment_cls.__name__}; the model calls tools by name: rename one")
    return copy.deepcopy(schemas)


def check_tool_names(names: Iterable[str], tools: list[str], key: str) -> None:
    """Every name in ``names`` (a recipe list of tool names, e.g. ``agent.infrastructure_timeouts``) is one of the
    run's ``tools``.

    Raises:
        ToolSetupError: one line per unknown name, with the closest tool names and the list of tools.
    """
    problems = []
    for i, name in enumerate(names):
        if name not in tools:
            close = difflib.get_close_matches(name, tools, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            problems.append(f"{key}.{i}: {name!r} is not a tool of this run{hint}; the tools are "
                            f"{', '.join(tools) or '(none)'}")
    if problems:
        raise ToolSetupError(problems)


def check_reset_columns(environment_cls: type, columns: Iterable[str], key: str = "agent.environment",
                        some_rows: Iterable[str] = ()) -> None:
    """Check that every row with these columns can be passed to the environment's ``reset`` (a recipe check: without
    it a missing column would fail every rollout).

    Args:
        columns: the columns every prompt row has (what ``reset`` receives).
        key: the recipe key, for messages. some_rows: columns only some rows have (named in the message).

    Raises:
        ToolSetupError: ``reset`` has a required parameter that is not a column (also when it takes ``**kwargs``),
            or takes one positionally only.
    """
    columns = list(columns)
    try:
        _reset_arguments(environment_cls, dict.fromkeys(columns), key)
    except ToolSetupError as exc:
        partial = [c for c in some_rows if c not in columns]
        if not partial:
            raise
        raise ToolSetupError(f"{exc.problems[0]} (only some rows have {', '.join(partial)})") from None


def _resolve(spec: str, recipe_dir: Any, where: str) -> Any:
    """The object ``module:attr`` names, imported as reward functions are (same search directories and import
    helpers, :mod:`llmtune.rewards.functions`)."""
    from llmtune.rewards.functions import RewardFunctionError, import_file, import_module, reward_search_dirs

    module_name, sep, attr = str(spec).partition(":")
    module_name, attr = module_name.strip(), attr.strip()
    if not sep or not module_name or not attr or ":" in attr:
        raise ToolSetupError(f"{where}: {spec!r} is not 'module:name'; write e.g. 'my_tools.py:calculator' or "
                             "'my_package.tools:calculator'")
    dirs = reward_search_dirs(recipe_dir)
    for d in map(str, dirs):
        if d not in sys.path:
            sys.path.append(d)
    key = (module_name, tuple(dirs))
    if key not in _MODULES:  # a file is executed once: the tools and environment it defines share its globals
        try:
            _MODULES[key] = (import_file if module_name.endswith(".py") else import_module)(module_name, spec, dirs)
        except RewardFunctionError as exc:
            reason = str(exc).removeprefix(f"reward.function: {spec!r}: ")
            raise ToolSetupError(f"{where}: {spec!r}: {reason}") from (exc.__cause__ or exc)
    obj = _MODULES[key]
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=3, cutoff=0.5)
            defined = ", ".join(names)[:300] or "nothing"
            hint = f"did you mean {', '.join(close)}?" if close else f"it defines: {defined}"
            owner = getattr(obj, "__name__", module_name)
            raise ToolSetupError(f"{where}: {spec!r}: {owner} has no attribute {part!r}; {hint}")
        obj = getattr(obj, part)
    return obj


_MODULES: dict[tuple[str, tuple], Any] = {}  # (module or file, search directories) -> the imported module


def _checked_schema(fn: Callable, where: str, method: bool) -> dict:
    """:func:`_schema` with transformers' parsing errors (and what it would silently get wrong) as ToolSetupError;
    ``method``: ``fn`` is an environment's plain method, taken from the class (its first parameter is the instance)."""
    from transformers.utils import DocstringParsingException, TypeHintParsingException

    name = getattr(fn, "__name__", "")
    if not name.isidentifier():
        raise ToolSetupError(f"{where}: a tool needs a name the model can write; {name!r} is not one (use def)")
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ToolSetupError(f"{where}: its signature cannot be read ({exc}); write it as a Python function") from exc
    receiver = bool(params) and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty
    if receiver and not method:
        raise ToolSetupError(f"{where} is a method (its first parameter is {params[0].name}); a tool is a plain "
                             "function, and a class whose methods are tools is an environment")
    params = params[1:] if method else params
    odd = [p.name for p in params if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.POSITIONAL_ONLY)]
    if odd:
        raise ToolSetupError(f"{where}: parameter(s) {', '.join(odd)} are *args, **kwargs or positional-only; the "
                             "model passes arguments by name: give each a name, a type hint and an Args: line")
    try:
        return _schema(fn)
    except DocstringParsingException as exc:
        raise ToolSetupError(f"{where}: no JSON schema: {exc}; {_DOC_FIX}") from exc
    except TypeHintParsingException as exc:
        raise ToolSetupError(f"{where}: no JSON schema: {' '.join(map(str, exc.args))}; {_TYPES_FIX}") from exc
    except (NameError, TypeError) as exc:  # typing.get_type_hints on a hint it cannot resolve
        raise ToolSetupError(f"{where}: its type hints cannot be resolved ({exc}); {_TYPES_FIX}") from exc


@functools.lru_cache(maxsize=None)
def _schema(fn: Callable) -> dict:
    """transformers' JSON schema of a tool (cached per function: every rollout shares it; never mutate it)."""
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


# --------------------------------------------------------------------------------------------------------- toolbox


def make_toolbox(
    functions: Iterable[Callable], environment_cls: type | None, row: Mapping[str, Any],
    infrastructure_timeouts: Iterable[str] = ()
) -> tuple[Toolbox, str | None]:
    """The tools of one rollout: a fresh environment instance (if any), reset with the row.

    Args:
        functions: the plain tool functions (:func:`load_tools`), shared by every rollout.
        environment_cls: the environment class (:func:`load_environment`) or None.
        row: the prompt row's columns; ``reset`` receives those it names (all of them when it takes ``**kwargs``). An
            ``async def reset`` is run to completion.
        infrastructure_timeouts: tool names whose timeout is the infrastructure's fault
            (``agent.infrastructure_timeouts``).

    Returns:
        ``(toolbox, first_user_text)``: the text ``reset`` returned for the first user turn, or None.

    Raises:
        InfrastructureError: the constructor or ``reset`` raised (the original exception is the cause): the rollout
            abstains. An :class:`InfrastructureError` they raise themselves propagates as it is.
        ToolSetupError: ``reset`` needs a column the row lacks, or returned something other than str or None; a
            tool name used twice (all recipe errors, the same for every row).
    """
    functions = list(functions)
    schemas = tool_schemas(functions, environment_cls)
    environment, first_user_text = None, None
    if environment_cls is not None:
        kwargs = _reset_arguments(environment_cls, row, "agent.environment")
        with _environment_failure(environment_cls, "construction"):
            environment = environment_cls()
        if hasattr(environment, "reset"):
            with _environment_failure(environment_cls, "reset"):
                first_user_text = awaited(environment.reset(**kwargs))
    return _toolbox(functions, schemas, environment_cls, environment, first_user_text, infrastructure_timeouts)


async def amake_toolbox(
    functions: Iterable[Callable], environment_cls: type | None, row: Mapping[str, Any],
    infrastructure_timeouts: Iterable[str] = (), pool: Executor | None = None
) -> tuple[Toolbox, str | None]:
    """:func:`make_toolbox` from an event loop, for many rollouts at once: the constructor and a plain ``reset`` run
    in ``pool`` (a sandbox that takes seconds to start delays only its own rollout), an ``async def reset`` is
    awaited on the running loop (with the ``async def`` tool methods that follow it: one loop for the instance's
    whole life). The same arguments, checks, results and errors as :func:`make_toolbox`."""
    import asyncio

    functions = list(functions)
    schemas = tool_schemas(functions, environment_cls)
    environment, first_user_text = None, None
    if environment_cls is not None:
        kwargs = _reset_arguments(environment_cls, row, "agent.environment")
        loop = asyncio.get_running_loop()
        with _environment_failure(environment_cls, "construction"):
            environment = await loop.run_in_executor(pool, environment_cls)
        if hasattr(environment, "reset"):
            with _environment_failure(environment_cls, "reset"):
                if inspect.iscoroutinefunction(environment.reset):
                    first_user_text = await environment.reset(**kwargs)
                else:
                    first_user_text = await loop.run_in_executor(pool, lambda: awaited(environment.reset(**kwargs)))
    return _toolbox(functions, schemas, environment_cls, environment, first_user_text, infrastructure_timeouts)


@contextlib.contextmanager
def _environment_failure(environment_cls: type, step: str):
    """An environment's constructor or ``reset`` raising: an :class:`InfrastructureError` as it is, any other
    exception as an InfrastructureError naming the step (the original is the cause)."""
    try:
        yield
    except InfrastructureError:
        raise
    except Exception as exc:
        raise InfrastructureError(f"environment {environment_cls.__name__} failed in {step}: {type(exc).__name__}: "
                                  f"{exc}") from exc


def _toolbox(functions: list[Callable], schemas: list[dict], environment_cls: type | None, environment: object | None,
             first_user_text: Any, infrastructure_timeouts: Iterable[str]) -> tuple[Toolbox, str | None]:
    """The toolbox of a constructed (and reset) environment, once ``reset``'s answer is checked."""
    if first_user_text is not None and not isinstance(first_user_text, str):
        raise ToolSetupError(f"environment {environment_cls.__name__}.reset returned {type(first_user_text).__name__}; "
                             "return the text of the first user turn (str) or None")
    tools: dict[str, Callable] = {fn.__name__: fn for fn in functions}
    if environment is not None:
        tools.update({n: getattr(environment, n) for n in environment_tool_names(environment_cls)})
    return Toolbox(tools, schemas, environment, infrastructure_timeouts), first_user_text


def _reset_arguments(environment_cls: type, row: Mapping[str, Any], key: str) -> dict:
    """The keyword arguments ``reset`` gets from a row: every column with ``**kwargs``, else the columns it names.

    Raises:
        ToolSetupError: a required parameter of ``reset`` is not a column of the row (with or without ``**kwargs``:
            the row's columns reach ``reset`` by name), or ``reset`` takes a required parameter positionally only.
    """
    reset = inspect.getattr_static(environment_cls, "reset", None)
    if not inspect.isfunction(reset):
        return {}
    params = list(inspect.signature(reset).parameters.values())[1:]  # without self
    name = environment_cls.__name__
    positional = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        raise ToolSetupError(f"{key}: {name}.reset takes {', '.join(positional)} positionally only (before '/'); "
                             "llmtune passes the row's columns by keyword: remove the '/'")
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    missing = [p.name for p in named if p.default is p.empty and p.name not in row]
    if missing:
        raise ToolSetupError(f"{key}: {name}.reset needs {', '.join(missing)}, which the prompt rows do not have; "
                             f"reset receives the columns {', '.join(row) or '(none)'}. Give "
                             f"{'that parameter' if len(missing) == 1 else 'those parameters'} a default, or add "
                             f"{'a column' if len(missing) == 1 else 'columns'} of that name to every row of the data")
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(row)
    return {p.name: row[p.name] for p in named if p.name in row}


class Toolbox:
    """The tools of ONE rollout: the plain functions (shared by all rollouts) and the bound public methods of this
    rollout's own environment instance (built by :func:`make_toolbox`).

    Attributes:
        tools: tool name -> callable.
        schemas: the JSON schemas of the tools (what ``apply_chat_template(tools=...)`` takes), functions first.
        environment: this rollout's environment instance, or None.
        infrastructure_timeouts: names of the tools whose timeout is the infrastructure's fault (the result is then
            an infrastructure failure: the rollout abstains), not the model's (the default: the model reads the
            timeout error and the rollout goes on, scored).
        abandoned: how many of this toolbox's calls timed out while their thread was still running (the thread may
            still be using ``environment``).
    """

    def __init__(self, tools: dict[str, Callable], schemas: list[dict], environment: object | None = None,
                 infrastructure_timeouts: Iterable[str] = ()):
        self.tools = tools
        self.schemas = schemas
        self.environment = environment
        self.infrastructure_timeouts = frozenset(infrastructure_timeouts)
        self.abandoned = 0
        self._schemas = {s["function"]["name"]: s for s in schemas}

    def refuse(self, call: ToolCall, limit: int) -> ToolResult:
        """The result of a call beyond ``agent.max_tool_calls`` (not run, not checked): the model reads
        ``Error: tool call limit reached (N per rollout); answer with what you have`` (error ``over_limit``)."""
        return ToolResult(call.name, f"Error: tool call limit reached ({limit} per rollout); answer with what you "
                          "have", "over_limit", False, 0.0, call.id)

    def call(self, call: ToolCall, timeout_s: float) -> ToolResult:
        """Run one parsed call and turn every outcome into a result for the model (never raises on the model's
        text, and never evaluates it: arguments are the decoded JSON values, passed by keyword).

        Errors, as the model reads them (each short; the kinds are :data:`ERROR_KINDS`):
        ``malformed`` "Error: malformed tool call: <why>"; ``unknown_tool`` "Error: unknown tool 'x'; available
        tools: a, b"; ``bad_arguments`` "Error: bad arguments for f: <every problem>. Call it as f(a: integer,
        b?: string)" (unknown keys, missing required ones, wrong JSON types or values outside an enum; an integer
        written as 3.0 is accepted as 3); ``raised`` "Error: f raised ValueError: <message>" (cut to
        :data:`llmtune.rl.tool_calls.MESSAGE_CHARS`); ``timeout`` "Error: f did not return within 2 s". A returned value becomes the
        content as it is for a str, as JSON for a dict/list/tuple, else ``str(value)``.

        Args:
            call: the call (:func:`llmtune.rl.tool_calls.parse_tool_calls`).
            timeout_s: seconds to wait for the tool (> 0). The tool runs in a daemon worker thread; past the
                timeout the call stops waiting, but the thread cannot be killed and keeps running until the tool
                returns (counted by :attr:`abandoned` and :func:`abandoned_tool_threads`). An ``async def`` tool runs
                on an event loop of its own in that thread and is cancelled at the timeout (its thread then ends,
                unless the coroutine ignores the cancellation, and is not counted). A tool that needs a
                hard limit (a subprocess, a sandbox) should enforce it itself. Tools run outside the main thread,
                so ``signal``-based timeouts inside a tool do not work.

        Returns:
            The :class:`ToolResult`; ``infrastructure`` is True when the tool raised :class:`InfrastructureError`, or
            timed out and is one of :attr:`infrastructure_timeouts`; ``reward`` is what a :class:`ToolOutput` carried.

        Raises:
            ValueError: ``timeout_s`` is not positive (a caller's error, never the model's).
            ToolSetupError: the tool returned a :class:`ToolOutput` whose reward is not a finite number or None (the
                tool's bug, not the model's: the run stops).
        """
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        start = time.monotonic()
        ready = self._prepare(call, start)
        if isinstance(ready, ToolResult):
            return ready
        fn, arguments = ready
        return self._result(call, start, timeout_s, *_run(fn, arguments, timeout_s, call.name))

    async def acall(self, call: ToolCall, timeout_s: float, pool: Executor | None = None) -> ToolResult:
        """:meth:`call` from an event loop, for many rollouts at once: an ``async def`` tool is awaited on the running
        loop itself (no thread; cancelled at the timeout, given :data:`ASYNC_CANCEL_GRACE_S` to unwind, else left
        running and counted by :func:`abandoned_tool_threads`); any other tool is :meth:`call`, run in ``pool`` (a
        bounded thread pool: at most its size of these calls wait at once; None = the loop's default executor).
        The same checks, results and errors as :meth:`call`.

        An ``async def`` tool shares the loop with every other rollout: it must not block (``time.sleep``, a
        blocking socket, CPU-bound work: wrap those in ``asyncio.to_thread``), or every rollout waits for it.

        Raises:
            ValueError, ToolSetupError: as :meth:`call`.
        """
        import asyncio

        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
        start = time.monotonic()
        ready = self._prepare(call, start)
        if isinstance(ready, ToolResult):
            return ready
        fn, arguments = ready
        if not inspect.iscoroutinefunction(fn):
            return await asyncio.get_running_loop().run_in_executor(pool, self.call, call, timeout_s)
        return self._result(call, start, timeout_s, *await _run_async(fn, arguments, timeout_s))

    def _prepare(self, call: ToolCall, start: float) -> ToolResult | tuple[Callable, dict]:
        """The tool and its checked arguments, or the error result of a call that cannot run (malformed, unknown
        tool, bad arguments)."""
        if call.error is not None:
            return self._made(call, start, f"Error: malformed tool call: {call.error}", "malformed")
        fn = self.tools.get(call.name)
        if fn is None:
            return self._made(call, start, f"Error: unknown tool {_cut(repr(call.name))}; available tools: "
                              f"{', '.join(self.tools)}", "unknown_tool")
        schema = self._schemas[call.name]
        arguments, problems = check_arguments(call.arguments or {}, schema)
        if problems:
            return self._made(call, start, f"Error: bad arguments for {call.name}: {'; '.join(problems)}. Call it as "
                              f"{_signature(schema)}", "bad_arguments")
        return fn, arguments

    def _result(self, call: ToolCall, start: float, timeout_s: float, state: str, value: tuple[str, Any] | None,
                exc: BaseException | None) -> ToolResult:
        """The result of a call that ran (``state``, ``value``, ``exc``: as :func:`_run` returns them)."""
        if state != "returned":
            self.abandoned += state == "abandoned"
            return self._made(call, start, f"Error: {call.name} did not return within {timeout_s:g} s", "timeout",
                              call.name in self.infrastructure_timeouts)
        if exc is not None:
            message = _cut(_exception_text(exc))
            return self._made(call, start, f"Error: {call.name} raised {type(exc).__name__}{': ' * bool(message)}"
                              f"{message}", "raised", isinstance(exc, InfrastructureError))
        content, reward = value
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                                   or not math.isfinite(reward)):
            raise ToolSetupError(f"agent: tool {call.name} returned ToolOutput(reward={reward!r}); a reward must be a "
                                 "finite number or None")
        return self._made(call, start, content, reward=None if reward is None else float(reward))

    @staticmethod
    def _made(call: ToolCall, start: float, content: str, error: str | None = None, infrastructure: bool = False,
              reward: float | None = None) -> ToolResult:
        return ToolResult(call.name, content, error, infrastructure, time.monotonic() - start, call.id, reward)


def abandoned_tool_threads() -> int:
    """How many tool threads of this process (and ``async def`` tool tasks of :meth:`Toolbox.acall`) timed out and
    are still running (never killed: see :meth:`Toolbox.call`). Log it: a number that grows means a tool hangs."""
    with _ABANDONED_LOCK:
        _ABANDONED[:] = [t for t in _ABANDONED if (not t.done() if hasattr(t, "done") else t.is_alive())]
        return len(_ABANDONED)


_ABANDONED: list = []  # threads.Thread (call) and asyncio.Task (acall)
_ABANDONED_LOCK = threading.Lock()


ASYNC_CANCEL_GRACE_S = 1.0  # after the timeout, how long a cancelled async tool may take to unwind


def _run(fn: Callable, arguments: dict, timeout_s: float, name: str
         ) -> tuple[str, tuple[str, Any] | None, BaseException | None]:
    """``fn(**arguments)`` in a daemon thread, waiting at most ``timeout_s``: ``(state, (content, reward), exception)``
    with state ``"returned"`` (or raised), ``"cancelled"`` (an ``async def`` tool, which runs on its own event loop in
    that thread, cancelled at the timeout: its thread ends) or ``"abandoned"`` (past the timeout, still running)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            value = fn(**arguments)
            if inspect.isawaitable(value):
                box["async"] = True
                value = awaited(value, timeout_s)
            box["value"] = ((_to_text(value.content), value.reward) if isinstance(value, ToolOutput)
                            else (_to_text(value), None))
        except AwaitTimeout:
            box["expired"] = True
        except BaseException as exc:  # noqa: BLE001 - SystemExit in a tool must not vanish with its thread
            box["error"] = exc

    thread = threading.Thread(target=target, name=f"llmtune-tool-{name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive() and box.get("async"):  # cancelled at the timeout: let it unwind
        thread.join(ASYNC_CANCEL_GRACE_S)
    if thread.is_alive():
        with _ABANDONED_LOCK:
            _ABANDONED.append(thread)
        return "abandoned", None, None
    if box.get("expired"):
        return "cancelled", None, None
    return "returned", box.get("value"), box.get("error")


async def _run_async(fn: Callable, arguments: dict, timeout_s: float
                     ) -> tuple[str, tuple[str, Any] | None, BaseException | None]:
    """``await fn(**arguments)`` on the running loop, waiting at most ``timeout_s``: the same ``(state, value,
    exception)`` as :func:`_run`; past the timeout the task is cancelled and given :data:`ASYNC_CANCEL_GRACE_S` to
    unwind (``"cancelled"``), else left running (``"abandoned"``, counted by :func:`abandoned_tool_threads`)."""
    import asyncio

    async def target() -> tuple[tuple[str, Any] | None, BaseException | None]:
        try:
            value = await fn(**arguments)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit in a tool must end neither the loop nor silently
            return None, exc
        return ((_to_text(value.content), value.reward) if isinstance(value, ToolOutput)
                else (_to_text(value), None)), None

    task = asyncio.ensure_future(target())
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=ASYNC_CANCEL_GRACE_S)
        if not done:
            with _ABANDONED_LOCK:
                _ABANDONED.append(task)
            return "abandoned", None, None
        return "cancelled", None, None
    if task.cancelled():  # the tool cancelled itself: as a timeout
        return "cancelled", None, None
    value, exc = task.result()
    return "returned", value, exc


def _to_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (dict, list, tuple)):
        try:
            return json.dumps(value, ensure_ascii=False, default=str)
        except (TypeError, ValueError):  # circular references
            return str(value)
    return str(value)
