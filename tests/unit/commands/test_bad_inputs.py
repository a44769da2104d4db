"""Probe of bad inputs through `llmtune validate` (and a few through training/loading): each must end in a clear
error naming the key or file, exit code 1, and no traceback (an exception escaping `main` fails the test).

Kinds: YAML values coerced (bool/str -> number, inf/nan, duplicate keys, empty recipe), sizes that cannot fit the
data or model (batch vs rows, max_length vs positions, vocabulary vs embeddings, seed range), names that match
nothing (adapter modules, column mapping), file-level faults (gzip, parquet, encodings, safetensors, pickles, a
mixing weight that rounds to nothing).
"""

import gzip
import json
from pathlib import Path

import pytest
import yaml

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model

ROWS = [{"messages": [{"role": "user", "content": f"What is {i} + 2?"},
                      {"role": "assistant", "content": f"It is {i + 2}."}]} for i in range(20)]


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    model = save_tiny_model(root / "model")
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    small_vocab = save_tiny_model(root / "small_vocab")
    config = json.loads((small_vocab / "config.json").read_text())
    config["vocab_size"] = 100  # the tokenizer has 400 tokens
    (small_vocab / "config.json").write_text(json.dumps(config))
    return root


def base_recipe(ws: Path) -> dict:
    return {"stage": "sft", "model": {"name_or_path": str(ws / "model")},
            "data": {"datasets": [{"path": str(ws / "data.jsonl")}], "max_length": 64},
            "adapter": {"lora_r": 4, "lora_alpha": 8},
            "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2},
            "output": {"dir": str(ws / "run")}}


def validate(ws, capsys, recipe_text: str, *overrides: str) -> tuple[int, str]:
    path = ws / "recipe.yaml"
    path.write_text(recipe_text)
    code = main(["validate", str(path), *overrides])
    return code, capsys.readouterr().err


def with_changes(ws, *changes) -> str:
    recipe = base_recipe(ws)
    for dotted, value in changes:
        node = recipe
        *parents, last = dotted.split(".")
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value
    return yaml.safe_dump(recipe)


def test_the_base_recipe_is_valid(ws, capsys):
    code, err = validate(ws, capsys, with_changes(ws), "train.learning_rate=3e-4")  # CLI numbers still parse
    assert code == 0, err


# ---- YAML values that used to be coerced or silently accepted ---------------------------------------------------
YAML_CASES = {
    "bool as number": ("train:\n  learning_rate: yes\n", ["train.learning_rate", "boolean"]),
    "true as number": ("train:\n  max_steps: true\n", ["train.max_steps", "boolean"]),
    "quoted number": ("train:\n  learning_rate: '3e-4'\n", ["train.learning_rate", "string '3e-4'"]),
    "float for int": ("train:\n  micro_batch_size: 2.5\n", ["train.micro_batch_size"]),
    "int for bool": ("model:\n  name_or_path: {model}\n  load_in_4bit: 1\n", ["model.load_in_4bit", "boolean"]),
    "number for string": ("model:\n  name_or_path: {model}\n  revision: 1234\n", ["model.revision", "string"]),
    "overflow to inf": ("train:\n  max_grad_norm: 1.0e+400\n", ["train.max_grad_norm", "finite"]),
    "nan": ("train:\n  warmup_ratio: .nan\n", ["train.warmup_ratio", "finite"]),
    "duplicate key": ("train:\n  max_steps: 2\n  max_steps: 5\n", ["duplicate key 'max_steps'", "line"]),
    "duplicate section": ("train: {max_steps: 2}\ntrain: {max_steps: 5}\n", ["duplicate key 'train'"]),
    "duplicate in flow": ("train: {max_steps: 2, max_steps: 5}\n", ["duplicate key 'max_steps'"]),
}


@pytest.mark.parametrize("case", YAML_CASES, ids=list(YAML_CASES))
def test_yaml_values_are_not_coerced(ws, capsys, case):
    extra, expected = YAML_CASES[case]
    recipe = base_recipe(ws)
    recipe.pop(extra.split(":", 1)[0])  # the case writes this section itself
    text = yaml.safe_dump(recipe) + extra.replace("{model}", str(ws / "model"))
    code, err = validate(ws, capsys, text)
    assert code == 1 and err.startswith("error:"), err
    for part in expected:
        assert part in err, (part, err)


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n"], ids=["empty", "blank", "comment"])
def test_an_empty_recipe_is_an_error(ws, capsys, text):
    code, err = validate(ws, capsys, text)
    assert code == 1 and "recipe file is empty" in err and "recipe.yaml" in err


@pytest.mark.parametrize("override,key", [("train.learning_rate=yes", "train.learning_rate"),
                                          ("train.max_steps=1e400", "train.max_steps"),
                                          ("train.seed=-1", "train.seed")])
def test_bad_overrides_are_errors(ws, capsys, override, key):
    code, err = validate(ws, capsys, with_changes(ws), override)
    assert code == 1 and key in err


def test_a_recipe_that_is_not_utf8_is_an_error(ws, capsys):
    (ws / "recipe.yaml").write_bytes(b"stage: sft\n# caf\xe9\n")
    assert main(["validate", str(ws / "recipe.yaml")]) == 1
    assert "not UTF-8" in capsys.readouterr().err


# ---- values that cannot fit the data or the model ------------------------------------------------------------------
SIZE_CASES = {
    "batch larger than data": ([("train.global_batch_size", 64)], ["train.global_batch_size", "only 20 training rows"]),
    "max_length beyond positions": ([("data.max_length", 100000)], ["data.max_length", "max_position_embeddings 4096"]),
    "seed below 0": ([("train.seed", -1)], ["train.seed"]),
    "seed above numpy range": ([("train.seed", 2**32)], ["train.seed", "4294967295"]),
    "data seed above numpy range": ([("data.seed", 2**40)], ["data.seed"]),
}


@pytest.mark.parametrize("case", SIZE_CASES, ids=list(SIZE_CASES))
def test_sizes_that_cannot_fit(ws, capsys, case):
    changes, expected = SIZE_CASES[case]
    code, err = validate(ws, capsys, with_changes(ws, *changes))
    assert code == 1, err
    for part in expected:
        assert part in err, (part, err)


def test_a_tokenizer_larger_than_the_embedding_is_an_error(ws, capsys):
    code, err = validate(ws, capsys, with_changes(ws, ("model.name_or_path", str(ws / "small_vocab"))))
    assert code == 1 and "400 tokens" in err and "100 rows" in err and "IndexError" in err


# ---- names that match nothing ------------------------------------------------------------------------------------
NAME_CASES = {
    "target module typo": ([("adapter.target_modules", ["q_proj", "v_prj"])],
                           ["adapter.target_modules.1", "'v_prj' matches no module", "did you mean 'v_proj'"]),
    "target regex matching nothing": ([("adapter.target_modules", r".*\.qq_proj")], ["adapter.target_modules"]),
    "modules_to_save typo": ([("adapter.modules_to_save", ["lm_haed"])],
                             ["adapter.modules_to_save.0", "did you mean 'lm_head'"]),
    "column mapping to a missing column": ([("data.datasets.0.columns", {"messages": "convos"})],
                                           ["data.datasets[0].columns.messages", "'convos'", "data.jsonl",
                                            "its columns are: messages"]),
    "turn key mapping to a missing key": ([("data.datasets.0.columns", {"role": "speaker"})],
                                          ["data.datasets[0].columns.role", "'speaker'", "content, role"]),
}


@pytest.mark.parametrize("case", NAME_CASES, ids=list(NAME_CASES))
def test_names_that_match_nothing(ws, capsys, case):
    changes, expected = NAME_CASES[case]
    code, err = validate(ws, capsys, with_changes(ws, *changes))
    assert code == 1, err
    for part in expected:
        assert part in err, (part, err)


def test_reward_model_adapter_names_are_checked_on_the_score_model(ws, caplog):
    """RM builds AutoModelForSequenceClassification on the meta device: its names include the 'score' head (a causal
    LM has none), a typo is found, and nothing is logged (the build used to fail on num_labels with a WARNING)."""
    import logging

    from llmtune.config import load_recipe
    from llmtune.models.checks import model_fit_problems

    raw = {"model": {"name_or_path": str(ws / "model")},
           "adapter": {"target_modules": ["q_proj", "v_prj"], "modules_to_save": ["score"]}}
    recipe = load_recipe(raw=raw, stage="rm")
    with caplog.at_level(logging.WARNING):
        problems = model_fit_problems(recipe, None, head="score", stage="rm")
    assert [key for key, _ in problems] == ["adapter.target_modules.1"]  # 'score' exists, 'v_prj' does not
    assert "did you mean 'v_proj'" in problems[0][1]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    causal = model_fit_problems(recipe, None, head="causal_lm", stage="rm")
    assert [key for key, _ in causal] == ["adapter.target_modules.1", "adapter.modules_to_save.0"]


def test_valid_target_modules_pass(ws, capsys):
    code, err = validate(ws, capsys, with_changes(ws, ("adapter.target_modules", ["q_proj", "v_proj"]),
                                                  ("adapter.modules_to_save", ["lm_head"])))
    assert code == 0, err


def test_training_refuses_bad_target_modules_before_loading_weights(ws, capsys):
    (ws / "train.yaml").write_text(with_changes(ws, ("adapter.target_modules", ["q_proj", "v_prj"]),
                                                ("output.dir", str(ws / "run_names"))))
    assert main(["sft", str(ws / "train.yaml")]) == 1
    assert "did you mean 'v_proj'" in capsys.readouterr().err
    assert not (ws / "run_names" / "lineage.json").exists()


# ---- file-level faults ----------------------------------------------------------------------------------------------
def _jsonl_bytes() -> bytes:
    return "".join(json.dumps(r) + "\n" for r in ROWS).encode()


def _write(ws: Path, name: str) -> Path:
    path = ws / "files" / name
    path.parent.mkdir(exist_ok=True)
    data = _jsonl_bytes()
    if name == "truncated.jsonl.gz":
        blob = gzip.compress(data)
        path.write_bytes(blob[: len(blob) // 2])
    elif name == "plain.jsonl.gz":
        path.write_bytes(data)
    elif name == "hidden_gzip.jsonl":
        path.write_bytes(gzip.compress(data))
    elif name == "corrupt.parquet":
        import pandas as pd

        pd.DataFrame({"text": [f"row {i}" for i in range(20)]}).to_parquet(path)
        blob = path.read_bytes()
        path.write_bytes(blob[: len(blob) // 2])
    elif name == "latin1.csv":
        path.write_bytes("instruction,output\n".encode() + b"".join(
            f"caf\xe9 {i},ok {i}\n".encode("latin-1") for i in range(20)))
    elif name == "huge_field.csv":
        path.write_text("instruction,output\n" + "".join(f"q{i},a{i}\n" for i in range(19)) + "q," + "x" * 200_000 + "\n")
    elif name == "latin1.jsonl":
        path.write_bytes(b"".join((json.dumps({"text": f"row {i}"})[:-2] + "\xe9\"}\n").encode("latin-1")
                                  for i in range(20)))
    return path


FILE_CASES = {
    "truncated.jsonl.gz": ["truncated.jsonl.gz", "truncated"],
    "plain.jsonl.gz": ["plain.jsonl.gz", "not a valid gzip file"],
    "hidden_gzip.jsonl": ["hidden_gzip.jsonl", "gzip-compressed", "rename it"],
    "corrupt.parquet": ["corrupt.parquet", "not a readable parquet file"],
    "latin1.csv": ["latin1.csv", "not UTF-8", "line 2", "iconv"],
    "latin1.jsonl": ["latin1.jsonl", "not UTF-8", "line 1"],
    "huge_field.csv": ["huge_field.csv", "CSV error near line 21", "field larger than field limit"],
}


@pytest.mark.parametrize("name", FILE_CASES, ids=list(FILE_CASES))
def test_file_faults_name_the_file_and_the_fix(ws, capsys, name):
    path = _write(ws, name)
    code, err = validate(ws, capsys, with_changes(ws, ("data.datasets.0.path", str(path))))
    assert code == 1, err
    for part in FILE_CASES[name]:
        assert part in err, (part, err)


def test_a_mixing_weight_that_rounds_to_nothing_is_blamed_on_the_weight(ws, capsys):
    second = {"path": str(ws / "data.jsonl"), "weight": 0.01}
    code, err = validate(ws, capsys, with_changes(ws, ("data.datasets", [{"path": str(ws / "data.jsonl")}, second])))
    assert code == 1 and "data.datasets[1].weight" in err and "rounds to 0 rows" in err
    assert "max_length" not in err


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors_are_named(ws, capsys, tmp_path, damage):
    model = save_tiny_model(tmp_path / "m")
    weights = model / "model.safetensors"
    blob = weights.read_bytes()
    weights.write_bytes(blob[: len(blob) // 2] if damage == "truncated" else b"not safetensors at all" * 8)
    code, err = validate(ws, capsys, with_changes(ws, ("model.name_or_path", str(model))))
    assert code == 1 and str(weights) in err and "truncated or corrupt" in err


def test_a_missing_weight_shard_is_named(ws, capsys, tmp_path):
    model = save_tiny_model(tmp_path / "m")
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors",
                                            "model.norm.weight": "model-00001-of-00002.safetensors"}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = validate(ws, capsys, with_changes(ws, ("model.name_or_path", str(model))))
    assert code == 1 and "model-00002-of-00002.safetensors" in err and "missing" in err


@pytest.mark.parametrize("left", ["config + tokenizer", "unindexed shard", "gguf beside"])
def test_a_model_directory_without_weights_is_an_error(ws, capsys, tmp_path, left):
    model = save_tiny_model(tmp_path / "m")
    weights = model / "model.safetensors"
    if left == "unindexed shard":  # a shard without the index transformers needs to find it
        weights.rename(model / "model-00001-of-00002.safetensors")
    elif left == "gguf beside":
        weights.unlink()
        (model / "model.Q4_0.gguf").write_bytes(b"GGUF")
    else:
        weights.unlink()
    code, err = validate(ws, capsys, with_changes(ws, ("model.name_or_path", str(model))))
    assert code == 1, err
    assert "has no weights" in err and "model.safetensors, model.safetensors.index.json, pytorch_model.bin" in err
    assert "tokenizer.json" in err  # what the directory does hold
    if left == "unindexed shard":
        assert "model.safetensors.index.json (the index" in err
    if left == "gguf beside":
        assert f"model.name_or_path to the file itself ({model / 'model.Q4_0.gguf'})" in err
    assert "model source and data checked" not in capsys.readouterr().out


def test_each_weight_file_transformers_loads_is_accepted(tmp_path):
    """pytorch_model.bin alone is a complete model directory (transformers loads it); only an empty one is refused."""
    import torch
    from safetensors.torch import load_file

    from llmtune.models import ModelLoadError
    from llmtune.models.weight_files import check_weight_files

    model = save_tiny_model(tmp_path / "m")
    check_weight_files(model, model_dir=True)
    torch.save(load_file(str(model / "model.safetensors")), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    check_weight_files(model, model_dir=True)
    check_weight_files(tmp_path, model_dir=False)  # an adapter/other directory: no base weights asked for
    (model / "pytorch_model.bin").unlink()
    with pytest.raises(ModelLoadError, match="has no weights"):
        check_weight_files(model, model_dir=True)


def test_a_pickle_only_checkpoint_says_what_to_do(tmp_path):
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from llmtune.config import load_recipe
    from llmtune.models import ModelLoadError
    from llmtune.models.load import load_model

    model = save_tiny_model(tmp_path / "m")
    state = load_file(str(model / "model.safetensors"))
    state["extra"] = np.arange(3)  # a non-tensor object: torch.load(weights_only=True) refuses the file
    torch.save(state, model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    recipe = load_recipe(raw={"model": {"name_or_path": str(model)}})
    with pytest.raises(ModelLoadError) as err:
        load_model(recipe.model, recipe.precision)
    msg = str(err.value)
    assert "pytorch_model.bin" in msg and "safetensors" in msg and "save_pretrained" in msg
    assert "weights_only=False" not in msg  # torch's suggestion to run the pickle is not passed on


def test_a_deepspeed_config_with_a_duplicate_key_is_an_error(tmp_path):
    from llmtune.config import RecipeError, load_recipe
    from llmtune.core.distributed import deepspeed_config

    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    recipe = load_recipe(raw={"distributed": {"deepspeed": str(path)}})
    with pytest.raises(RecipeError, match="distributed.deepspeed.*duplicate key 'stage'"):
        deepspeed_config(recipe)


def test_a_quantized_base_without_bitsandbytes_is_reported_by_validate(ws, capsys, monkeypatch):
    """Training stops when it loads the base (load_model: 'need bitsandbytes'); validate says so before (old code:
    'valid')."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes"
                        else find_spec(name, *a))
    code, err = validate(ws, capsys, with_changes(ws, ("model.load_in_4bit", True)))
    assert code == 1 and "model.load_in_4bit: needs bitsandbytes" in err, err
