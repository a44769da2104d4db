"""The shipped calculator tool (llmtune.tools): every intermediate result is bounded BEFORE it is computed, so no
expression the model writes can stall the process (big-int arithmetic holds the interpreter lock: a tool timeout
cannot stop it); what it refuses goes back to the model as an error."""

import time

import pytest

from llmtune.rl.tool_calls import ToolCall
from llmtune.rl.toolbox import make_toolbox
from llmtune.tools import MAX_BITS, calculator


@pytest.mark.parametrize("expression,value", [
    ("(12 * 7 + 3) / 2", "43.5"), ("10 / 2", "5"), ("2 ^ 10", "1024"), ("1,000 * 3", "3000"), ("2 ** -3", "0.125"),
    ("9 ** 64", str(9 ** 64)), ("10 ** 64 * 10 ** 64", str(10 ** 128)),
])
def test_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", [
    "(9**64)**64",  # 4,096 x log2(9) bits
    "(((9**64)**64)**64)**64",  # ~30 s of pure integer arithmetic, GIL held, if it were computed
    "*".join(["10**64"] * 20),  # products: the bit lengths add
    "(2**64)**64 - 1",
])
def test_results_over_the_bound_are_refused_before_they_are_computed(expression):
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"the result is too large \(about [\d,]+ digits; at most 1,233\): split"):
        calculator(expression)
    assert time.monotonic() - start < 0.5


def test_results_within_the_bound_are_exact():
    assert calculator("(2**64)**63") == str(2 ** 4032)  # 63 x 65 bits estimated: within MAX_BITS
    assert calculator("(2**64)**63 * 15") == str(2 ** 4032 * 15)
    assert MAX_BITS == 4096


def test_float_overflow_and_complex_results_are_errors():
    with pytest.raises(ValueError, match="too large for a floating-point number"):
        calculator("1e308 * 10")
    with pytest.raises(ValueError, match="too large for a floating-point number"):
        calculator("1.5 ** 64 ** 1 * 1e300")
    with pytest.raises(ValueError, match="no real value"):
        calculator("(-8) ** 0.5")


def test_the_model_reads_the_error_at_once():
    box, _ = make_toolbox([calculator], None, {})
    start = time.monotonic()
    res = box.call(ToolCall("calculator", {"expression": "(((9**64)**64)**64)**64"}, ""), timeout_s=5)
    assert time.monotonic() - start < 1
    assert res.error == "raised" and res.content.startswith("Error: calculator raised ValueError: the result is too "
                                                             "large (about 3,911 digits")
