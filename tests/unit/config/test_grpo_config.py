"""The `grpo:` section: defaults validate, batch arithmetic and reward sources are checked with dotted paths,
and the pipeline accepts a grpo step (wired to the latest policy step and RM)."""

import pytest
import yaml

from llmtune.config import RecipeError, load_recipe
from llmtune.pipeline.spec import load_pipeline

REWARD = {"function": "llmtune.rewards:gsm8k_reward"}


def problems(raw):
    with pytest.raises(RecipeError) as err:
        load_recipe(raw=raw)
    return dict(err.value.problems)


def test_defaults_validate_and_sources_combine():
    recipe = load_recipe(raw={"stage": "grpo", "reward": {**REWARD, "functions": [
        {"function": "llmtune.rewards:format_reward", "weight": 0.5}]}, "train": {"max_steps": 2}})
    assert recipe.grpo.num_generations == 4 and recipe.grpo.beta == 0.0 and recipe.grpo.kl_estimator == "k3"
    assert recipe.reward.functions[0].weight == 0.5
    raw = yaml.safe_load("stage: grpo\nreward: {function: 'llmtune.rewards:gsm8k_reward'}\ntrain: {max_steps: 2}\n"
                         "grpo: {dynamic_sampling: off}\n")
    assert raw["grpo"]["dynamic_sampling"] is False  # YAML 1.1 reads a bare off as false ...
    assert load_recipe(raw=raw).grpo.dynamic_sampling == "off"  # ... and the recipe means the mode "off"


def test_batch_arithmetic_and_reward_source_problems():
    got = problems({"stage": "grpo", "grpo": {"num_generations": 3, "rollout_batch_size": 12},
                    "train": {"global_batch_size": 8, "max_steps": 3}})
    assert "at least one reward source" in got["reward"]
    assert "multiple of grpo.num_generations (3" in got["train.global_batch_size"]
    assert "multiple of train.global_batch_size (8" in got["grpo.rollout_batch_size"]
    got = problems({"stage": "grpo", "reward": REWARD, "grpo": {"rollout_batch_size": 16, "num_iterations": 2},
                    "train": {"global_batch_size": 8, "max_steps": 6, "save_steps": 2}})
    assert "multiple of 4 optimizer steps" in got["train.max_steps"] and "try 8" in got["train.max_steps"]
    assert "train.save_steps" in got
    assert "GRPO needs max_steps" in problems({"stage": "grpo", "reward": REWARD})["train.max_steps"]
    got = problems({"stage": "grpo", "reward": REWARD, "train": {"max_steps": 2},
                    "grpo": {"loss_aggregation": "seq_mean", "scale_rewards": "std"}})
    assert "grpo.loss_aggregation" in got and "grpo.scale_rewards" in got


def test_pipeline_accepts_a_grpo_step(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"pipeline": {"dir": str(tmp_path / "runs"), "stages": [
        {"name": "sft", "stage": "sft"},
        {"name": "rm", "stage": "rm"},
        {"name": "grpo", "recipe": {"stage": "grpo", "train": {"max_steps": 2}}},
        {"name": "grpo_fn", "stage": "grpo", "recipe": {"reward": REWARD, "train": {"max_steps": 2}}},
    ]}}))
    pipe = load_pipeline(path, base_dir=tmp_path)
    sft, rm, grpo, grpo_fn = pipe.steps
    assert grpo.kind == "grpo" and grpo.recipe.model.from_run == str(sft.dir)
    assert grpo.recipe.reward.from_run == str(rm.dir) and grpo.inputs == ["sft", "rm"]  # the RM scores it
    assert grpo_fn.recipe.reward.from_run is None and grpo_fn.recipe.model.from_run == str(grpo.dir)
    assert pipe.export.step == "grpo_fn"  # a grpo step is a policy step: exported at the end


def test_ppo_counts_reward_functions_as_its_function_source():
    fns = {"functions": [{"function": "llmtune.rewards:gsm8k_reward"}]}
    assert load_recipe(raw={"stage": "ppo", "reward": fns, "train": {"max_steps": 4}}).reward.functions
    got = problems({"stage": "ppo", "reward": {**fns, "from_run": "runs/rm"}, "train": {"max_steps": 4}})
    assert "exactly one score source" in got["reward"]


def test_scale_rewards_booleans_and_the_new_keys():
    raw = yaml.safe_load("stage: grpo\nreward: {function: 'llmtune.rewards:gsm8k_reward'}\ntrain: {max_steps: 2}\n"
                         "grpo: {scale_rewards: false}\n")
    assert raw["grpo"]["scale_rewards"] is False  # what TRL / axolotl users write for Dr. GRPO
    assert load_recipe(raw=raw).grpo.scale_rewards == "none"
    raw["grpo"]["scale_rewards"] = True
    assert load_recipe(raw=raw).grpo.scale_rewards == "group"
    grpo = load_recipe(raw={"stage": "grpo", "reward": REWARD, "train": {"max_steps": 2}}).grpo
    assert (grpo.advantage_estimator, grpo.importance_sampling_level) == ("grpo", "token")
    assert (grpo.sequence_epsilon_low, grpo.sequence_epsilon_high) == (3e-4, 4e-4)  # GSPO paper, Sec. 5.1
    assert grpo.overlong_buffer_tokens is None and grpo.overlong_penalty_factor == 1.0
    got = problems({"stage": "grpo", "reward": REWARD, "train": {"max_steps": 2},
                    "rollout": {"max_new_tokens": 16},
                    "grpo": {"advantage_estimator": "rloo", "scale_rewards": "batch",
                             "overlong_buffer_tokens": 32, "importance_sampling_level": "seq"}})
    assert "applies to advantage_estimator grpo only" in got["grpo.scale_rewards"]
    assert "more than rollout.max_new_tokens (16)" in got["grpo.overlong_buffer_tokens"]
    assert "grpo.importance_sampling_level" in got
