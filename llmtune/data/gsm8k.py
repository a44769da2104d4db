"""``builtin:gsm8k-calculator``: GSM8K reference solutions as tool conversations with the calculator tool.

GSM8K solutions annotate their arithmetic: ``"Natalia sold 48/2 = <<48/2=24>>24 clips in May. ... #### 72"``.
:func:`calculator_conversation` turns a ``{question, answer}`` row into a ``messages`` row with a ``tools`` column:

* user: the question;
* assistant turns that call ``calculator`` (:func:`llmtune.tools.calculator`), one call per ``<<expression=value>>``
  annotation, grouped into rounds: a call goes into the round after the latest earlier call whose value appears as a
  number in its expression (it needs that result), independent calls share a turn (several calls in one turn). The
  model thus learns to ask for what it can compute now and to use the results it gets back. Each call turn is
  followed by its tool results, computed by the calculator itself (never copied from the annotation);
* the final assistant turn: the solution with the annotations removed, ending with ``#### <answer>``;
* ``tools``: ``[transformers.utils.get_json_schema(calculator)]``.

A row is dropped (a policy drop, counted with its reason in the data report, never an error) when an annotation is
not ``expression=value``, its value is not a number, the calculator cannot evaluate its expression, or the result
differs from the annotated value (beyond float rounding: ``0.1*3`` gives ``0.30000000000000004`` for ``0.3``); and
when the solution has no annotation at all (nothing to call the calculator with). On the shipped 1,319 test rows:
18 rows without annotations and 1 with the value ``3/4`` are dropped; 1,300 conversations remain.
"""

from __future__ import annotations

import math
import re
from functools import lru_cache

from llmtune.data.errors import RowError
from llmtune.tools import calculator

ANNOTATION = re.compile(r"<<([^<>]*)>>")
NUMBER = re.compile(r"\d+(?:\.\d+)?|\.\d+")
NO_ANNOTATION = "no calculator annotation"
BAD_ANNOTATION = "annotation does not evaluate to its value"


@lru_cache(maxsize=1)
def calculator_schema() -> dict:
    """The JSON schema of :func:`llmtune.tools.calculator` (``transformers.utils.get_json_schema``), as ``agent.tools:
    [llmtune.tools:calculator]`` shows it to the policy. Do not mutate it (cached)."""
    from transformers.utils import get_json_schema

    return get_json_schema(calculator)


def _text(row: dict, field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str) or not value.strip():
        raise RowError(f"missing field '{field}'", f"field '{field}' must be a non-empty string")
    return value


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _steps(answer: str) -> list[tuple[str, str, float]]:
    """``(expression, calculator result, annotated value)`` per annotation, in order.

    Raises:
        RowError: (policy drop) see the module docstring.
    """
    steps = []
    for match in ANNOTATION.finditer(answer):
        body = match.group(1)
        expression, sep, value = body.rpartition("=")
        target = _number(value)
        if not sep or not expression.strip() or target is None:
            raise RowError(BAD_ANNOTATION, f"annotation <<{body}>> is not <<expression=number>> (its value "
                           f"{value!r} is not a number)", bad=False)
        try:
            result = calculator(expression)
        except ValueError as exc:
            raise RowError(BAD_ANNOTATION, f"annotation <<{body}>>: the calculator cannot evaluate {expression!r} "
                           f"({exc})", bad=False) from None
        if not math.isclose(float(result), target, rel_tol=1e-9, abs_tol=1e-9):
            raise RowError(BAD_ANNOTATION, f"annotation <<{body}>>: calculator({expression!r}) = {result}, not "
                           f"{value}", bad=False)
        steps.append((expression, result, target))
    return steps


def dependency_rounds(steps: list[tuple[str, str, float]]) -> list[int]:
    """The round (1, 2, ...) of each step: one after the latest earlier step whose value is a number of its
    expression, else 1.

    Args:
        steps: ``(expression, result, value)`` in solution order.

    Returns:
        One round per step, in the same order.
    """
    rounds: list[int] = []
    for k, (expression, _, _) in enumerate(steps):
        numbers = {float(n) for n in NUMBER.findall(expression.replace(",", ""))}
        needs = [rounds[j] for j in range(k) if steps[j][2] in numbers]
        rounds.append(1 + max(needs, default=0))
    return rounds


def calculator_conversation(row: dict) -> dict:
    """A GSM8K ``{question, answer}`` row as a tool conversation (see the module docstring).

    Returns:
        ``{"messages": [user, (assistant with tool_calls, tool results) per round, final assistant], "tools":
        [calculator schema]}``, a ``messages`` row.

    Raises:
        RowError: ``question``/``answer`` missing (a bad row); an annotation that does not evaluate to its value, or
            none at all (policy drops, counted).
    """
    question, answer = _text(row, "question"), _text(row, "answer")
    steps = _steps(answer)
    if not steps:
        raise RowError(NO_ANNOTATION, "the solution has no <<expression=value>> annotation, so there is nothing to call "
                       "the calculator with (builtin:gsm8k has this row without tools)", bad=False)
    rounds = dependency_rounds(steps)
    messages: list[dict] = [{"role": "user", "content": question}]
    for r in range(1, max(rounds) + 1):
        calls = [(expression, result) for (expression, result, _), k in zip(steps, rounds) if k == r]
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
            for expression, _ in calls]})
        messages += [{"role": "tool", "name": "calculator", "content": result} for _, result in calls]
    messages.append({"role": "assistant", "content": ANNOTATION.sub("", answer)})
    return {"messages": messages, "tools": [calculator_schema()]}
