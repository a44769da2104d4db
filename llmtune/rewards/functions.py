"""Loading, checking and calling a user's reward function ``module:function`` (the contract: :mod:`llmtune.rewards`).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import math
import numbers
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from llmtune.errors import LlmtuneError


class RewardFunctionError(LlmtuneError, RuntimeError):
    """A reward function cannot be loaded, fails, or returns something other than B finite numbers."""


# The keyword arguments a reward function may take (each passed only when it names it or takes **kwargs):
# `references` and `rows` always; `messages` and `environments` in multi-turn runs (agent:) only.
KEYWORDS = ("references", "rows")
MULTI_TURN_KEYWORDS = ("references", "rows", "messages", "environments")


def reward_search_dirs(recipe_dir: str | Path | None) -> list[Path]:
    """Where a reward module is looked for, in order: the working directory, then the recipe's directory. The one
    rule of every command (``llmtune ppo/grpo``, ``validate``, ``rollout-server``) and of the pipeline (its stages and
    its pairs step: the pipeline recipe's directory)."""
    dirs = [Path.cwd().resolve()]
    if recipe_dir is not None and Path(recipe_dir).resolve() not in dirs:
        dirs.append(Path(recipe_dir).resolve())
    return dirs


def load_reward_function(spec: str, recipe_dir: str | Path | None = None, keywords: tuple[str, ...] = KEYWORDS
                         ) -> Callable:
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
    module = (import_file if module_name.endswith(".py") else import_module)(module_name, spec, dirs)
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
    check_reward_signature(obj, spec, keywords)
    return obj


def check_reward_signature(fn: Callable, spec: str, keywords: tuple[str, ...] = KEYWORDS) -> None:
    """Refuse a reward function that cannot be called as llmtune calls it: ``fn(prompts, completions)``, plus those
    of ``keywords`` it accepts (:func:`accepts`). TRL's ``fn(completions, **kwargs)`` is the common mistake: it would
    fail at the first rollout with a bare ``TypeError``; a function that requires ``messages`` in a single-turn run is
    another.

    Raises:
        RewardFunctionError: naming the function's signature, the expected one and a wrapper that fixes it.
    """
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: checked when called
        return
    try:
        sig.bind(["prompt"], ["completion"], **{k: [None] for k in keywords if accepts(fn, k)})
    except TypeError as exc:
        passed = ", ".join(f"{k}=..." for k in keywords)
        raise RewardFunctionError(
            f"reward.function: {spec!r} has the signature {getattr(fn, '__name__', 'fn')}{sig}, which cannot be "
            f"called as fn(prompts, completions[, {passed}]) ({exc}). llmtune passes the B prompt texts, the B "
            "completion texts and, to a function that names them or takes **kwargs, the B reference answers "
            "(references) and prompt rows (rows), and in multi-turn runs (agent:) the B conversations (messages) and "
            "environment instances (environments); it returns B numbers (None = abstain). A TRL-style "
            "fn(completions, **kwargs) can be wrapped: def reward(prompts, completions, **kwargs): return "
            "trl_fn(completions, **kwargs)") from None


def _searched(dirs: list[Path]) -> str:
    return " or ".join(str(d) for d in dirs)


def import_module(module_name: str, spec: str, dirs: list[Path]):
    """The module ``module_name`` of a recipe's ``spec`` (reward functions, tools: :mod:`llmtune.rl.toolbox`).

    Raises:
        RewardFunctionError: it cannot be imported (the error shown, with the directories searched).
    """
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        raise RewardFunctionError(
            f"reward.function: {spec!r}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}. "
            f"Install it, or put {module_name.replace('.', '/')}.py in the working directory or next to the recipe "
            f"(searched: {_searched(dirs)})."
        ) from exc


def import_file(path: str, spec: str, dirs: list[Path]):
    """The module of the Python file ``path`` of a recipe's ``spec``, looked for in ``dirs`` when relative.

    Raises:
        RewardFunctionError: the file does not exist (the directories searched named), or importing it failed.
    """
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


def accepts(fn: Callable, name: str) -> bool:
    """True when ``fn`` takes an argument ``name`` (by name, or through ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature
        return False
    return any(p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def accepts_references(fn: Callable) -> bool:
    """True when ``fn`` takes a ``references`` argument (by name, or through ``**kwargs``)."""
    return accepts(fn, "references")


def call_reward_function(
    fn: Callable, prompts: Sequence[str], completions: Sequence[str], references: Sequence[str | None] | None = None,
    allow_abstain: bool = False, **extra: Sequence,
) -> torch.Tensor:
    """Score B completions with ``fn`` and check the result.

    ``fn(prompts, completions, references=references)`` when ``fn`` accepts ``references``
    (:func:`accepts_references`), else ``fn(prompts, completions)``; each ``extra`` keyword (multi-turn rollouts:
    ``messages``, ``environments``, ``rows``) is passed only when ``fn`` accepts it (by name or ``**kwargs``). With
    ``allow_abstain`` a value may be None: the function abstains on that completion (an unparsable answer, a sandbox
    timeout; TRL's reward functions do the same) and the result holds NaN there; a NaN or inf the function returns
    itself stays an error.

    Args:
        fn: the reward function (see :func:`load_reward_function`).
        prompts: B prompt texts. completions: B generated texts. references: B reference answers or None.
        allow_abstain: accept None values (online RL); otherwise None is an error.
        extra: further per-completion lists (B each) the function may take.

    Returns:
        (B,) float32 tensor of rewards (on CPU); NaN exactly where ``fn`` returned None.

    Raises:
        RewardFunctionError: ``fn`` raised (its error is chained), or did not return B finite real numbers
            (or None with ``allow_abstain``) as a sequence or 1-D tensor/array of length B; the message names the
            first offending index.
    """
    B = len(completions)
    name = getattr(fn, "__qualname__", repr(fn))
    kwargs = {key: value for key, value in (("references", references), *extra.items()) if accepts(fn, key)}
    try:
        out = fn(prompts, completions, **kwargs)
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
