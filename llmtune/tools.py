"""Built-in tools and environments for multi-turn agent rollouts (``agent.tools: [llmtune.tools:calculator]``,
``agent.environment: llmtune.tools:TreasureHunt``).

A tool is a plain Python function with type hints and a Google docstring (its JSON schema is
``transformers.utils.get_json_schema`` of it, which the chat template renders for the model); what it returns goes
back to the model as the tool result. An exception it raises goes back as an error message (the model's call was
wrong); raise :class:`llmtune.rl.toolbox.InfrastructureError` for a failure that is not the model's fault. An
environment is a class: one fresh instance per rollout, ``reset(**row)`` with the prompt row's columns, its public
methods the tools (``docs/agents.md``).
"""

from __future__ import annotations

import ast
import math
import operator
from decimal import Decimal

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # 10 ** 64 is plenty for arithmetic; 9 ** 9 ** 9 would take the machine down
MAX_BITS = 4096  # any intermediate result: about 1,233 digits (big-int arithmetic holds the GIL: no timeout stops it)
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
    """The value of an expression node of numbers and arithmetic operators only (nothing is executed).

    Every operation whose result could exceed :data:`MAX_BITS` is refused BEFORE it is computed (``a ** b``: about
    ``b * log2|a|`` bits; ``a * b``: the bit lengths add), so no expression can stall the process: Python's big-int
    arithmetic holds the interpreter lock, and a tool timeout cannot interrupt it."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"the exponent {right} is too large (at most {MAX_EXPONENT})")
        _check_size(node.op, left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise ValueError("division by zero") from None
        except OverflowError:
            raise _too_large() from None
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"only numbers and + - * / // % ** ( ) are allowed, not {ast.unparse(node)!r}")


def _bits(x) -> float:
    """An upper bound of log2|x| (0 for |x| <= 1): a number's size in bits."""
    if isinstance(x, int):
        return float(abs(x).bit_length())
    return math.log2(abs(x)) if isinstance(x, float) and abs(x) > 1 and math.isfinite(x) else 0.0


def _check_size(op: ast.operator, left, right) -> None:
    """Refuse ``left op right`` before computing it when its result could exceed :data:`MAX_BITS`."""
    if isinstance(op, ast.Pow) and right > 0:
        bits = right * _bits(left)
    elif isinstance(op, ast.Mult):
        bits = _bits(left) + _bits(right)
    else:  # + - / // %: at most one bit more than the larger operand, which is bounded already
        return
    if bits > MAX_BITS:
        raise _too_large(bits)


def _bounded(value):
    """``value`` when it is a finite real number of at most :data:`MAX_BITS` bits, else a ValueError."""
    if isinstance(value, complex):
        raise ValueError("a fractional power of a negative number has no real value")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise _too_large(value.bit_length())
    if isinstance(value, float) and not math.isfinite(value):
        raise _too_large()
    return value


def _too_large(bits: float | None = None) -> ValueError:
    """The error for a result over :data:`MAX_BITS` bits (``bits``: its estimated size), or (None) over the range of
    a floating-point number."""
    if bits is None:
        return ValueError("the result is too large for a floating-point number (at most about 1.8e308); use smaller "
                          "numbers")
    return ValueError(f"the result is too large (about {int(bits * math.log10(2)) + 1:,} digits; at most "
                      f"{int(MAX_BITS * math.log10(2)):,}): split the calculation or use smaller numbers")


class TreasureHunt:
    """A treasure hunt through fictional rooms (``builtin:rooms``): each room holds a note that names the next room
    or, in the last room, the treasure's number. Only this environment knows the notes, so the model must enter the
    rooms one after another, reading each note, and answer ``#### <treasure>`` (``llmtune.rewards:gsm8k_reward``
    checks it against the row's reference).

    ``reset`` takes the row's ``rooms`` column: ``{room name: note}`` (a note names the next room, possibly with a
    decoy: ``"Go to room <name>."``, ``"Room <name> is safe. Room <decoy> is a trap."``; or, in the last room of a
    route, ``"The treasure is <number>."``: :mod:`llmtune.data.agent_tasks`). ``enter`` finds a room by its name with
    surrounding spaces and case ignored; any other name is an error the model reads (it can try again).
    """

    def reset(self, rooms: dict) -> None:
        """Start a hunt in the row's rooms (nothing is added to the prompt: the question names the first room).

        Args:
            rooms: room name -> the note inside it.
        """
        self.rooms = dict(rooms)

    def enter(self, room: str) -> str:
        """Enter a room and read the note inside it.

        Args:
            room: the room's name, e.g. "Kalo".
        """
        name = room.strip()
        found = self.rooms.get(name) or self._by_lower().get(name.lower())
        if found is None:
            raise ValueError(f"there is no room named {room!r}")
        return found

    def _by_lower(self) -> dict:
        return {name.lower(): note for name, note in self.rooms.items()}
