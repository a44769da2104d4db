"""The shipped agent pipelines (recipes/quickstart_agent_pipeline.yaml, recipes/quickstart_agent_rooms_pipeline.yaml):
an evaluation of the untrained model, a warm start from the base on rows the RL never reads, the agent RL from the
warm start, and the trained model with its tools disabled, every evaluation on the same held-out rows."""

from pathlib import Path

import pytest

from llmtune.data.agent_tasks import ROWS_PER_RANGE
from llmtune.pipeline.spec import load_pipeline

ROOT = Path(__file__).resolve().parents[3]
BASE = "builtin:smollm2-135m-instruct"


@pytest.mark.parametrize("name, sft_data, rl_data, tools", [
    ("quickstart_agent_pipeline.yaml", "builtin:multiply-calculator", "builtin:multiply", True),
    ("quickstart_agent_rooms_pipeline.yaml", "builtin:rooms-tools", "builtin:rooms", False),
])
def test_agent_pipeline_evaluates_untrained_warm_start_rl_and_no_tools_on_the_same_held_out_rows(
        tmp_path, name, sft_data, rl_data, tools):
    pipe = load_pipeline(ROOT / "recipes" / name, base_dir=tmp_path)
    assert [(s.name, s.kind) for s in pipe.steps] == [("untrained", "grpo"), ("sft", "sft"), ("grpo", "grpo"),
                                                      ("no_tools", "grpo")]
    untrained, sft, grpo, no_tools = (s.recipe for s in pipe.steps)
    # the untrained model and the warm start both start from the base (not from the evaluation step)
    assert untrained.model.from_run is None and sft.model.from_run is None
    assert untrained.model.name_or_path == sft.model.name_or_path == BASE
    assert grpo.model.from_run == str(pipe.steps[1].dir) and no_tools.model.from_run == str(pipe.steps[2].dir)
    # the evaluation steps move no weight and evaluate once (after their single step)
    for recipe in (untrained, no_tools):
        assert recipe.train.max_steps == 1 and recipe.train.learning_rate <= 1e-10
        assert not recipe.train.eval_at_start
    # the warm start reads rows 0-1999 only, the RL (and its held-out rows) rows 2000-3999: no problem in common
    (warm,) = sft.data.datasets
    assert (warm.path, warm.skip_rows) == (sft_data, 0) and warm.max_samples <= ROWS_PER_RANGE
    assert sft.train.max_steps * sft.train.global_batch_size <= ROWS_PER_RANGE
    for recipe in (untrained, grpo, no_tools):  # the same held-out rows in every evaluation
        assert [(d.path, d.skip_rows, d.max_samples) for d in recipe.data.datasets] == [(rl_data, ROWS_PER_RANGE,
                                                                                          None)]
        assert recipe.data.val_size == grpo.data.val_size == 24 and recipe.data.seed == grpo.data.seed
        assert recipe.reward.functions == grpo.reward.functions and recipe.rollout == grpo.rollout
    # the tools (or the environment) in the untrained model's and the RL's evaluation; none in no_tools
    assert untrained.agent == grpo.agent and grpo.agent.enabled and not no_tools.agent.enabled
    assert bool(grpo.agent.tools) == tools and bool(grpo.agent.environment) != tools
    assert pipe.export.enabled is False


def test_openai_agent_pipeline_is_the_builtin_pipeline_with_the_agent_program_in_place_of_the_loop(tmp_path):
    """recipes/quickstart_agent_openai_pipeline.yaml trains the openai-client agent on the built-in pipeline's task:
    the same untrained evaluation, warm start and held-out rows, the agent program in place of agent.tools (and the
    same turn cap), so their before -> after compare (docs/agents-openai.md#the-quickstart)."""
    builtin = load_pipeline(ROOT / "recipes" / "quickstart_agent_pipeline.yaml", base_dir=tmp_path)
    pipe = load_pipeline(ROOT / "recipes" / "quickstart_agent_openai_pipeline.yaml", base_dir=tmp_path)
    assert [(s.name, s.kind) for s in pipe.steps] == [("untrained", "grpo"), ("sft", "sft"), ("grpo", "grpo")]
    ours, theirs = ({s.name: s.recipe for s in p.steps} for p in (pipe, builtin))
    assert ours["sft"].data == theirs["sft"].data and ours["sft"].train == theirs["sft"].train
    assert ours["sft"].adapter == theirs["sft"].adapter and ours["sft"].model.from_run is None
    assert ours["grpo"].model.from_run == str(pipe.steps[1].dir)
    for name in ("untrained", "grpo"):
        a, b = ours[name], theirs[name]
        assert a.data == b.data and a.reward == b.reward and a.rollout == b.rollout and a.adapter == b.adapter
        assert a.agent.openai.function == "quickstart_agent_openai.py:solve" and not a.agent.tools
        assert a.agent.max_turns == b.agent.max_turns
    assert ours["untrained"].train.max_steps == 1 and ours["untrained"].train.learning_rate <= 1e-10
    assert ours["grpo"].grpo.num_generations == theirs["grpo"].grpo.num_generations
    assert ours["grpo"].train.max_steps == theirs["grpo"].train.max_steps
    assert (ROOT / "recipes" / ours["grpo"].agent.openai.function.split(":")[0]).is_file()
    assert pipe.export.enabled is False
