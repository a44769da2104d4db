"""Recipe loading and validation: all problems at once, dotted paths, did-you-mean, inheritance."""

from pathlib import Path

import pytest
import yaml

from llmtune.config import RecipeError, load_recipe
from llmtune.config.load import read_yaml


def problems(raw: dict) -> dict[str, str]:
    with pytest.raises(RecipeError) as info:
        load_recipe(raw=raw)
    return dict(info.value.problems)


def test_all_problems_reported_together_with_dotted_paths():
    found = problems({
        "model": {"name_or_pth": "x", "load_in_4bit": True, "load_in_8bit": True},
        "precision": {"fp16": True, "bf16": True},
        "train": {"learning_rate": -1, "max_steps": "abc"},
        "adapter": {"type": "none"},
        "data": {"datasets": [{"path": "a.json", "fromat": "alpaca"}]},
    })
    assert found["model.name_or_pth"] == "unknown key; did you mean 'name_or_path'?"
    assert found["data.datasets.0.fromat"] == "unknown key; did you mean 'format'?"
    assert found["train.learning_rate"].startswith("Input should be greater than 0")
    assert "valid integer" in found["train.max_steps"]
    assert "fp16 and bf16 are both on" in found["precision.fp16"]
    assert "load_in_4bit and load_in_8bit" in found["model.load_in_8bit"]
    assert "without an adapter" in found["adapter.type"]
    assert len(found) == 7


def test_unknown_section_and_misplaced_key():
    found = problems({"modle": {}, "train": {"max_length": 10}})
    assert found["modle"] == "unknown key; did you mean 'model'?"
    assert found["train.max_length"] == "unknown key here; 'max_length' belongs in 'data.max_length'"


def test_a_columns_key_that_is_no_canonical_field_is_named_before_any_data_is_read():
    """The file does not exist: the problems come from the recipe alone (the data used to end in 'cannot detect')."""
    found = problems({"data": {"datasets": [{"path": "missing.jsonl", "columns": {"instrution": "question",
                                                                                     "output": "answer"}},
                                            {"path": "b.jsonl", "columns": {"question": "prompt"}}]}})
    assert set(found) == {"data.datasets.0.columns.instrution", "data.datasets.1.columns.question"}
    assert found["data.datasets.0.columns.instrution"].startswith(
        "'instrution' is not a canonical field; did you mean 'instruction' ({instruction: question})?")
    assert "write {prompt: question}" in found["data.datasets.1.columns.question"]  # reversed mapping
    assert "canonical fields: chosen, completion, content, input, instruction" in found["data.datasets.1.columns.question"]


def test_canonical_columns_are_the_fields_of_the_data_formats():
    from llmtune.config.validate import CANONICAL_COLUMNS
    from llmtune.data.formats import FORMAT_FIELDS

    assert set(CANONICAL_COLUMNS) == {f for fields in FORMAT_FIELDS.values() for f in fields}


def test_global_batch_must_be_multiple_of_micro_batch():
    found = problems({"train": {"micro_batch_size": 3, "global_batch_size": 8}})
    assert found == {"train.global_batch_size": "must be a multiple of micro_batch_size (3); got 8"}


def test_error_message_lists_every_problem():
    with pytest.raises(RecipeError) as info:
        load_recipe(raw={"precision": {"fp16": True, "bf16": True}, "train": {"lr": 1}})
    text = str(info.value)
    assert text.startswith("2 problem(s):")
    assert "precision.fp16" in text and "train.lr" in text


def test_inheritance_overrides_and_stage(tmp_path: Path):
    (tmp_path / "parent.yaml").write_text(yaml.safe_dump({
        "train": {"learning_rate": 1e-4, "max_steps": 50}, "data": {"max_length": 256}}))
    (tmp_path / "child.yaml").write_text("base: parent.yaml\ntrain:\n  max_steps: 10\n")
    recipe = load_recipe(tmp_path / "child.yaml", ["data.max_length=128", "data.datasets.0.path=x.jsonl"], stage="sft")
    assert recipe.train.learning_rate == 1e-4  # inherited
    assert recipe.train.max_steps == 10  # child wins
    assert recipe.data.max_length == 128  # override wins
    assert recipe.data.datasets[0].path == "x.jsonl"
    assert recipe.stage == "sft"


def test_inheritance_cycle_and_missing_base(tmp_path: Path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(RecipeError, match="inheritance cycle"):
        read_yaml(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("base: nope.yaml\n")
    with pytest.raises(RecipeError, match="recipe file not found: .*nope.yaml"):
        read_yaml(tmp_path / "c.yaml")


def test_stage_mismatch(tmp_path: Path):
    (tmp_path / "r.yaml").write_text("stage: dpo\n")
    with pytest.raises(RecipeError, match="for stage 'dpo' but was run with `llmtune sft`"):
        load_recipe(tmp_path / "r.yaml", stage="sft")


def test_override_types_are_yaml():
    recipe = load_recipe(raw={}, overrides=["train.learning_rate=3e-5", "train.gradient_checkpointing=true"])
    assert recipe.train.learning_rate == pytest.approx(3e-5)
    assert recipe.train.gradient_checkpointing is True
    with pytest.raises(RecipeError, match="section.key=value"):
        load_recipe(raw={}, overrides=["train.learning_rate"])


def test_a_union_field_gets_one_problem_under_its_own_key():
    found = problems({"train": {"gradient_checkpointing": "maybe"}, "adapter": {"target_modules": 5}})
    assert set(found) == {"train.gradient_checkpointing", "adapter.target_modules"}  # no ".bool", ".literal['auto']"
    assert "true or false" in found["train.gradient_checkpointing"] and "'auto'" in found["train.gradient_checkpointing"]
    assert "list" in found["adapter.target_modules"] and "string" in found["adapter.target_modules"]
