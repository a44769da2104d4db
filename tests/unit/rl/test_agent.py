"""The multi-turn agent loop (llmtune.rl.agent) with a stand-in engine that "samples" scripted turns on the tiny ChatML
tokenizer (chatml_tools): a turn cut by the budget is the conversation's last message and what reward functions score;
an explicit agent.tool_parser is used even when the tokenizer has a response template, and auto parses with the
response template and the tools' schemas; a malformed call stays visible in the message; abandoned tool threads are
logged; the recipe checks (validate and the run's start) refuse an undetectable tool-call format, and the dataset's own
columns reach an environment's reset."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import pytest

from llmtune.config import RecipeError, load_recipe
from llmtune.data.prompts import prompt_ids
from llmtune.data.templates import BUILTIN_TEMPLATES, stop_token_ids
from llmtune.models.tiny import make_tiny_tokenizer
from llmtune.rewards import gsm8k_reward
from llmtune.rl.agent import AgentLoop, AgentSettings, agent_metrics
from llmtune.rl.chat import ToolTurns
from llmtune.rl.tool_calls import resolve_tool_parser
from llmtune.rl.toolbox import ToolSetupError, tool_schemas
from llmtune.rewards.sources import Scored
from llmtune.rl.rollouts import Ranks, Rollouts
from llmtune.rl.types import LENGTH, STOP, Completion, RolloutBatch, SamplingParams

QUESTION = "What is 2 + 3?"
QWEN_RESPONSE_TEMPLATE = {  # transformers' response-template format (Qwen2.5-style turns)
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "tool_calls": {"open_pattern": r"\s*<tool_call>", "close": "</tool_call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"close_pattern": r"\s*(?:<\|im_end\|>|<\|endoftext\|>)", "content": "text"},
    },
}


def add(a: int, b: int = 1) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture
def tok():
    tok = make_tiny_tokenizer()
    tok.chat_template = BUILTIN_TEMPLATES["chatml_tools"]
    return tok


class ScriptedEngine:
    """Samples the scripted text of each turn, in order, for every prompt: its ids and the stop token, cut to the
    prompt's budget (finish ``length``) when they do not fit."""

    def __init__(self, tok, turns: list[str]):
        self.tok, self.turns, self.calls = tok, turns, 0
        self.stop = stop_token_ids(tok)[0]

    def generate(self, prompts, sampling, budgets=None, keys=None, version=None):
        text = self.turns[self.calls]
        self.calls += 1
        out = []
        for budget in budgets:
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.stop]
            finish = STOP if len(ids) <= budget else LENGTH
            out.append(Completion(ids[:budget], None, finish, 0))
        return out


def agent(tok, engine, tools=(add,), parser="hermes", response_template=False, timeout_s=5.0) -> AgentLoop:
    schemas = tool_schemas(list(tools))
    turns = ToolTurns(tok, schemas, stop_token_ids(tok))
    return AgentLoop(engine, tok, turns, list(tools), None, AgentSettings(4, 64, timeout_s, parser, response_template),
                     lambda messages: prompt_ids(tok, messages, tools=schemas), 512)


def prompt_row(tok) -> dict:
    messages = [{"role": "user", "content": QUESTION}]
    return {"input_ids": prompt_ids(tok, messages, tools=tool_schemas([add])), "messages": json.dumps(messages),
            "prompt": QUESTION, "reference": "5", "index": 0}


def final_answers(tok, trajectories) -> list[str]:
    """What the reward functions of a multi-turn run get as completions (the trainer's own selection)."""
    batch = RolloutBatch.from_trajectories(trajectories, tok.pad_token_id)
    return Scored.from_batch(batch, tok).completions


def run(tok, loop, budget):
    return loop.run([prompt_row(tok)], SamplingParams(budget, tuple(stop_token_ids(tok))))


# ---- a turn cut by the budget --------------------------------------------------------------------------------
RAMBLE = "Hmm, let me think about this again, maybe the answer is not what I said, because " * 4


def test_a_turn_cut_by_the_budget_is_the_answer_that_is_scored(tok):
    """Turn 1 answers "#### 5" and calls a tool; turn 2 rambles until the budget ends: the reward scores turn 2's
    text (what the model last wrote), not turn 1's, and the conversation shows it."""
    first = "The answer is #### 5.\n" + call("add", {"a": 2, "b": 3})
    full = run(tok, agent(tok, ScriptedEngine(tok, [first, RAMBLE])), 4096)[0]
    sampled = full.loss_mask.index(0)  # turn 1's tokens (stop included), then the tool message
    room = sampled + full.loss_mask[sampled:].index(1) + 10  # turn 1, the tool message and 10 tokens of turn 2
    [t] = run(tok, agent(tok, ScriptedEngine(tok, [first, RAMBLE])), room)
    assert (t.finish_reason, t.turns, len(t.completion_ids)) == (LENGTH, 2, room)
    cut = t.completion_ids[-10:]
    assert t.loss_mask[-10:] == [1] * 10  # the cut tokens are trained ...
    assert [m["role"] for m in t.outcome.messages] == ["user", "assistant", "tool", "assistant"]
    last = t.outcome.messages[-1]
    assert last == {"role": "assistant", "content": tok.decode(cut, skip_special_tokens=False)}  # ... and shown
    assert RAMBLE.startswith(last["content"]) and last["content"]
    assert final_answers(tok, [t]) == [last["content"]]
    assert gsm8k_reward([QUESTION], final_answers(tok, [t]), ["5"]) == [0.0]  # the old "#### 5" is not scored


def test_a_first_turn_cut_by_the_budget_is_scored_too(tok):
    [t] = run(tok, agent(tok, ScriptedEngine(tok, ["The answer is #### 5 because " + RAMBLE])), 12)
    assert (t.finish_reason, t.turns, t.outcome.tool_calls) == (LENGTH, 1, 0)
    text = tok.decode(t.completion_ids, skip_special_tokens=False)
    assert text.startswith("The answer is #### 5") and final_answers(tok, [t]) == [text]
    assert gsm8k_reward([QUESTION], [text], ["5"]) == [1.0]


def test_a_cut_turn_runs_no_tool_call(tok):
    ran = []

    def record(a: int) -> int:
        """Record a call.

        Args:
            a: anything
        """
        ran.append(a)
        return a

    text = call("record", {"a": 1}) + " and more text after the call"
    [t] = run(tok, agent(tok, ScriptedEngine(tok, [text]), tools=(record,)), len(tok(text)["input_ids"]) - 3)
    assert t.finish_reason == LENGTH and ran == [] and t.outcome.tool_calls == 0
    assert "tool_calls" not in t.outcome.messages[-1] and "<tool_call>" in t.outcome.messages[-1]["content"]


# ---- reading the calls: explicit parser, response template, malformed calls ------------------------------------
def test_an_explicit_tool_parser_is_used_even_with_a_response_template(tok, monkeypatch):
    tok.response_template = QWEN_RESPONSE_TEMPLATE
    used = []
    real = type(tok).get_response_parser
    monkeypatch.setattr(type(tok), "get_response_parser", lambda self, *a, **k: used.append(k) or real(self, *a, **k))
    turns = [call("add", {"a": "7"}), "Done."]  # a string where the schema wants an integer
    assert resolve_tool_parser("hermes", tok) == ("hermes", False)
    [t] = run(tok, agent(tok, ScriptedEngine(tok, turns), parser="hermes"), 4096)
    assert used == [] and t.outcome.tool_errors == {"bad_arguments": 1}  # hermes reads "7" as the model wrote it


def test_auto_parses_with_the_response_template_and_the_tools_schemas(tok, monkeypatch):
    tok.response_template = QWEN_RESPONSE_TEMPLATE
    used = []
    real = type(tok).get_response_parser
    monkeypatch.setattr(type(tok), "get_response_parser", lambda self, *a, **k: used.append(k) or real(self, *a, **k))
    parser, response_template = resolve_tool_parser("auto", tok)
    assert (parser, response_template) == ("hermes", True)
    [t] = run(tok, agent(tok, ScriptedEngine(tok, [call("add", {"a": "7"}), "Done."]), parser=parser,
                         response_template=response_template), 4096)
    assert used and used[0]["tools"] == tool_schemas([add])  # transformers casts "7" to 7 for an integer
    assert t.outcome.tool_errors == {} and t.outcome.messages[2]["content"] == "8"


def test_auto_without_a_format_is_a_recipe_error(tok):
    tok.chat_template = BUILTIN_TEMPLATES["chatml_tools"].replace("tool_call>", "call>")
    with pytest.raises(RecipeError, match=r"agent.tool_parser: auto cannot tell the tool-call format"):
        resolve_tool_parser("auto", tok)
    assert resolve_tool_parser("llama3", tok) == ("llama3", False)
    tok.response_template = QWEN_RESPONSE_TEMPLATE
    assert resolve_tool_parser("auto", tok) == (None, True)


def test_a_malformed_call_stays_visible_in_the_message(tok):
    bad = '<tool_call>{"name": "add", "arguments": {</tool_call>'
    [t] = run(tok, agent(tok, ScriptedEngine(tok, ["Let me add.\n" + bad + "\n" + call("add", {"a": 1}), "Done."])),
              4096)
    turn = t.outcome.messages[1]
    assert turn["content"] == "Let me add.\n" + bad  # the text without the good call's markup, then the bad call
    assert turn["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}]
    assert t.outcome.tool_errors == {"malformed": 1} and t.outcome.tool_calls == 2


# ---- metrics -----------------------------------------------------------------------------------------------
def test_abandoned_tool_threads_are_logged(tok):
    release = threading.Event()

    def hang(seconds: float) -> str:
        """Wait.

        Args:
            seconds: how long
        """
        release.wait(seconds)
        return "late"

    try:
        [t] = run(tok, agent(tok, ScriptedEngine(tok, [call("hang", {"seconds": 30}), "Done."]), tools=(hang,),
                             timeout_s=0.2), 4096)
        metrics = Rollouts.agent_metrics(SimpleNamespace(ranks=Ranks()), [t])
        from llmtune.rl.toolbox import abandoned_tool_threads

        assert t.outcome.tool_errors == {"timeout": 1}
        assert metrics["agent/abandoned_tool_threads"] == abandoned_tool_threads() >= 1
    finally:
        release.set()
    assert metrics.keys() - agent_metrics([t]).keys() == {"agent/abandoned_tool_threads"}


# ---- recipe checks (llmtune validate and the start of a run): OnlineRLStage.build_data --------------------------
ENVIRONMENT = '''
class Checker:
    def reset(self, answer, tests, **row):
        self.answer, self.tests, self.row = answer, tests, row

    def submit(self, value: str) -> str:
        """Submit an answer.

        Args:
            value: the answer
        """
        return "correct" if value == str(self.answer) else "wrong"


class NeedsHint(Checker):
    def reset(self, hint, **row):
        self.hint = hint
'''


def grpo_recipe(tmp_path, environment="env.py:Checker", **agent_keys):
    rows = [{"prompt": f"What is {a} + 2?", "answer": a + 2, "tests": [a, {"k": [1.5, None]}]} for a in range(6)]
    rows[0]["hint"] = "add"  # only some rows have a hint
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "env.py").write_text(ENVIRONMENT)
    raw = {"stage": "grpo", "data": {"datasets": [{"path": str(tmp_path / "prompts.jsonl")}], "max_length": 2048,
                                     "chat_template": "chatml_tools", "val_size": 2, "cache": False},
           "agent": {"environment": environment, "max_tool_result_tokens": 32, **agent_keys},
           "train": {"max_steps": 2},
           "reward": {"function": "llmtune.rewards:format_reward"}}
    return load_recipe(raw=raw, stage="grpo")


def build(tmp_path, **kwargs):
    from llmtune.stages import STAGES

    recipe = grpo_recipe(tmp_path, **kwargs)
    return STAGES["grpo"](recipe, recipe_dir=tmp_path).build_data(make_tiny_tokenizer(), str(tmp_path))


def test_the_datasets_own_columns_reach_reset(tmp_path, monkeypatch):
    from llmtune.rl.agent import _row_columns
    from llmtune.rl.toolbox import make_toolbox

    monkeypatch.syspath_prepend(str(tmp_path))
    data = build(tmp_path)
    row = data.train[0]
    columns = _row_columns(row)
    answer = int(columns["prompt"].split()[2]) + 2
    assert (columns["answer"], columns["tests"]) == (answer, [answer - 2, {"k": [1.5, None]}])  # types kept
    assert columns["messages"] == [{"role": "user", "content": columns["prompt"]}]  # llmtune's fields win
    assert {"reference", "index"} <= set(columns) and "input_ids" not in columns
    toolbox, _ = make_toolbox([], _load(tmp_path, "Checker"), columns)
    env = toolbox.environment
    assert (env.answer, env.tests) == (answer, [answer - 2, {"k": [1.5, None]}])
    assert env.row["prompt"] == columns["prompt"] and "answer" not in env.row
    assert data.collator([row, data.train[1]])["input_ids"].shape[0] == 2  # collation ignores the columns
    from llmtune.rewards.sources import Scored

    [given] = Scored([row], ["x"]).extra()["rows"]  # what a reward function's `rows` holds
    assert given["columns"] == {"prompt": columns["prompt"], "answer": answer, "tests": columns["tests"]}


def _load(tmp_path, name):
    from llmtune.rl.toolbox import load_environment

    return load_environment(f"env.py:{name}", tmp_path)


def test_reset_needing_a_column_not_every_row_has_is_refused_before_any_weights(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ToolSetupError, match=r"NeedsHint.reset needs hint, which the prompt rows do not have; reset "
                                             r"receives the columns prompt, answer, tests, messages, reference, index\. "
                                             r".*\(only some rows have hint\)"):
        build(tmp_path, environment="env.py:NeedsHint")


def test_an_undetectable_tool_call_format_is_refused_before_any_weights(tmp_path, monkeypatch):
    from llmtune.stages import STAGES

    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = grpo_recipe(tmp_path)
    recipe.data.chat_template = BUILTIN_TEMPLATES["chatml_tools"].replace("tool_call>", "call>")
    with pytest.raises(RecipeError, match=r"agent.tool_parser: auto cannot tell"):
        STAGES["grpo"](recipe, recipe_dir=tmp_path).build_data(make_tiny_tokenizer(), str(tmp_path))
    recipe.agent.tool_parser = "hermes"  # said explicitly: fine
    STAGES["grpo"](recipe, recipe_dir=tmp_path).build_data(make_tiny_tokenizer(), str(tmp_path))
