"""Every shipped recipe (recipes/**/*.yaml, recursive) validates, and `llmtune validate` accepts it."""

from pathlib import Path

import pytest
import yaml

from llmtune.commands.cli import main
from llmtune.config import load_recipe
from llmtune.config.load import read_yaml
from llmtune.models.tiny import save_tiny_model

# Stage recipes; pipeline recipes (a `pipeline:` section) are checked by tests/unit/pipeline/test_pipeline.py.
RECIPES = sorted(p for p in (Path(__file__).resolve().parents[3] / "recipes").rglob("*.yaml")
                 if "pipeline" not in read_yaml(p))


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"quickstart_sft.yaml", "llama7b.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_schema(path):
    doc = read_yaml(path)
    recipe = load_recipe(path, stage=doc.get("stage", "sft"))
    assert path.read_text().lstrip().startswith("#"), "recipes start with a comment: purpose, data, command"
    assert recipe.output.dir.startswith("runs/")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", template="llama2", add_bos=True)


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_validate_command_with_model_overridden(path, tiny_dir, capsys, tmp_path):
    """The model path is overridable (llama7b cannot be downloaded here); data stays the recipe's own (every source
    ships with the project: tests/unit/docs/test_paths_inside_repo.py)."""
    doc = read_yaml(path)
    overrides = []
    # enough rows for one global batch (PPO: one rollout batch): a smaller data set is an error (data_size_problems)
    need = 2 * max(doc.get("train", {}).get("global_batch_size", 8), doc.get("ppo", {}).get("rollout_batch_size", 0))
    overrides += [f"model.name_or_path={tiny_dir}", "model.dtype=fp32", f"output.dir={tmp_path / 'run'}"]
    for i, _ in enumerate(doc.get("data", {}).get("datasets", [])):
        overrides.append(f"data.datasets.{i}.max_samples={max(60, need)}")
    reward_run = doc.get("reward", {}).get("from_run")
    if reward_run and not (Path(reward_run) / "lineage.json").is_file():  # PPO: the RM run is trained by its recipe
        overrides += ["reward.from_run=null", "reward.function=llmtune.rewards:gsm8k_reward"]
    if doc.get("data", {}).get("chat_template") == "chatml_tools":
        # the tools block: ~220 SmolLM2 tokens, several times that in the tiny test tokenizer
        overrides += ["data.max_length=4096"] + (["data.max_prompt_length=3072"] if doc.get("agent") else [])
    val = doc.get("data", {}).get("val_size", 0)
    if val >= 1:
        overrides.append("data.val_size=2")
    assert main(["validate", str(path), *overrides]) == 0
    out = capsys.readouterr().out
    assert "«" in out  # a rendered example with trained tokens marked
