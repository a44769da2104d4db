"""Built-in tools for multi-turn agent rollouts (``agent.tools: [llmtune.tools:calculator]``).

A tool is a plain Python function with type hints and a Google docstring (its JSON schema is
``transformers.utils.get_json_schema`` of it, which the chat template renders for the model); what it returns goes
back to the model as the tool result. An exception it raises goes back as an error message (the model's call was
wrong); raise :class:`llmtune.rl.toolbox.InfrastructureError` for a failure that is not the model's fault.
"""

from __future__ import annotations

import ast
import operator
from decimal import Decimal

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # 10 ** 64 is plenty for arithmetic; 9 ** 9 ** 9 would take the machine down
MAX_CHARS = 200


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 * 7 + 3) / 2".
    """
    if len(expression) > MAX_CHARS:
        raise ValueError(f"the expression has {len(expression)} characters; at most {MAX_CHARS}")
    try:
        tree = ast.parse(expression.replace("^", "**").replace(",", ""), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    value = _evaluate(tree.body)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    if isinstance(value, float):
        return format(Decimal(repr(value)).normalize(), "f")
    return str(value)


def _evaluate(node: ast.AST):
    """The value of an expression node of numbers and arithmetic operators only (nothing is executed)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent {right} is too large (at most {MAX_EXPONENT})")
        try:
            return _BINARY[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")
