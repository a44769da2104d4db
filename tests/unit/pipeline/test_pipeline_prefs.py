"""`llmtune pipeline` runs ORPO, SimPO and KTO as steps: wired like DPO (model.from_run = the latest earlier policy
step), from their shipped recipes, exportable, and planned to skip when complete."""

import json
from pathlib import Path

import yaml

from llmtune.config import dump_recipe
from llmtune.pipeline.spec import load_pipeline
from llmtune.pipeline.run import plan_stage

ROOT = Path(__file__).resolve().parents[3]


def test_preference_stages_as_pipeline_steps(tmp_path):
    hh = tmp_path / "hh.jsonl"
    hh.write_text("")
    data = {"data.datasets": [{"path": str(hh), "format": "hh"}]}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump({"pipeline": {"dir": str(tmp_path / "runs"), "stages": [
        {"name": "orpo", "recipe": str(ROOT / "recipes" / "quickstart_orpo.yaml"),  # first step: from the base
         "overrides": {**data, "model.from_run": None, "model.name_or_path": "builtin:smollm2-135m-instruct"}},
        {"name": "simpo", "recipe": str(ROOT / "recipes" / "quickstart_simpo.yaml"), "overrides": data},
        {"name": "kto", "overrides": {**data, "kto.desirable_weight": 1.2}},  # the step name is the stage
    ]}}))
    pipe = load_pipeline(path, base_dir=tmp_path)
    orpo, simpo, kto = pipe.steps
    assert [(s.name, s.kind) for s in pipe.steps] == [("orpo", "orpo"), ("simpo", "simpo"), ("kto", "kto")]
    assert orpo.recipe.model.from_run is None and orpo.recipe.orpo.beta == 0.1  # ORPO needs no SFT stage first
    assert simpo.recipe.model.from_run == str(orpo.dir)  # the file's runs/quickstart_sft is rewired
    assert simpo.recipe.simpo.gamma == 0.5 and simpo.recipe.output.dir == str(tmp_path / "runs" / "simpo")
    assert kto.recipe.model.from_run == str(simpo.dir) and kto.recipe.kto.desirable_weight == 1.2
    assert pipe.export.step == "kto"  # a causal-LM policy step, exported like DPO
    assert plan_stage(orpo, pipe)[0] == "train"
    orpo.dir.mkdir(parents=True)
    dump_recipe(orpo.recipe, orpo.dir / "recipe.resolved.yaml")
    (orpo.dir / "lineage.json").write_text(json.dumps({"stage": "orpo", "summary": {}}))
    assert plan_stage(orpo, pipe)[0] == "skip"  # a finished step is not trained again


def test_shipped_comparison_pipeline(tmp_path):
    """recipes/quickstart_prefs_pipeline.yaml: three steps, each from the SFT run (not chained), same held-out size."""
    pipe = load_pipeline(ROOT / "recipes" / "quickstart_prefs_pipeline.yaml", base_dir=tmp_path)
    assert [(s.name, s.kind) for s in pipe.steps] == [("orpo", "orpo"), ("simpo", "simpo"), ("kto", "kto")]
    assert {(s.recipe.data.datasets[0].path, s.recipe.data.datasets[0].format) for s in pipe.steps} == {
        ("builtin:hh-rlhf-harmless", "auto")}  # the pairs shipped with llmtune (their format: the builtin's own, hh)
    assert {s.recipe.model.from_run for s in pipe.steps} == {"runs/quickstart_sft"}
    assert {s.recipe.data.val_size for s in pipe.steps} == {16} and {s.recipe.train.max_steps for s in pipe.steps} == {8}
    assert pipe.export.step is None
