"""The agent: keys work together by default (issue 39): a first agent recipe with the default tool-result cap is
never refused for the default rollout budget; the agent defaults (one budget for the whole rollout, a tool-result cap
inside it, DAPO's soft overlong penalty) are filled in; infrastructure_timeouts names tools that exist."""

import pytest

from llmtune.config import RecipeError, load_recipe

TOOLS = {"tools": ["llmtune.tools:calculator"]}


def recipe(stage="grpo", **sections):
    steps = {"grpo": 4, "ppo": 4}[stage]
    raw = {"stage": stage, "reward": {"function": "llmtune.rewards:gsm8k_reward"}, "train": {"max_steps": steps},
           **sections}
    return load_recipe(raw=raw)


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_a_first_agent_recipe_with_every_default_validates(stage):
    """Before: agent.max_tool_result_tokens 256 was refused as not below the default budget (grpo 128, ppo 64)."""
    r = recipe(stage, agent=TOOLS)
    assert r.rollout.max_new_tokens == 512  # one budget for the whole rollout: turns, tool results, template
    assert r.agent.max_tool_result_tokens == 128  # a quarter of it
    assert getattr(r, stage).overlong_buffer_tokens == 102  # DAPO's proportion (4096 of 20480), factor 1


def test_an_explicit_budget_gets_a_cap_that_fits_and_an_explicit_cap_is_still_checked():
    r = recipe(agent=TOOLS, rollout={"max_new_tokens": 96})
    assert (r.agent.max_tool_result_tokens, r.grpo.overlong_buffer_tokens) == (24, 19)
    assert recipe(agent={**TOOLS, "max_tool_result_tokens": 300}).agent.max_tool_result_tokens == 300  # kept
    with pytest.raises(RecipeError, match=r"agent.max_tool_result_tokens: 96 is not below rollout.max_new_tokens"):
        recipe(agent={**TOOLS, "max_tool_result_tokens": 96}, rollout={"max_new_tokens": 96})
    with pytest.raises(RecipeError, match=r"ppo.overlong_buffer_tokens: 600 is more than rollout.max_new_tokens"):
        recipe("ppo", agent=TOOLS, ppo={"overlong_buffer_tokens": 600})


def test_single_turn_defaults_are_unchanged():
    r = recipe()
    assert (r.rollout.max_new_tokens, r.grpo.overlong_buffer_tokens, r.agent.max_tool_result_tokens) == \
        (128, None, None)
    assert recipe("ppo").rollout.max_new_tokens == 64


def test_infrastructure_timeouts_name_the_runs_tools(tmp_path):
    from llmtune.stages import STAGES

    r = recipe(agent={**TOOLS, "infrastructure_timeouts": ["calculater", "calculator"]})
    problems = STAGES["grpo"](r, recipe_dir=tmp_path).preflight(str(tmp_path))
    assert ("agent.infrastructure_timeouts.0", "'calculater' is not a tool of this run (did you mean "
            "'calculator'?); the tools are calculator") in problems
    assert not any(key == "agent.infrastructure_timeouts.1" for key, _ in problems)
