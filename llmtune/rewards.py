"""Reward functions for PPO and GRPO: the GSM8K answer check and format, and loading/calling a user's
``module:function``.

A reward function scores B generated completions: ``fn(prompts, completions[, references]) -> B numbers``
where ``prompts[b]`` is the last user message of prompt b, ``completions[b]`` the generated text (decoded
without special tokens) and ``references[b]`` the dataset's answer for that prompt (None when the data has
none). ``references`` is passed only to functions that accept it (a ``references`` parameter or
``**kwargs``). The recipe names one with ``reward.function: module:function``. In online RL a function may return
None for a completion it cannot score (it abstains): see :class:`llmtune.rl.scoring.RewardSources`.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from collections.abc import Callable, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path

import torch
from llmtune.errors import LlmtuneError

# After the last '####': optional sign and '$' (either order), then digits with thousands commas and decimals.
_ANSWER = re.compile(r"\s*([-+]?)\s*\$?\s*([-+]?)\s*(\d[\d,]*(?:\.\d*)?|\.\d+)")


class RewardFunctionError(LlmtuneError, RuntimeError):
    """A reward function cannot be loaded, fails, or returns something other than B finite numbers."""


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


def reward_search_dirs(recipe_dir: str | Path | None) -> list[Path]:
    """Where a reward module is looked for, in order: the working directory, then the recipe's directory. The one
    rule of every command (``llmtune ppo/grpo``, ``validate``, ``rollout-server``) and of the pipeline (its stages and
    its pairs step: the pipeline recipe's directory)."""
    dirs = [Path.cwd().resolve()]
    if recipe_dir is not None and Path(recipe_dir).resolve() not in dirs:
        dirs.append(Path(recipe_dir).resolve())
    return dirs


def load_reward_function(spec: str, recipe_dir: str | Path | None = None) -> Callable:
    """Import the reward function named by ``spec`` and check that it can be called as a reward function.

    Args:
        spec: ``"package.module:function"`` (an attribute path such as ``module:Class.method`` works too) or
            ``"path/to/file.py:function"``.
        recipe_dir: the directory of the recipe that names it (None: a recipe without a file). A relative module
            or file is looked for in the working directory, then there (:func:`reward_search_dirs`; both are added
            to ``sys.path`` in that order).

    Returns:
        The callable.

    Raises:
        RewardFunctionError: ``spec`` is not ``module:function``; the module cannot be imported (the import
            error is shown, with the directories searched); the attribute is missing (close names listed) or not
            callable; its signature cannot take ``(prompts, completions)`` (:func:`check_reward_signature`).
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name.strip() or not attr.strip() or ":" in attr:
        raise RewardFunctionError(
            f"reward.function: {spec!r} is not 'module:function'; write e.g. 'llmtune.rewards:gsm8k_reward' or "
            "'my_rewards.py:score'."
        )
    module_name, attr = module_name.strip(), attr.strip()
    dirs = reward_search_dirs(recipe_dir)
    for d in map(str, dirs):
        if d not in sys.path:
            sys.path.append(d)
    module = _import_file(module_name, spec, dirs) if module_name.endswith(".py") else _import(module_name, spec, dirs)
    obj = module
    for i, part in enumerate(attr.split(".")):
        if not hasattr(obj, part):
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(part, names, n=5, cutoff=0.5)
            owner = ".".join([module_name, *attr.split(".")[:i]]) if i else module_name
            defined = ", ".join(n for n in names if callable(getattr(obj, n, None)))[:300] or "no public callables"
            hint = f"did you mean {', '.join(close)}?" if close else f"it defines: {defined}"
            raise RewardFunctionError(f"reward.function: {spec!r}: {owner} has no attribute {part!r}; {hint}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise RewardFunctionError(
            f"reward.function: {spec!r} is {type(obj).__name__}, not callable; name a function "
            "fn(prompts, completions, references) -> list[float]."
        )
    check_reward_signature(obj, spec)
    return obj


def check_reward_signature(fn: Callable, spec: str) -> None:
    """Refuse a reward function that cannot be called as llmtune calls it: ``fn(prompts, completions)``, plus
    ``references=...`` when it accepts them (:func:`accepts_references`). TRL's ``fn(completions, **kwargs)``
    is the common mistake: it would fail at the first rollout with a bare ``TypeError``.

    Raises:
        RewardFunctionError: naming the function's signature, the expected one and a wrapper that fixes it.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: checked when called
        return
    try:
        if accepts_references(fn):
            sig.bind(["prompt"], ["completion"], references=[None])
        else:
            sig.bind(["prompt"], ["completion"])
    except TypeError as exc:
        raise RewardFunctionError(
            f"reward.function: {spec!r} has the signature {getattr(fn, '__name__', 'fn')}{sig}, which cannot be "
            f"called as fn(prompts, completions[, references=...]) ({exc}). llmtune passes the B prompt texts, the B "
            "completion texts and, to a function with a `references` parameter or **kwargs, the B reference "
            "answers; it returns B numbers (None = abstain). A TRL-style fn(completions, **kwargs) can be wrapped: "
            "def reward(prompts, completions, **kwargs): return trl_fn(completions, **kwargs)") from None


def _searched(dirs: list[Path]) -> str:
    return " or ".join(str(d) for d in dirs)


def _import(module_name: str, spec: str, dirs: list[Path]):
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        raise RewardFunctionError(
            f"reward.function: {spec!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}. "
            f"Install it, or put {module_name.replace('.', '/')}.py in the working directory or next to the recipe "
            f"(searched: {_searched(dirs)})."
        ) from exc


def _import_file(path: str, spec: str, dirs: list[Path]):
    file = Path(path).expanduser()
    if not file.is_absolute():
        file = next((d / file for d in dirs if (d / file).is_file()), dirs[-1] / file)
    if not file.is_file():
        where = "" if Path(path).expanduser().is_absolute() else f" (searched: {_searched(dirs)})"
        raise RewardFunctionError(f"reward.function: {spec!r}: file {path} does not exist{where}; put it in the "
                                  "working directory or next to the recipe, or give its absolute path.")
    name = f"llmtune_reward_{file.stem}"
    module_spec = importlib.util.spec_from_file_location(name, file)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        raise RewardFunctionError(
            f"reward.function: {spec!r}: importing {file} failed: {type(exc).__name__}: {exc}"
        ) from exc
    sys.modules[name] = module
    return module


def accepts_references(fn: Callable) -> bool:
    """True when ``fn`` takes a ``references`` argument (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.name == "references" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def call_reward_function(
    fn: Callable, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str | None] | None = None,
    allow_abstain: bool = False,
) -> torch.Tensor:
    """Score B completions with ``fn`` and check the result.

    ``fn(prompts, completions, references=references)`` when ``fn`` accepts ``references``
    (:func:`accepts_references`), else ``fn(prompts, completions)``. With ``allow_abstain`` a value may be None:
    the function abstains on that completion (an unparsable answer, a sandbox timeout; TRL's reward functions do
    the same) and the result holds NaN there; a NaN or inf the function returns itself stays an error.

    Args:
        fn: the reward function (see :func:`load_reward_function`).
        prompts: B prompt texts. completions: B generated texts. references: B reference answers or None.
        allow_abstain: accept None values (online RL); otherwise None is an error.

    Returns:
        (B,) float32 tensor of rewards (on CPU); NaN exactly where ``fn`` returned None.

    Raises:
        RewardFunctionError: ``fn`` raised (its error is chained), or did not return B finite real numbers
            (or None with ``allow_abstain``) as a sequence or 1-D tensor/array of length B; the message names the
            first offending index.
    """
    B = len(completions)
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        out = fn(prompts, completions, references=references) if accepts_references(fn) else fn(prompts, completions)
    except Exception as exc:
        raise RewardFunctionError(f"reward function {name} raised {type(exc).__name__}: {exc}") from exc
    if hasattr(out, "tolist") and not isinstance(out, (list, tuple)):  # torch / numpy
        if getattr(out, "ndim", 1) != 1:
            raise RewardFunctionError(f"reward function {name} returned an array of shape {tuple(out.shape)}; "
                                      f"expected ({B},): one number per completion")
        out = out.tolist()
    if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
        raise RewardFunctionError(f"reward function {name} returned {type(out).__name__}; expected a list of {B} "
                                  "numbers, one per completion")
    if len(out) != B:
        raise RewardFunctionError(f"reward function {name} returned {len(out)} values for {B} completions; "
                                  "expected one number per completion")
    for b, value in enumerate(out):
        if value is None and allow_abstain:
            continue
        if value is None:
            raise RewardFunctionError(f"reward function {name}: value {b} is None; a reward function may abstain "
                                      "(return None) only in online RL (grpo); return a number here")
        if not isinstance(value, numbers.Real):
            raise RewardFunctionError(f"reward function {name}: value {b} is {type(value).__name__} {value!r}; "
                                      "expected a real number")
        if not math.isfinite(value) or not math.isfinite(float(torch.tensor(float(value), dtype=torch.float32))):
            raise RewardFunctionError(f"reward function {name}: value {b} is {value!r} (not finite in float32) for "
                                      f"completion {completions[b][:80]!r}")
    return torch.tensor([math.nan if v is None else float(v) for v in out], dtype=torch.float32)
