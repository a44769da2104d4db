"""Issue 21 bug 7: the longest sequence of every stage against the model's position limit (rope scaling read from
the config), refused with the numbers and the fix."""

import pytest
from transformers import LlamaConfig

from llmtune.config import load_recipe
from llmtune.models.checks import model_fit_problems, position_limit, position_problems


def _config(max_positions=4096, **rope):
    return LlamaConfig(max_position_embeddings=max_positions, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=1, num_attention_heads=2, vocab_size=64, rope_scaling=rope or None)


@pytest.mark.parametrize(("config", "limit"), [
    (_config(4096), 4096),
    (_config(2048, rope_type="linear", factor=4.0), 8192),  # position interpolation: 2048 x 4
    (_config(2048, rope_type="dynamic", factor=2.0), 4096),
    (_config(32768, rope_type="yarn", factor=4.0, original_max_position_embeddings=8192), 32768),  # already extended
])
def test_position_limit_reads_rope_scaling(config, limit):
    assert position_limit(config)[0] == limit


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "orpo", "simpo", "kto"])
def test_max_length_above_the_limit_is_refused_with_the_numbers_and_the_fix(stage):
    recipe = load_recipe(raw={"data": {"max_length": 5000}}, stage=stage)
    [(key, message)] = position_problems(recipe, _config(4096), stage)
    assert key == "data.max_length"
    assert "5000 exceeds the model's position limit of 4096 (max_position_embeddings 4096" in message
    assert "Set data.max_length <= 4096" in message and "rope scaling" in message
    assert position_problems(load_recipe(raw={"data": {"max_length": 4096}}, stage=stage), _config(4096), stage) == []
    assert model_fit_problems(recipe, None, stage=stage, config=_config(4096)) == [(key, message)]


def test_a_rope_scaled_model_trains_up_to_its_scaled_length():
    """Old code compared with max_position_embeddings alone: a linear-scaled 2048 x 4 model refused 8000 tokens."""
    config = _config(2048, rope_type="linear", factor=4.0)
    assert position_problems(load_recipe(raw={"data": {"max_length": 8000}}, stage="dpo"), config, "dpo") == []
    [(_, message)] = position_problems(load_recipe(raw={"data": {"max_length": 9000}}, stage="dpo"), config, "dpo")
    assert "position limit of 8192 (max_position_embeddings 2048 x rope_scaling linear factor 4" in message


ONLINE = {"reward": {"function": "llmtune.rewards:gsm8k_reward"}, "train": {"max_steps": 4}}


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_online_stages_count_prompt_plus_new_tokens(stage):
    """Old code checked GRPO's data.max_length only: prompts of 3990 + 200 new tokens passed on a 4096 model."""
    recipe = load_recipe(raw={"data": {"max_length": 4000, "max_prompt_length": 3990}, "rollout": {"max_new_tokens": 200},
                              **ONLINE}, stage=stage)
    [(key, message)] = position_problems(recipe, _config(4096), stage)
    assert key == "rollout.max_new_tokens" and "3990 tokens + 200 new tokens = 4190 tokens" in message
    assert "Lower data.max_prompt_length or rollout.max_new_tokens so that their sum is <= 4096" in message
    ok = load_recipe(raw={"data": {"max_length": 4000, "max_prompt_length": 3896}, "rollout": {"max_new_tokens": 200},
                          **ONLINE}, stage=stage)
    assert position_problems(ok, _config(4096), stage) == []
