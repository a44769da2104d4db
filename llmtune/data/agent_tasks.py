"""Generated tasks of the agent examples: problems made by this code from fixed seeds, shipped as builtin sources.

Two tasks that a small model cannot do without its tool, each a file in ``llmtune/data/builtin/`` (written by
:func:`write_builtin_files`: ``python scripts/make_agent_tasks.py``; ``tests/unit/data/test_agent_tasks.py``
regenerates them and compares) read in two views:

* ``agent-multiply.jsonl.gz``: ``{question, answer, expression}``, products with 4- to 6-digit answers (SmolLM2-135M
  does not get one right in its head). Rows 0-1999 ask for the product of two numbers, half in plain words
  (``"What is 347 times 829?"``), half as word problems with two numbers (:data:`TWO_FACTORS`, twelve phrasings);
  rows 2000-3999 are word problems whose answer is the product of the THREE numbers they give
  (``"A box holds 12 rows of 34 pencils. How many pencils are in 56 boxes?"``, eight templates): a model that learned
  to multiply the two numbers of a plain request must learn to find all three.
  ``builtin:multiply`` is the RL view (question -> prompt, answer -> reference: ``llmtune.rewards:gsm8k_reward``);
  ``builtin:multiply-calculator`` the SFT view (:func:`calculator_conversation`: one ``calculator`` call with the
  row's expression, its result, then ``#### <answer>``).
* ``agent-rooms.jsonl.gz``: ``{question, answer, rooms}``, a treasure hunt in the environment
  :class:`llmtune.tools.TreasureHunt`: ``rooms`` maps each room's name to its note, ``"Go to room <name>."`` or, in
  the last room, ``"The treasure is <number>."`` (a 4-digit number nothing but the environment knows); the question
  names the first room. Rows 0-1999 have 1 or 2 rooms (alternating), rows 2000-3999 3 rooms, so 3 rounds of
  environment feedback. ``builtin:rooms`` is the RL view (the ``rooms`` column goes to ``reset``);
  ``builtin:rooms-tools`` the SFT view (:func:`rooms_conversation`: the environment itself answers each ``enter``).

Every problem occurs once in its file (multiply: no factor pair twice, in either order; rooms: no start room with
the same treasure twice), so a row range never repeats a problem of another range: a warm start on rows 0-1999 and
RL on rows 2000-3999 (its held-out eval included, ``data.val_size``) share no problem.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import random
import re
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from llmtune.data.errors import RowError
from llmtune.tools import TreasureHunt, calculator

BUILTIN_DIR = Path(__file__).parent / "builtin"
MULTIPLY_FILE, ROOMS_FILE = "agent-multiply.jsonl.gz", "agent-rooms.jsonl.gz"
ROWS_PER_RANGE = 2000  # rows 0-1999: the warm start's range, rows 2000-3999: RL and its held-out eval
MULTIPLY_SEED, ROOMS_SEED = 39, 3939

TWO_FACTORS = ("What is {a} * {b}?", "What is {a} times {b}?", "Multiply {a} by {b}.",
         "Compute the product of {a} and {b}.", "What is {a} multiplied by {b}?", "Calculate {a} x {b}.",
         "A crate holds {a} bottles. How many bottles are in {b} crates?",
         "Each of {b} workers earns {a} coins a day. How many coins do they earn together in one day?",
         "A train car seats {a} people. How many people can {b} train cars seat?",
         "A book has {a} pages. How many pages are in {b} copies of the book?",
         "A factory makes {a} toys every hour. How many toys does it make in {b} hours?",
         "A bus travels {a} km every day. How many km does it travel in {b} days?")
THREE_FACTORS = ("A box holds {a} rows of {b} pencils. How many pencils are in {c} boxes?",
        "A school has {a} classes of {b} students. Each student buys {c} stickers. How many stickers do they buy?",
        "A warehouse has {a} shelves with {b} crates on each shelf, and each crate holds {c} cans. How many cans are "
        "there?",
        "A farm has {a} fields with {b} rows of {c} plants in each field. How many plants are there?",
        "A hotel has {a} floors with {b} rooms on each floor, and each room has {c} towels. How many towels are there?",
        "A library has {a} shelves. Each shelf holds {b} books of {c} pages. How many pages are there in all?",
        "A truck carries {a} boxes of {b} bags, and each bag holds {c} apples. How many apples does the truck carry?",
        "A city has {a} streets with {b} houses on each street and {c} windows in each house. How many windows are "
        "there?")
SYLLABLES = ("ka", "lo", "mi", "ru", "te", "vo", "zan", "pel", "dor", "fi", "gra", "hu", "jes", "nor", "qui", "sab",
             "tam", "ul", "wen", "yor", "bex", "cy", "dal", "esh")
GO_TO, TREASURE = "Go to room {}.", "The treasure is {}."
# The warm start's forks (rows below ROWS_PER_RANGE) are open: either room leads on the same way, and the
# demonstration enters the one named first or second at random. So the warm start learns that a note can name two
# rooms and that it must enter one, with no reason to prefer either: it samples both, and RL (rows from
# ROWS_PER_RANGE, FORKS) teaches it to read which one the note warns against.
OPEN_FORK = "Room {} or room {}: both lead to the treasure."
# Fork notes of the RL hunts: none says "Go to room <next>", the warm start's phrase (a model copying the room after it
# would pass without reading the warning); two name the decoy first, two the right room first (a model that always
# takes the first or the last room it reads gets half of them).
FORKS = ("Skip room {decoy}; the path goes on to room {next}.", "Room {next} is safe. Room {decoy} is a trap.",
         "Room {decoy} is a dead end; the way on is room {next}.",
         "The treasure lies beyond room {next}, not room {decoy}.")


def multiply_rows(n: int = 2 * ROWS_PER_RANGE, seed: int = MULTIPLY_SEED) -> list[dict]:
    """The rows of ``agent-multiply.jsonl.gz``: ``{question, answer, expression}``.

    Args:
        n: rows; the first :data:`ROWS_PER_RANGE` ask for ``a * b`` in one of the :data:`TWO_FACTORS` phrasings
            (``a`` in 100-999, ``b`` in 11-999), the rest are :data:`THREE_FACTORS` word problems whose answer is
            ``a * b * c`` (each in 11-99).
        seed: the generator's seed (the same seed gives the same rows).

    Returns:
        ``n`` rows, no factors twice (in any order); ``answer`` is the product as text, ``expression`` the factors
        joined by ``" * "`` in the order the question gives them.
    """
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    rows = []
    while len(rows) < n:
        plain = len(rows) < ROWS_PER_RANGE
        factors = (rng.randint(100, 999), rng.randint(11, 999)) if plain else tuple(rng.randint(11, 99)
                                                                                     for _ in range(3))
        if tuple(sorted(factors)) in seen:
            continue
        seen.add(tuple(sorted(factors)))
        question = rng.choice(TWO_FACTORS if plain else THREE_FACTORS).format(**dict(zip("abc", factors)))
        rows.append({"question": question, "answer": str(math.prod(factors)),
                     "expression": " * ".join(re.findall(r"\d+", question))})  # in the question's order
    return rows


def rooms_rows(n: int = 2 * ROWS_PER_RANGE, seed: int = ROOMS_SEED) -> list[dict]:
    """The rows of ``agent-rooms.jsonl.gz``: ``{question, answer, rooms, path}``.

    Args:
        n: rows; the first :data:`ROWS_PER_RANGE` are hunts through 1, 2 or 3 rooms (in turn) whose notes say
            ``"Go to room <next>."`` or, half of them, are open forks (:data:`OPEN_FORK`: the route's next room and
            another whose note is the same, named in random order; ``path`` takes the route's); the rest go
            through 3 rooms whose first two notes are forks (:data:`FORKS`): they name the next room and a decoy,
            whose branch is as long as the rest of the path (plain notes) and ends with a false treasure, so that
            every route takes 3 rooms and only the right one finds the treasure.
        seed: the generator's seed.

    Returns:
        ``n`` rows; room names are two :data:`SYLLABLES` (distinct within a row), treasures are in 1000-9999 (the
        false ones differ from the true one), no (first room, treasure) twice; ``path`` lists the rooms of the
        right route, ``rooms`` maps every room (decoys included) to its note.
    """
    rng = random.Random(seed)
    seen: set[tuple[str, int]] = set()
    rows = []
    while len(rows) < n:
        forks = len(rows) >= ROWS_PER_RANGE
        hops = 3 if forks else 1 + len(rows) % 3
        names: list[str] = []

        def room() -> str:
            while True:
                name = (rng.choice(SYLLABLES) + rng.choice(SYLLABLES)).capitalize()
                if name not in names:
                    names.append(name)
                    return name

        path = [room() for _ in range(hops)]
        treasure = rng.randint(1000, 9999)
        if (path[0], treasure) in seen:
            continue
        seen.add((path[0], treasure))
        rooms = {}
        twins = []  # (an open fork's other room, the route's room beside it): the other leads on the same way
        for k, name in enumerate(path[:-1]):
            if not forks and rng.random() < 0.5:  # an open fork: the route's next room and another, in random order
                pair = [path[k + 1], room()]
                twins.append((pair[1], pair[0]))
                rng.shuffle(pair)
                rooms[name] = OPEN_FORK.format(*pair)
                continue
            if not forks:
                rooms[name] = GO_TO.format(path[k + 1])
                continue
            decoy = room()
            rooms[name] = rng.choice(FORKS).format(next=path[k + 1], decoy=decoy)
            for _ in range(hops - k - 2):  # the decoy's branch: as many rooms as the rest of the path
                after = room()
                rooms[decoy] = GO_TO.format(after)
                decoy = after
            false = treasure
            while false == treasure:
                false = rng.randint(1000, 9999)
            rooms[decoy] = TREASURE.format(false)
        rooms[path[-1]] = TREASURE.format(treasure)
        for other, twin in twins:
            rooms[other] = rooms[twin]
        rows.append({"question": f"Find the treasure. Start in room {path[0]}.", "answer": str(treasure),
                     "rooms": rooms, "path": path})
    return rows


def _text(row: dict, field: str, kind: type = str):
    value = row.get(field)
    if not isinstance(value, kind) or not value:
        what = "a non-empty string" if kind is str else "a non-empty object {room: note}"
        raise RowError(f"missing field '{field}'", f"field '{field}' must be {what}")
    return value


@lru_cache(maxsize=None)
def _schemas(which: str) -> tuple[str, ...]:
    """The tool schemas the agent recipes show the policy (JSON text, cached): the calculator's, or the
    :class:`~llmtune.tools.TreasureHunt` environment's methods'."""
    from transformers.utils import get_json_schema

    if which == "calculator":
        return (json.dumps(get_json_schema(calculator)),)
    return (json.dumps(get_json_schema(TreasureHunt.enter)),)


def _call(name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def calculator_conversation(row: dict) -> dict:
    """A ``{question, answer, expression}`` row as a calculator tool conversation (``builtin:multiply-calculator``):
    user = the question; assistant = one ``calculator`` call with the expression; tool = the calculator's result
    (computed here, never copied from the row); assistant = ``#### <result>``.

    Returns:
        A ``messages`` row ``{"messages": [...], "tools": [calculator schema]}``.

    Raises:
        RowError: a field missing (a bad row), or the calculator's result differs from ``answer``.
    """
    question, answer, expression = _text(row, "question"), _text(row, "answer"), _text(row, "expression")
    try:
        result = calculator(expression)
    except ValueError as exc:
        raise RowError("bad expression", f"calculator({expression!r}) fails: {exc}") from None
    if result != answer:
        raise RowError("wrong answer", f"calculator({expression!r}) = {result}, but the row's answer is {answer}")
    return {"messages": [{"role": "user", "content": question}, _call("calculator", {"expression": expression}),
                         {"role": "tool", "name": "calculator", "content": result},
                         {"role": "assistant", "content": f"#### {result}"}],
            "tools": [json.loads(s) for s in _schemas("calculator")]}


def rooms_conversation(row: dict) -> dict:
    """A ``{question, answer, rooms, path}`` row as a conversation with :class:`~llmtune.tools.TreasureHunt`
    (``builtin:rooms-tools``): user = the question; then one ``enter`` call per room of the right route (``path``),
    each answered by the environment itself; then ``#### <treasure>``.

    Returns:
        A ``messages`` row ``{"messages": [...], "tools": [the enter schema]}``.

    Raises:
        RowError: a field missing; a route that does not start in the question's room, a note that does not name the
            route's next room, or a last note other than the row's treasure.
    """
    question, answer, rooms = _text(row, "question"), _text(row, "answer"), _text(row, "rooms", dict)
    path = row.get("path")
    if not isinstance(path, list) or not path or not question.endswith(f" room {path[0]}."):
        raise RowError("broken hunt", f"field 'path' must list the rooms of the route from the question's room, got "
                       f"{path!r}")
    env = TreasureHunt()
    env.reset(rooms=rooms)
    messages: list[dict] = [{"role": "user", "content": question}]
    for k, room in enumerate(path):
        try:
            note = env.enter(room)
        except ValueError as exc:
            raise RowError("broken hunt", f"room {room!r}: {exc}") from None
        if k + 1 < len(path) and path[k + 1] not in re.findall(r"[Rr]oom (\w+)", note):
            raise RowError("broken hunt", f"the note of room {room!r} ({note!r}) does not name room {path[k + 1]!r}")
        messages += [_call("enter", {"room": room}), {"role": "tool", "name": "enter", "content": note}]
    if note != TREASURE.format(answer):
        raise RowError("broken hunt", f"the hunt ends with {note!r}, not the treasure {answer}")
    messages.append({"role": "assistant", "content": f"#### {answer}"})
    return {"messages": messages, "tools": [json.loads(s) for s in _schemas("rooms")]}


def _jsonl_gz(rows: list[dict]) -> bytes:
    """Rows as gzipped JSON lines with a fixed header (no file name, mtime 0): the same rows, the same bytes."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    return buffer.getvalue()


def builtin_files() -> Iterator[tuple[str, bytes]]:
    """``(file name, content)`` of the shipped task files, as :func:`write_builtin_files` writes them."""
    yield MULTIPLY_FILE, _jsonl_gz(multiply_rows())
    yield ROOMS_FILE, _jsonl_gz(rooms_rows())


def write_builtin_files(directory: str | Path = BUILTIN_DIR) -> list[Path]:
    """Write the task files into ``directory`` (``python scripts/make_agent_tasks.py`` regenerates the shipped ones
    and prints the SHA-256 that ``BUILTIN_SOURCES`` of :mod:`llmtune.data.sources` records)."""
    written = []
    for name, content in builtin_files():
        path = Path(directory) / name
        path.write_bytes(content)
        written.append(path)
    return written

