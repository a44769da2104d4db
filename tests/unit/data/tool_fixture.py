"""Tool conversations shared by the data tests: a ``calc`` tool, its calls and results (transformers' chat form)."""

CALC = {"type": "function", "function": {
    "name": "calc", "description": "Compute.",
    "parameters": {"type": "object", "properties": {"e": {"type": "string", "description": "An expression."}},
                   "required": ["e"]}}}


def call(e: str, **extra) -> dict:
    return {"type": "function", "function": {"name": "calc", "arguments": {"e": e}}, **extra}


U = {"role": "user", "content": "What is 12 * 7 + 3?"}
# round 1: two calls in one turn, no text; round 2: text before one call; then the answer
A1 = {"role": "assistant", "content": "", "tool_calls": [call("12 * 7"), call("1 + 2")]}
T1 = {"role": "tool", "name": "calc", "content": "84"}
T2 = {"role": "tool", "name": "calc", "content": "3"}
A2 = {"role": "assistant", "content": "Now add.", "tool_calls": [call("84 + 3")]}
T3 = {"role": "tool", "name": "calc", "content": "87"}
AF = {"role": "assistant", "content": "It is 87."}
TWO_ROUNDS = [U, A1, T1, T2, A2, T3, AF]
