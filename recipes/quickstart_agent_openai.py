"""A calculator agent for arithmetic questions, written as you might already have one: plain Python and the `openai`
client, no llmtune import. recipes/quickstart_agent_openai_pipeline.yaml (multi-digit products) and
recipes/quickstart_agent_openai.yaml (GSM8K) train it as it is: llmtune calls solve() once per rollout with that
rollout's own base URL and key, and records every request it makes as token ids.

Run it against any OpenAI-compatible server as well:
    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=... \
        LLMTUNE_ROW='{"messages": [{"role": "user", "content": "What is 12 * 7?"}]}' python quickstart_agent_openai.py
"""

import ast
import json
import operator
import os

# the calculator's schema, as the model saw it in its SFT warm start (builtin:multiply-calculator, builtin:gsm8k-calculator)
CALCULATOR = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression and return its value.",
    "parameters": {"type": "object", "properties": {"expression": {
        "type": "string", "description": "numbers with + - * / // % ** and parentheses, e.g. \"(12 * 7 + 3) / 2\"."}},
        "required": ["expression"]}, "return": {"type": "string"}}}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
             ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression (numbers and + - * / // % ** only: nothing is executed)."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return OPERATORS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not an arithmetic expression: {expression!r}")

    result = value(ast.parse(expression.replace("^", "**").replace(",", ""), mode="eval").body)
    return str(int(result)) if isinstance(result, float) and result.is_integer() else str(result)


def run_tool(call) -> str:
    if call.function.name != "calculator":
        return f"Error: unknown tool {call.function.name!r}; available tools: calculator"
    try:
        return calculate(json.loads(call.function.arguments)["expression"])
    except Exception as exc:  # the model's mistake: it reads the error and may try again
        return f"Error: calculator raised {type(exc).__name__}: {exc}"


def solve(base_url: str, api_key: str, row: dict, seed: int):
    """Answer one question: call the calculator as often as the model asks, until it answers. Returns None: the
    recipe's reward functions score the final answer ("#### <number>" against the reference)."""
    from openai import BadRequestError, OpenAI

    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = list(row["messages"])  # the question
    while True:
        try:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        except BadRequestError:  # the server says this conversation is over (its token or turn limit)
            return None
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return None  # the final answer
        for call in message.tool_calls:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})


if __name__ == "__main__":  # as an external command (agent.openai.command): the row and seed come by environment
    reward = solve(os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"], json.loads(os.environ["LLMTUNE_ROW"]),
                   int(os.environ.get("LLMTUNE_SEED", "0")))
    print("" if reward is None else reward)
