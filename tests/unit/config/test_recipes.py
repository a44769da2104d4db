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


def _own_data_files(stage: str, root: Path) -> dict[str, Path]:
    """The files a user brings for a stage, as the docs describe them (docs/own-model.md, docs/data.md), 300 rows
    (a global batch of every recipe)."""
    import json

    question = [{"role": "user", "content": f"What is {i} + {i}?"} for i in range(300)]
    rows = {
        "sft": {"messages": [{"messages": [q, {"role": "assistant", "content": f"{2 * i}."}]}
                             for i, q in enumerate(question)]},
        "pairs": {"strings": [{"prompt": q["content"], "chosen": f"{2 * i}.", "rejected": f"{2 * i + 1}."}
                              for i, q in enumerate(question)],
                  "messages": [{"chosen": [q, {"role": "assistant", "content": f"{2 * i}."}],
                                "rejected": [q, {"role": "assistant", "content": f"{2 * i + 1}."}]}
                               for i, q in enumerate(question)]},
        "prompts": {"prompts": [{"prompt": q["content"]} for q in question]},
    }
    kind = "sft" if stage == "sft" else "prompts" if stage in ("ppo", "grpo") else "pairs"
    files = {}
    for name, data in rows[kind].items():
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
        files[name] = path
    return files


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_your_own_data_is_one_override(path, tiny_dir, capsys, tmp_path):
    """Every recipe's header and the docs promise: your own file is `data.datasets.0.path=my.jsonl`, nothing more
    (issue 38: a recipe that pinned `format: hh` refused {prompt, chosen, rejected} pairs). The format is detected."""
    doc = read_yaml(path)
    if not doc.get("data", {}).get("datasets"):
        pytest.skip("reads no data sets")
    stage = doc.get("stage", "sft")
    overrides = [f"model.name_or_path={tiny_dir}", "model.dtype=fp32", f"output.dir={tmp_path / 'run'}",
                 "data.val_size=4"]
    reward_run = doc.get("reward", {}).get("from_run")
    if reward_run and not (Path(reward_run) / "lineage.json").is_file():
        overrides += ["reward.from_run=null", "reward.function=llmtune.rewards:gsm8k_reward"]
    if doc.get("data", {}).get("chat_template") == "chatml_tools":
        overrides += ["data.max_length=4096"] + (["data.max_prompt_length=3072"] if doc.get("agent") else [])
    if "skip_rows" in doc["data"]["datasets"][0]:  # rows of the builtin set kept for held-out use: the header says
        assert "skip_rows=0" in path.read_text()    # how to drop it for your own file
        overrides.append("data.datasets.0.skip_rows=0")
    for name, file in _own_data_files(stage, tmp_path).items():
        assert main(["validate", str(path), *overrides, f"data.datasets.0.path={file}"]) == 0, name
        assert "«" in capsys.readouterr().out


def test_validate_names_the_base_when_from_run_is_unfinished_and_the_base_is_null(capsys):
    """The 8B DPO recipes leave the base to the SFT run (model.name_or_path: null); before that run exists,
    validate says how to check the recipe anyway (one override) instead of picking some other base."""
    recipe = Path(__file__).resolve().parents[3] / "recipes" / "llama3_8b_qlora_dpo.yaml"
    assert read_yaml(recipe)["model"]["name_or_path"] is None
    assert main(["validate", str(recipe), "model.from_run=/nonexistent/llama3_8b_sft"]) == 1
    err = capsys.readouterr().err
    assert "model.name_or_path" in err and "not a finished run yet" in err and "model.name_or_path=" in err


def test_validate_takes_the_launch_flags_the_recipes_name(tiny_dir, capsys, tmp_path):
    """recipes/llama7b_zero3.yaml says "One node only: add --nnodes 1"; validate takes it as training does
    (issue 38: it took only distributed.nnodes=1), and the batch it prints is that launch's."""
    recipe = Path(__file__).resolve().parents[3] / "recipes" / "llama7b_zero3.yaml"
    assert "add --nnodes 1 to either command, llmtune validate too" in recipe.read_text()
    args = ["validate", str(recipe), f"model.name_or_path={tiny_dir}", "model.dtype=fp32", "data.val_size=2",
            "data.datasets.0.max_samples=300", f"output.dir={tmp_path / 'run'}"]
    assert main([*args, "--nnodes", "1"]) == 0
    assert "x 8 ranks (8 per node x 1 node:" in capsys.readouterr().out
    assert main([*args, "--nnodes", "1", "--nproc-per-node", "4"]) == 0
    assert "128 samples/optimizer step = 4 micro x 8 accumulation x 4 ranks" in capsys.readouterr().out
