#!/usr/bin/env python
"""Which room does a model enter at a fork of the rooms hunts? Teacher-forced, per fork phrasing.

For each fork on the right route of ``builtin:rooms`` hunts (rows from ``--start``), the conversation up to the
fork's note is rendered with ``chatml_tools`` and the model scores two continuations, ``enter(<right room>)`` and
``enter(<decoy>)`` (sum of the token log-probs of the whole rendered text; the prefix is the same); the fork counts
as right when the right room scores higher. Prints, per phrasing (``llmtune.data.agent_tasks.FORKS``), the share
right and the mean probability of sampling the right room rather than the decoy at ``--temperature``
(``sigmoid((logp_right - logp_decoy) / T)``): RL can sharpen a fork whose probability is well above 0 (a group's
samples then differ), not one the model never samples. ``--phrasing`` scores other phrasings on the same forks (the
fork's note is rewritten; the notes before it are kept).

    python scripts/rooms_forks.py runs/quickstart_agent_rooms_pipeline/sft/adapter --hunts 150

About 1.3 s per fork and phrasing on 2 CPU cores (150 hunts, 300 forks: ~6 min; each ``--phrasing`` adds as
much). Used for issue 39 (docs/agents.md, the rooms example).
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import math
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
    ap.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    ap.add_argument("--phrasing", action="append", default=[],
                    help="another fork phrasing to score, with {next} and {decoy} (repeatable)")
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

    def ids_of(messages: list[dict]) -> list[int]:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
        return tokenizer(text, add_special_tokens=False).input_ids

    def margin(messages: list[dict], good: str, decoy: str) -> float:
        """logp(enter good) - logp(enter decoy); the shared prefix runs once (its log-prob cancels)."""
        a, b = (ids_of([*messages, agent_tasks._call("enter", {"room": r})]) for r in (good, decoy))
        n = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        with torch.no_grad():
            out = model(torch.tensor([a[:n]]), use_cache=True)
            total = []
            prefix = out.cache if hasattr(out, "cache") else out.past_key_values
            for ids in (a, b):
                rest = torch.tensor([ids[n:]])
                logits = torch.cat([out.logits[:, -1:], model(rest, cache=copy.deepcopy(prefix)).logits[:, :-1]], 1)
                total.append(logits[0].float().log_softmax(-1).gather(1, rest[0, :, None]).sum().item())
        return total[0] - total[1]

    phrasings = (*agent_tasks.FORKS, *args.phrasing)
    right = collections.Counter()
    prob = collections.Counter()
    seen = collections.Counter()
    for row in agent_tasks.rooms_rows()[start:start + args.hunts]:
        messages = [{"role": "user", "content": row["question"]}]
        for room in row["path"][:-1]:
            note = row["rooms"][room]
            fork = fork_of(note, agent_tasks.FORKS)
            call = agent_tasks._call("enter", {"room": room})
            if fork is not None:
                own, good, decoy = fork
                for i, phrasing in enumerate(phrasings):
                    if i < len(agent_tasks.FORKS) and i != own:
                        continue  # the shipped phrasings: each on its own forks only
                    text = phrasing.format(next=good, decoy=decoy)
                    d = margin([*messages, call, {"role": "tool", "name": "enter", "content": text}], good, decoy)
                    seen[i] += 1
                    right[i] += d > 0
                    prob[i] += 1 / (1 + math.exp(-d / args.temperature))
            messages = [*messages, call, {"role": "tool", "name": "enter", "content": note}]
    print(f"share right, mean P(right room) at T={args.temperature}, forks, phrasing")
    for i, phrasing in enumerate(phrasings):
        if seen[i]:
            print(f"{right[i] / seen[i]:.2f}  {prob[i] / seen[i]:.2f}  {seen[i]:4d}  {phrasing}")
    shipped = [i for i in range(len(agent_tasks.FORKS)) if seen[i]]
    total = sum(seen[i] for i in shipped)
    print(f"shipped forks: right {sum(right[i] for i in shipped) / max(total, 1):.2f}, "
          f"P(right) {sum(prob[i] for i in shipped) / max(total, 1):.2f} ({total} forks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
