#!/usr/bin/env python
"""Which room does a model enter at a fork of the rooms hunts? Teacher-forced, per fork phrasing.

For each fork on the right route of ``builtin:rooms`` hunts (rows from ``--start``), the conversation up to the
fork's note is rendered with ``chatml_tools`` and the model scores two continuations, ``enter(<right room>)`` and
``enter(<decoy>)`` (sum of the token log-probs of the whole rendered text; the prefix is the same); the fork counts
as right when the right room scores higher. Prints the share right per phrasing (``llmtune.data.agent_tasks.FORKS``).

    python scripts/rooms_forks.py runs/quickstart_agent_rooms_pipeline/sft/adapter --hunts 150

About 9 min for 150 hunts (300 forks) on 2 CPU cores. Used for issue 39 (docs/agents.md, the rooms example).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def fork_of(note: str, forks: tuple[str, ...]) -> tuple[int, str, str] | None:
    """``(phrasing index, right room, decoy)`` of a fork note, or None for a plain note."""
    for i, fork in enumerate(forks):
        pattern = re.escape(fork).replace(re.escape("{next}"), r"(?P<next>\w+)")
        match = re.fullmatch(pattern.replace(re.escape("{decoy}"), r"(?P<decoy>\w+)"), note)
        if match:
            return i, match["next"], match["decoy"]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("adapter", help="a LoRA adapter directory of the embedded model, or - for the base model")
    ap.add_argument("--hunts", type=int, default=150, help="hunts to score (default 150)")
    ap.add_argument("--start", type=int, default=None, help="first row (default: the first row with forks, 2000)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    from llmtune.config.schema import ModelConfig, PrecisionConfig
    from llmtune.data import agent_tasks
    from llmtune.data.templates import resolve_chat_template
    from llmtune.models.load import load_model, load_tokenizer

    cfg = ModelConfig(name_or_path="builtin:smollm2-135m-instruct")
    tokenizer = load_tokenizer(cfg)
    tokenizer.chat_template = resolve_chat_template("chatml_tools")
    model = load_model(cfg, PrecisionConfig())
    if args.adapter != "-":
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter)
    model.eval()
    tools = [json.loads(s) for s in agent_tasks._schemas("rooms")]
    start = agent_tasks.ROWS_PER_RANGE if args.start is None else args.start

    def logp(messages: list[dict]) -> float:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        with torch.no_grad():
            logps = model(ids).logits[0, :-1].float().log_softmax(-1)
        return logps.gather(1, ids[0, 1:, None]).sum().item()

    right = collections.Counter()
    seen = collections.Counter()
    for row in agent_tasks.rooms_rows()[start:start + args.hunts]:
        messages = [{"role": "user", "content": row["question"]}]
        for room in row["path"][:-1]:
            note = row["rooms"][room]
            messages = [*messages, agent_tasks._call("enter", {"room": room}),
                        {"role": "tool", "name": "enter", "content": note}]
            fork = fork_of(note, agent_tasks.FORKS)
            if fork is None:
                continue
            i, good, decoy = fork
            seen[i] += 1
            right[i] += logp([*messages, agent_tasks._call("enter", {"room": good})]) > logp(
                [*messages, agent_tasks._call("enter", {"room": decoy})])
    for i, fork in enumerate(agent_tasks.FORKS):
        if seen[i]:
            print(f"{right[i] / seen[i]:.2f} ({right[i]}/{seen[i]})  {fork}")
    total = sum(seen.values())
    print(f"all forks {sum(right.values()) / max(total, 1):.2f} ({sum(right.values())}/{total})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
