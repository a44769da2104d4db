"""The agent examples' generated tasks (llmtune.data.agent_tasks): the shipped files are what the code writes, row
ranges share no problem, the answers are right, and the builtin views give what the recipes train and score on."""

from __future__ import annotations

import gzip
import json
import math
import re

import pytest
from transformers.utils import get_json_schema

from llmtune.config.schema import DatasetConfig
from llmtune.data import agent_tasks, build_prompt_data, build_sft_data, render_labels
from llmtune.data.agent_tasks import (
    FORKS,
    OPEN_FORK,
    ROWS_PER_RANGE,
    calculator_conversation,
    multiply_rows,
    rooms_conversation,
    rooms_rows,
)
from llmtune.data.errors import RowError
from llmtune.data.sources import BUILTIN_SOURCES, builtin_file, read_source
from llmtune.rewards import gsm8k_reward
from llmtune.tools import TreasureHunt, calculator
from llmtune.utils import content_sha256

N = 2 * ROWS_PER_RANGE


def shipped(name: str) -> list[dict]:
    with gzip.open(agent_tasks.BUILTIN_DIR / name, "rt") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize(("builtin", "name", "make"), [("multiply", agent_tasks.MULTIPLY_FILE, multiply_rows),
                                                       ("rooms", agent_tasks.ROOMS_FILE, rooms_rows)])
def test_the_shipped_file_is_what_the_generator_writes_from_its_seed(builtin, name, make, tmp_path):
    rows = make()
    assert rows == make()  # deterministic: the seed fixes every row
    assert shipped(name) == rows
    assert make(seed=1) != rows
    written = {p.name: p for p in agent_tasks.write_builtin_files(tmp_path)}
    assert written[name].read_bytes() == (agent_tasks.BUILTIN_DIR / name).read_bytes()  # byte for byte (mtime 0)
    spec = BUILTIN_SOURCES[builtin]
    assert builtin_file(spec) == agent_tasks.BUILTIN_DIR / name
    assert content_sha256(builtin_file(spec)) == spec.sha256 == BUILTIN_SOURCES[f"{builtin}-" + (
        "calculator" if builtin == "multiply" else "tools")].sha256


def test_multiply_rows_two_factors_then_three_every_product_once_and_right():
    rows = multiply_rows()
    assert len(rows) == N
    factors = [tuple(int(x) for x in r["expression"].split(" * ")) for r in rows]
    assert {len(f) for f in factors[:ROWS_PER_RANGE]} == {2} and {len(f) for f in factors[ROWS_PER_RANGE:]} == {3}
    assert all(100 <= max(f) <= 999 and 11 <= min(f) for f in factors[:ROWS_PER_RANGE])  # a * b, either order
    assert all(11 <= x <= 99 for f in factors[ROWS_PER_RANGE:] for x in f)
    assert len({tuple(sorted(f)) for f in factors}) == N  # no problem twice, in any order: ranges are disjoint
    for row, f in zip(rows, factors):
        assert row["answer"] == str(math.prod(f)) == calculator(row["expression"])
        numbers = [int(x) for x in re.findall(r"\d+", row["question"])]
        assert numbers == list(f)  # the question gives exactly these numbers, in the expression's order
    assert min(len(r["answer"]) for r in rows) >= 4  # too long to multiply in the head
    assert {r["question"].split(" ")[1] for r in rows[ROWS_PER_RANGE:]} == {
        "box", "school", "warehouse", "farm", "hotel", "library", "truck", "city"}  # all eight templates


def test_hand_checked_rows_and_the_reward_of_right_and_wrong_answers():
    rows = multiply_rows()
    assert rows[ROWS_PER_RANGE] == {
        "question": "A truck carries 62 boxes of 39 bags, and each bag holds 68 apples. How many apples does the truck "
                    "carry?",
        "answer": "164424", "expression": "62 * 39 * 68"}  # 62 * 39 = 2418; 2418 * 68 = 164424
    reference = rows[ROWS_PER_RANGE]["answer"]
    assert gsm8k_reward([""] * 4, ["#### 164424", "#### 164,424", "#### 2418", "The answer is 164424"],
                        [reference] * 4) == [1.0, 1.0, 0.0, 0.0]
    hunt = rooms_rows()[ROWS_PER_RANGE + 1]
    assert hunt == {"question": "Find the treasure. Start in room Eshru.", "answer": "3313",
                    "rooms": {"Eshru": "Skip room Zante; the path goes on to room Sabdal.", "Zante": "Go to room Katam.",
                              "Katam": "The treasure is 6797.",  # the decoy's branch: as long, a false treasure
                              "Sabdal": "Room Doryor is a dead end; the way on is room Rudor.",
                              "Doryor": "The treasure is 6218.", "Rudor": "The treasure is 3313."},
                    "path": ["Eshru", "Sabdal", "Rudor"]}
    assert gsm8k_reward([""] * 3, ["#### 3313", "#### 6797", ""], [hunt["answer"]] * 3) == [1.0, 0.0, 0.0]


def test_rooms_rows_plain_hunts_then_forks_whose_every_route_takes_three_rooms():
    rows = rooms_rows()
    assert len(rows) == N
    assert [len(r["path"]) for r in rows[:4]] == [1, 2, 3, 1]
    assert {len(r["path"]) for r in rows[ROWS_PER_RANGE:]} == {3}
    assert len({(r["question"], r["answer"]) for r in rows}) == N  # no hunt twice: the ranges share none
    for i, row in enumerate(rows):
        assert row["question"] == f"Find the treasure. Start in room {row['path'][0]}."
        assert row["rooms"][row["path"][-1]] == f"The treasure is {row['answer']}." and 1000 <= int(row["answer"])
        routes = walk(row["rooms"], row["path"][0])
        treasures = [r[-1] for r in routes]
        if i < ROWS_PER_RANGE:  # every route (an open fork takes either room) finds the treasure, as long as the path
            assert [row["rooms"][r] for r in row["path"]] in routes
            assert {len(r) for r in routes} == {len(row["path"])} and "not" not in str(row["rooms"])
            assert set(treasures) == {f"The treasure is {row['answer']}."}
            assert len(routes) == 2 ** sum(row["rooms"][r].startswith("Room ") for r in row["path"])
            continue
        assert treasures.count(f"The treasure is {row['answer']}.") == 1  # one route finds it
        # two forks on the route (a decoy's branch has none): three routes, each through three rooms
        assert len(routes) == 3 and {len(r) for r in routes} == {3}
        assert len(set(treasures)) == 3 and all(t.startswith("The treasure is ") for t in treasures)
    forks = [note for r in rows[ROWS_PER_RANGE:] for note in r["rooms"].values()
             if len(re.findall(r"[Rr]oom \w+", note)) == 2]
    assert len(forks) == 2 * (N - ROWS_PER_RANGE)
    # every fork phrasing occurs, and none is the warm start's "Go to room <next>" (copying it would skip reading)
    assert {re.sub(r"([Rr]oom) \w+", r"\1 {}", note) for note in forks} == {
        re.sub(r"\{\w+\}", "{}", fork) for fork in FORKS}
    assert not any("Go to room" in note for note in forks)
    # the warm start's open forks: half of its notes before the last room, the route's room named first in about half
    # of them (a demonstration that always took the first room named would teach a position, not "either")
    notes = [(r["rooms"][a], b) for r in rows[:ROWS_PER_RANGE] for a, b in zip(r["path"], r["path"][1:])]
    open_forks = [(note, b) for note, b in notes if note.startswith("Room ")]
    assert all(note == OPEN_FORK.format(*re.findall(r"[Rr]oom (\w+)", note)) for note, _ in open_forks)
    assert 0.45 < len(open_forks) / len(notes) < 0.55
    assert 0.45 < sum(note.split()[1] == b for note, b in open_forks) / len(open_forks) < 0.55


def walk(rooms: dict, room: str) -> list[list[str]]:
    """Every route from ``room``: the notes read along it, a fork taking either room it names."""
    note = rooms[room]
    if note.startswith("The treasure is "):
        return [[note]]
    names = re.findall(r"[Rr]oom (\w+)", note)
    return [[note, *route] for name in names for route in walk(rooms, name)]


def test_calculator_conversation_calls_once_and_answers_with_the_calculator_s_result():
    row = {"question": "What is 12 times 34?", "answer": "408", "expression": "12 * 34"}
    assert calculator_conversation(row) == {
        "messages": [{"role": "user", "content": "What is 12 times 34?"},
                     {"role": "assistant", "content": "", "tool_calls": [
                         {"type": "function", "function": {"name": "calculator",
                                                           "arguments": {"expression": "12 * 34"}}}]},
                     {"role": "tool", "name": "calculator", "content": "408"},
                     {"role": "assistant", "content": "#### 408"}],
        "tools": [get_json_schema(calculator)]}
    with pytest.raises(RowError, match="= 408, but the row's answer is 407"):
        calculator_conversation({**row, "answer": "407"})
    with pytest.raises(RowError, match="field 'expression'"):
        calculator_conversation({"question": "q", "answer": "1"})


def test_rooms_conversation_takes_the_right_route_with_the_environment_s_own_answers():
    hunt = rooms_rows()[ROWS_PER_RANGE + 1]
    messages = rooms_conversation(hunt)["messages"]
    assert [m["role"] for m in messages] == ["user"] + ["assistant", "tool"] * 3 + ["assistant"]
    entered = [m["tool_calls"][0]["function"]["arguments"]["room"] for m in messages if m.get("tool_calls")]
    assert entered == ["Eshru", "Sabdal", "Rudor"]
    assert [m["content"] for m in messages if m["role"] == "tool"] == [
        "Skip room Zante; the path goes on to room Sabdal.", "Room Doryor is a dead end; the way on is room Rudor.",
        "The treasure is 3313."]
    assert messages[-1] == {"role": "assistant", "content": "#### 3313"}
    assert rooms_conversation(hunt)["tools"] == [get_json_schema(TreasureHunt.enter)]
    with pytest.raises(RowError, match="there is no room named 'Sabdal'"):
        rooms_conversation({**hunt, "rooms": {"Eshru": "Go to room Sabdal, not room Zante."}})
    with pytest.raises(RowError, match="does not name room 'Rudor'"):
        rooms_conversation({**hunt, "path": ["Eshru", "Zante", "Rudor"]})
    with pytest.raises(RowError, match="not the treasure 1"):
        rooms_conversation({**hunt, "answer": "1"})


def test_treasure_hunt_environment_knows_only_its_rooms():
    env = TreasureHunt()
    env.reset(rooms={"Kalo": "Go to room Mite.", "Mite": "The treasure is 1234."})
    assert env.enter("Kalo") == "Go to room Mite." and env.enter("Mite") == "The treasure is 1234."
    assert env.enter(" mite") == env.enter("MITE ") == "The treasure is 1234."  # spaces and case do not matter
    with pytest.raises(ValueError, match="there is no room named 'Kal'"):
        env.enter("Kal")


def test_builtin_views_give_sft_conversations_and_rl_prompts_with_references_and_rooms(tok, cfg):
    sft = read_source(DatasetConfig(path="builtin:multiply-calculator", max_samples=ROWS_PER_RANGE), 0)
    assert len(sft.rows) == ROWS_PER_RANGE and sft.format == "messages" and not sft.bad
    data = build_sft_data(cfg({"path": "builtin:multiply-calculator", "max_samples": 16}, chat_template="chatml_tools",
                              max_length=4096), tok)
    shown = render_labels(data.train[0]["input_ids"], data.train[0]["labels"], tok)
    assert "«<tool_call>\n{\"name\": \"calculator\"" in shown and "«#### " in shown
    rl = build_prompt_data(cfg({"path": "builtin:multiply", "skip_rows": ROWS_PER_RANGE}, chat_template="chatml_tools",
                               max_length=4096, val_size=24), tok)
    assert rl.report.sources[0].skipped_rows == ROWS_PER_RANGE and len(rl.train) + len(rl.eval) == ROWS_PER_RANGE
    sft_questions = {r["messages"][0]["content"] for r in sft.rows}
    held_out = [json.loads(r["messages"])[-1]["content"] for r in rl.eval]
    assert len(held_out) == 24 and not sft_questions & set(held_out)
    assert all(r["reference"].isdigit() for r in rl.eval)
    rooms = build_prompt_data(cfg({"path": "builtin:rooms", "skip_rows": ROWS_PER_RANGE, "max_samples": 8},
                                  chat_template="chatml_tools", max_length=4096), tok, keep_columns=True)
    from llmtune.data.prompts import raw_columns

    row = rooms.train[0]
    assert set(raw_columns(row)["rooms"].values()) >= {f"The treasure is {row['reference']}."}
    tools = read_source(DatasetConfig(path="builtin:rooms-tools", max_samples=4), 0)
    assert [sum(bool(m.get("tool_calls")) for m in r["messages"]) for r in tools.rows] == [1, 2, 3, 1]
    forks = read_source(DatasetConfig(path="builtin:rooms-tools", skip_rows=ROWS_PER_RANGE), 0)
    assert len(forks.rows) == ROWS_PER_RANGE and not forks.bad  # every fork hunt has its right route
