"""Reward functions: the built-in ones recipes name (``llmtune.rewards:gsm8k_reward``, ``llmtune.rewards:format_reward``),
and, in submodules, loading and calling a user's ``module:function`` (:mod:`llmtune.rewards.functions`) and the reward
sources of online RL (:mod:`llmtune.rewards.sources`: functions and reward-model runs, weighted).

A reward function scores B generated completions: ``fn(prompts, completions[, references]) -> B numbers``
where ``prompts[b]`` is the last user message of prompt b, ``completions[b]`` the generated text (decoded
without special tokens) and ``references[b]`` the dataset's answer for that prompt (None when the data has
none). ``references`` is passed only to functions that accept it (a ``references`` parameter or
``**kwargs``). In online RL a function may return None for a completion it cannot score (it abstains): see
:class:`llmtune.rewards.sources.RewardSources`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal, InvalidOperation

# After the last '####': optional sign and '$' (either order), then digits with thousands commas and decimals.
_ANSWER = re.compile(r"\s*([-+]?)\s*\$?\s*([-+]?)\s*(\d[\d,]*(?:\.\d*)?|\.\d+)")


def normalize_number(text: str) -> str | None:
    """A number written as in GSM8K, in one canonical form: ``"1,234.50"`` -> ``"1234.5"``, ``"3.0"`` -> ``"3"``,
    ``"-$5"`` -> ``"-5"``, ``"-0"`` -> ``"0"``; None when ``text`` does not start with a number.

    Commas are thousands separators and are removed; a trailing period ends a sentence and is dropped.
    """
    match = _ANSWER.match(text)
    if match is None:
        return None
    sign = "-" if "-" in match.group(1) + match.group(2) else ""
    digits = match.group(3).replace(",", "").rstrip(".")
    try:
        value = Decimal(sign + digits)
    except InvalidOperation:
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_final_answer(text: str) -> str | None:
    """The number after the LAST ``####`` in ``text``, normalised with :func:`normalize_number`.

    Examples: ``"... #### 72"`` -> ``"72"``; ``"#### $1,234.50."`` -> ``"1234.5"``; ``"#### 3.0"`` -> ``"3"``;
    ``"#### 1 #### -5 apples"`` -> ``"-5"``; ``"The answer is 5"`` -> None (no ``####``);
    ``"#### five"`` -> None (no number right after the last ``####``).
    """
    if "####" not in text:
        return None
    return normalize_number(text.rsplit("####", 1)[1])


# Which prompt data carries the reference answers a checking reward function needs (llmtune.data.prompts).
REFERENCE_DATA = (
    "The reference of a prompt row is its answer: builtin:gsm8k (the `answer` column, ending in '#### <number>'); "
    "a messages/sharegpt row's final assistant turn; alpaca `output`; prompt_completion `completion`; preference "
    "`chosen`. A bare {prompt} row has none: add the answer as the final assistant turn (messages format) or as "
    "`completion` (prompt_completion format) in the data.datasets file")


def gsm8k_reward(prompts: Sequence[str], completions: Sequence[str], references: Sequence[str | None]) -> list[float]:
    """GSM8K correctness: ``1.0`` when the completion's final answer equals the reference's, else ``0.0``.

    Rule: ``extract_final_answer(completion)`` (the number right after the last ``####``, commas, ``$``,
    spaces and a trailing period removed, ``3.0`` == ``3``) must equal the reference's final answer, i.e.
    ``extract_final_answer(reference)`` for a full GSM8K solution ending with ``#### <number>``, or the
    reference itself when it is a bare number (``"72"``). A completion without ``#### <number>`` scores 0.

    Args:
        prompts: B prompts (unused).
        completions: B generated texts.
        references: B reference answers (the GSM8K ``answer`` column).

    Returns:
        B floats in {0.0, 1.0}.

    Raises:
        ValueError: ``references`` is None or has another length, or a reference holds no number (the data
            does not carry GSM8K answers; the message names the index).
    """
    if references is None or len(references) != len(completions):
        got = "None" if references is None else f"{len(references)}"
        raise ValueError(f"gsm8k_reward needs one reference answer per completion: {len(completions)} completions, "
                         f"references {got}. {REFERENCE_DATA}")
    rewards = []
    for b, (completion, reference) in enumerate(zip(completions, references)):
        expected = None
        if reference is not None:
            expected = extract_final_answer(reference) if "####" in reference else normalize_number(reference)
        if expected is None:
            what = "none (the prompt data gives no reference)" if reference is None else repr(str(reference)[-80:])
            raise ValueError(f"gsm8k_reward: reference {b} has no final answer ('#### <number>' or a bare number): "
                             f"{what}. {REFERENCE_DATA}")
        rewards.append(1.0 if extract_final_answer(completion) == expected else 0.0)
    return rewards


# The whole completion ends with '#### <number>' (optional sign/$/thousands commas/decimals, a closing period).
_FINAL_ANSWER = re.compile(r"####\s*[-+]?\s*\$?\s*[-+]?\s*(?:\d[\d,]*(?:\.\d+)?|\.\d+)\s*\.?\s*\Z")


def format_reward(prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
    """GSM8K answer format: ``1.0`` when a completion ENDS with ``#### <number>`` (nothing but whitespace or a
    period after the number), else ``0.0``; the number is not checked (that is :func:`gsm8k_reward`).

    Examples: ``"5 + 3 = 8. #### 8"`` -> 1.0; ``"#### $1,234.50."`` -> 1.0; ``"#### 8 apples"`` -> 0.0;
    ``"The answer is 8"`` -> 0.0; ``"#### 8 #### 9"`` -> 1.0 (the last one ends the text).

    Args:
        prompts: B prompts (unused). completions: B generated texts.

    Returns:
        B floats in {0.0, 1.0}.
    """
    return [1.0 if _FINAL_ANSWER.search(c) else 0.0 for c in completions]
