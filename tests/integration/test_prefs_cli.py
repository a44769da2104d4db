"""`llmtune orpo|simpo|kto` through the CLI on a tiny random Llama: run dir, metrics with DPO's names, eval before and
after, KTO on unpaired rows and on pairs, export of the chain, validate and --help."""

import json
import math

import pytest
import yaml

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model
from llmtune.utils import read_jsonl
from tests.integration.plots_expect import summary_of

pytestmark = pytest.mark.slow  # four tiny CLI runs (~1 min on 2 cores)

RUN_FILES = ["recipe.resolved.yaml", "data_report.json", "metrics.jsonl", "plots", "checkpoints", "adapter",
             "lineage.json"]
QA = [("What is 2 + 3?", "It is 5.", "It is 7."), ("Say hello.", "Hello! How are you today?", "No."),
      ("What is 12 * 7?", "12 * 7 = 84. #### 84", "12 * 7 = 74."), ("Name a color.", "The sea is blue.", "Dog.")]
KEYS = ["rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("prefs")
    model_dir = save_tiny_model(root / "model")
    pairs = [{"prompt": f"{q} ({i})", "chosen": c, "rejected": r} for i in range(5) for q, c, r in QA]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    feedback = [{"prompt": f"{q} ({i})", "completion": c if i % 3 else r, "label": bool(i % 3)}
                for i in range(6) for q, c, r in QA]  # 16 desirable, 8 undesirable
    (root / "feedback.jsonl").write_text("\n".join(json.dumps(p) for p in feedback) + "\n")
    common = {
        "model": {"name_or_path": str(model_dir)},
        "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2,
                  "save_steps": 2, "eval_steps": 1},
    }
    pair_data = {"datasets": [{"path": str(root / "pairs.jsonl"), "format": "preference"}], "max_length": 64,
                 "val_size": 4}
    runs = {
        "orpo": {"data": pair_data, "orpo": {"beta": 0.2}},  # from the base model: no SFT stage first
        "simpo": {"data": pair_data, "simpo": {"beta": 2.0, "gamma": 0.3}},
        "kto": {"data": pair_data},
        "kto_unpaired": {"stage": "kto", "data": {"datasets": [{"path": str(root / "feedback.jsonl")}],
                                                  "max_length": 64, "val_size": 4},
                         "kto": {"undesirable_weight": 2.0}},
    }
    for name, sections in runs.items():
        recipe = {"stage": name.split("_")[0], **common, **sections, "output": {"dir": str(root / name)}}
        (root / f"{name}.yaml").write_text(yaml.safe_dump(recipe))
        assert main([recipe["stage"], str(root / f"{name}.yaml")]) == 0, name
    return root


@pytest.mark.parametrize("name", ["orpo", "simpo", "kto", "kto_unpaired"])
def test_run_dir_metrics_and_eval(workspace, name):
    run = workspace / name
    assert sorted(p.name for p in run.iterdir()) == sorted(RUN_FILES)
    summary = summary_of(run, name.split("_")[0])  # KTO logs its reward accuracy at eval only, of pairs only
    assert list(summary) == ["loss", *(["rewards/accuracies"] if name != "kto_unpaired" else []), "rewards/margins",
                             "rewards/chosen, rewards/rejected"]
    lineage = json.loads((run / "lineage.json").read_text())
    assert lineage["stage"] == name.split("_")[0] and lineage["summary"]["steps"] == 2
    records = read_jsonl(run / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert len(train) == 2 and all(math.isfinite(r["loss"]) for r in train)
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals][0] == 0 and len(evals) >= 3  # before, after each step
    keys = KEYS + (["rewards/accuracies"] if name != "kto_unpaired" else [])
    assert all(math.isfinite(r[f"eval_{k}"]) for r in evals for k in keys)
    if name.startswith("kto"):
        assert all(r["kl"] >= 0 for r in train) and all(r["eval_kl"] >= 0 for r in evals)
        assert train[-1]["trained_completions"] == 8
        # step 0: policy == reference (fresh LoRA), so rewards and z0 are 0 and each row's loss is weight / 2
        assert evals[0]["eval_rewards/margins"] == 0 and evals[0]["eval_kl"] == 0
        if name == "kto":
            assert evals[0]["eval_loss"] == pytest.approx(0.5, abs=1e-6)
        else:  # desirable rows 1 x 0.5, undesirable 2 x 0.5
            assert 0.5 <= evals[0]["eval_loss"] <= 1.0
    else:
        assert train[-1]["trained_pairs"] == 8
        assert ("nll_loss" in train[0]) == (name == "orpo")

def test_kto_report_and_weights(workspace):
    report = json.loads((workspace / "kto_unpaired" / "data_report.json").read_text())
    b = report["kto_balance"]
    assert report["kind"] == "unpaired" and b["desirable"] + b["undesirable"] == report["train_sequences"]
    assert b["undesirable_weight"] == 2.0
    paired = json.loads((workspace / "kto" / "data_report.json").read_text())
    assert paired["kto_balance"]["ratio"] == 1.0 and paired["train_sequences"] == 2 * paired["train_rows"]


def test_orpo_export_from_the_base(workspace):
    run = workspace / "orpo"
    assert main(["export", str(run)]) == 0
    report = json.loads((run / "merged" / "verification.json").read_text())
    assert report["passed"] and len(report["merged_adapters"]) == 1


@pytest.mark.parametrize("name", ["simpo", "kto"])
def test_validate_renders_an_example(workspace, name, capsys, tmp_path):
    assert main(["validate", str(workspace / f"{name}.yaml"), f"output.dir={tmp_path / 'new'}"]) == 0
    out = capsys.readouterr().out
    assert "«" in out
    if name == "kto":
        assert "[desirable]" in out or "[undesirable]" in out
        assert "KTO balance" in out
    else:
        assert "[chosen]" in out and "[rejected]" in out


@pytest.mark.parametrize("command", ["orpo", "simpo", "kto"])
def test_help_exits_zero(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert f"{command}.beta" in out
