"""`llmtune pipeline` without training: loading, wiring, validation of every step at once, when_missing, overrides,
the skip/resume/restart decision on fabricated run directories, and the pair choice rule."""

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml

from llmtune.config import RecipeError, dump_recipe
from llmtune.pipeline.pairs import choose_pair
from llmtune.pipeline.spec import PipelineError, load_pipeline
from llmtune.pipeline.run import plan_stage

ROOT = Path(__file__).resolve().parents[3]
QUICKSTART = ROOT / "recipes" / "quickstart_pipeline.yaml"


def write(path: Path, doc: dict) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def quickstart(tmp_path, overrides=()):
    """The shipped pipeline resolved from tmp/main."""
    base = tmp_path / "main"
    base.mkdir()
    return load_pipeline(QUICKSTART, overrides, base_dir=base)


def test_quickstart_pipeline_wiring(tmp_path):
    pipe = quickstart(tmp_path)
    d = tmp_path / "main" / "runs" / "quickstart_pipeline"
    assert [(s.name, s.kind) for s in pipe.steps] == [("sft", "sft"), ("pairs", "pairs"), ("rm", "rm"),
                                                      ("dpo", "dpo"), ("ppo", "ppo")]
    sft, pairs, rm, dpo, ppo = pipe.steps
    assert sft.recipe.model.from_run is None and sft.recipe.output.dir == str(d / "sft")
    assert sft.recipe.train.max_steps == 24 and sft.recipe.data.val_size == 50  # step overrides on the file
    assert rm.recipe.model.from_run == str(d / "sft")  # RM initialised from the SFT model
    assert dpo.recipe.model.from_run == str(d / "sft")  # the file's runs/quickstart_sft is rewired
    assert ppo.recipe.model.from_run == str(d / "dpo")
    functions = {(f.function, f.weight) for f in ppo.recipe.reward.functions}  # correctness + format: a signal
    assert functions == {("llmtune.rewards:gsm8k_reward", 1.0), ("llmtune.rewards:format_reward", 0.5)}
    assert ppo.recipe.reward.from_run is None and ppo.inputs == ["dpo"]
    assert all(s.recipe.train.eval_at_start for s in (sft, rm, dpo, ppo))  # before -> after for every stage
    assert pipe.export.step == "ppo" and pipe.export.dtype == "fp32"
    source = rm.recipe.data.datasets[0]
    # on-policy GSM8K pairs instead of the file's builtin:hh-rlhf-harmless (HH pairs do not move in this budget)
    assert (source.path, source.format) == (str(d / "pairs" / "pairs.jsonl"), "preference_messages")
    assert pairs.used and rm.inputs == ["sft", "pairs"] and dpo.inputs == ["sft", "pairs"]
    assert pairs.pairs.from_ == "sft" and pairs.pairs.k == 2
    assert dpo.recipe.data.datasets[0].path == source.path


def test_quickstart_pipeline_time_budget_shape():
    """The step counts the quickstart was measured with (README, docs/getting-started.md: ~40 min on 2 cores)."""
    pipe = load_pipeline(QUICKSTART, base_dir=ROOT)
    steps = {s.name: s.recipe.train.max_steps for s in pipe.steps if s.recipe is not None}
    assert steps == {"sft": 24, "rm": 12, "dpo": 12, "ppo": 12}


def test_cli_overrides_name_the_step(tmp_path):
    pipe = quickstart(tmp_path, ["sft.train.max_steps=3", "pairs.k=3", "pipeline.export.dtype=bf16",
                                        "ppo.reward.functions=[]", "pipeline.dir=runs/other"])
    sft, pairs, rm, _dpo, ppo = pipe.steps
    assert sft.recipe.train.max_steps == 3 and pairs.pairs.k == 3 and pipe.export.dtype == "bf16"
    other = tmp_path / "main" / "runs" / "other"
    assert sft.recipe.output.dir == str(other / "sft")
    assert ppo.recipe.reward.from_run == str(other / "rm") and ppo.inputs == ["rm", "dpo"]  # wired to the RM step


def test_unknown_override_step(tmp_path):
    with pytest.raises(RecipeError) as err:
        quickstart(tmp_path, ["sfft.train.max_steps=3"])
    assert "did you mean 'sft'?" in str(err.value)


def tiny_pipeline(tmp_path, stages, **extra):
    return write(tmp_path / "p.yaml", {"pipeline": {"dir": str(tmp_path / "runs"), "stages": stages, **extra}})


def test_every_problem_of_every_step_at_once(tmp_path):
    (tmp_path / "sft.yaml").write_text("stage: sft\ntrain: {lerning_rate: 0.1}\n")
    path = tiny_pipeline(tmp_path, [
        {"name": "sft", "recipe": "sft.yaml"},
        {"name": "pairs", "kind": "pairs", "kk": 3, "reward": {"function": "llmtune.rewards:gsm8k_rewrd"},
         "data": {"datasets": [{"path": "builtin:gsm8k"}], "max_lenght": 5}},
        {"name": "dpo", "stage": "dpo", "recipe": {"data": {"datasets": [{"path": "{later}"}, {"path": "nope.jsonl"}]}}},
        {"name": "later", "stage": "dpo", "overrides": {"train.max_steps": 0}},
        {"name": "later", "stage": "sft"},
    ])
    with pytest.raises(RecipeError) as err:
        load_pipeline(path, base_dir=tmp_path)
    problems = dict(err.value.problems)
    assert problems["stage 1 'sft': train.lerning_rate"] == "unknown key; did you mean 'learning_rate'?"
    assert problems["stage 2 'pairs': kk"] == "unknown key; did you mean 'k'?"
    assert problems["stage 2 'pairs': data.max_lenght"] == "unknown key; did you mean 'max_length'?"
    assert "did you mean gsm8k_reward" in problems["stage 2 'pairs': reward.function"]
    assert "runs later" in problems["stage 3 'dpo': data.datasets.0.path"]
    assert problems["stage 3 'dpo': data.datasets.1.path"].startswith("file not found")
    assert "unique name" in problems["pipeline.stages.3.name"] and "pipeline.stages.4.name" in problems
    assert str(err.value).startswith(f"{len(err.value.problems)} problem(s) in {path}")


def test_step_settings_win_over_wiring(tmp_path):
    path = tiny_pipeline(tmp_path, [
        {"name": "a", "stage": "sft"},
        {"name": "b", "stage": "sft", "recipe": {"model": {"from_run": None}}},  # a second SFT from the base
        {"name": "c", "stage": "dpo", "overrides": {"model.from_run": "{a}"}},
        {"name": "r", "stage": "rm"},
        {"name": "p", "stage": "ppo", "recipe": {"reward": {"from_run": "{r}"}, "train": {"max_steps": 4}}},
    ], export={"step": "c"})
    pipe = load_pipeline(path, base_dir=tmp_path)
    a, b, c, r, p = pipe.steps
    assert b.recipe.model.from_run is None and c.recipe.model.from_run == str(a.dir) and c.inputs == ["a"]
    assert r.recipe.model.from_run == str(c.dir)
    assert p.recipe.reward.from_run == str(r.dir) and p.recipe.model.from_run == str(c.dir)
    assert pipe.export.step == "c"


def test_export_must_name_a_policy_step(tmp_path):
    path = tiny_pipeline(tmp_path, [{"name": "r", "stage": "rm"}])
    with pytest.raises(RecipeError, match="pipeline.export.step"):
        load_pipeline(path, base_dir=tmp_path)
    path = tiny_pipeline(tmp_path, [{"name": "r", "stage": "rm"}], export={"enabled": False})
    assert load_pipeline(path, base_dir=tmp_path).export.step is None


def test_export_gguf_types_validated(tmp_path):
    """pipeline.export.gguf names GGUF types (llmtune export --gguf); an unknown one is an error at its key."""
    path = tiny_pipeline(tmp_path, [{"name": "c", "stage": "sft"}], export={"gguf": ["q4_k_m", "f16"]})
    pipe = load_pipeline(path, base_dir=tmp_path)
    assert pipe.export.gguf == ["q4_k_m", "f16"] and pipe.export.modelfile
    assert load_pipeline(tiny_pipeline(tmp_path, [{"name": "c", "stage": "sft"}]), base_dir=tmp_path).export.gguf == []
    path = tiny_pipeline(tmp_path, [{"name": "c", "stage": "sft"}], export={"gguf": ["q9_k"]})
    with pytest.raises(RecipeError, match=r"pipeline\.export\.gguf"):
        load_pipeline(path, base_dir=tmp_path)


# --- skip / resume / restart decisions on fabricated run directories ----------------------------------------------


@pytest.fixture
def one_step(tmp_path):
    path = tiny_pipeline(tmp_path, [{"name": "sft", "stage": "sft", "recipe": {"model": {"name_or_path": "x"}}},
                                    {"name": "dpo", "stage": "dpo"}])
    return path, load_pipeline(path, base_dir=tmp_path)


def fake_run(step, complete: bool, checkpoint: bool = False):
    step.dir.mkdir(parents=True, exist_ok=True)
    dump_recipe(step.recipe, step.dir / "recipe.resolved.yaml")
    if checkpoint:
        ckpt = step.dir / "checkpoints" / "checkpoint-3"
        ckpt.mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text("{}")
    if complete:
        (step.dir / "lineage.json").write_text(json.dumps({"stage": step.kind, "summary": {}}))


def test_plan_complete_same_recipe_is_skipped(one_step):
    _path, pipe = one_step
    fake_run(pipe.steps[0], complete=True)
    assert plan_stage(pipe.steps[0], pipe)[0] == "skip"


def test_plan_complete_rm_step_is_skipped(tmp_path):
    """run_stage records an RM recipe with the score head added to modules_to_save: not a change of recipe (the
    real quickstart pipeline refused to skip its finished rm step because of it)."""
    from llmtune.stages import RMStage

    path = tiny_pipeline(tmp_path, [{"name": "rm", "stage": "rm", "recipe": {"model": {"name_or_path": "x"}}}],
                         export={"enabled": False})
    pipe = load_pipeline(path, base_dir=tmp_path)
    step = pipe.steps[0]
    step.dir.mkdir(parents=True)
    recorded = RMStage(step.recipe.model_copy(deep=True)).recipe  # what run_stage dumps
    assert recorded.adapter.modules_to_save == ["score"] and step.recipe.adapter.modules_to_save == []
    dump_recipe(recorded, step.dir / "recipe.resolved.yaml")
    (step.dir / "lineage.json").write_text(json.dumps({"stage": "rm", "summary": {}}))
    assert plan_stage(step, pipe)[0] == "skip"


def test_plan_complete_other_recipe_stops_with_the_remedy(one_step, tmp_path):
    path, pipe = one_step
    fake_run(pipe.steps[0], complete=True)
    changed = load_pipeline(path, ["sft.train.learning_rate=0.5"], base_dir=tmp_path)
    with pytest.raises(PipelineError) as err:
        plan_stage(changed.steps[0], changed)
    assert "train.learning_rate: 0.0002 -> 0.5" in str(err.value)
    assert "sft.output.overwrite=true" in str(err.value) and str(pipe.steps[0].dir) in str(err.value)
    forced = load_pipeline(path, ["sft.train.learning_rate=0.5", "sft.output.overwrite=true"], base_dir=tmp_path)
    action, recipe, _ = plan_stage(forced.steps[0], forced)
    assert action == "restart" and recipe.output.overwrite and recipe.train.resume_from is None


def test_plan_interrupted_run_resumes_and_partial_restarts(one_step):
    _path, pipe = one_step
    sft = pipe.steps[0]
    fake_run(sft, complete=False, checkpoint=True)
    action, recipe, why = plan_stage(sft, pipe)
    assert (action, recipe.train.resume_from, recipe.output.overwrite) == ("resume", "latest", False)
    assert "checkpoint-3" in why
    shutil.rmtree(sft.dir / "checkpoints")
    action, recipe, _ = plan_stage(sft, pipe)
    assert (action, recipe.output.overwrite) == ("restart", True)
    shutil.rmtree(sft.dir)
    assert plan_stage(sft, pipe)[0] == "train"


def test_plan_stale_input_retrains(one_step):
    """A step whose input finished after it started trained on an old input: it is trained again."""
    _path, pipe = one_step
    sft, dpo = pipe.steps
    fake_run(sft, complete=True)
    fake_run(dpo, complete=True)
    dpo.recipe = dpo.recipe  # same recipe: only the timestamps differ
    t = (dpo.dir / "recipe.resolved.yaml").stat().st_mtime
    os.utime(sft.dir / "lineage.json", (t + 10, t + 10))
    action, recipe, why = plan_stage(dpo, pipe)
    assert action == "restart" and recipe.output.overwrite and "sft" in why


# --- pipeline_summary.json across reruns ------------------------------------------------------------------------------


def test_a_rerun_keeps_the_numbers_of_the_runs_that_did_the_work(one_step, monkeypatch):
    """Training faked with a fake clock (s): run 1 trains sft (1000) and dpo (500); run 2 skips both (0.2 each);
    run 3 retrains dpo (400); run 4 finds sft's artifact changed behind the summary (other numbers in its lineage)."""
    import io

    from rich.console import Console

    from llmtune.pipeline import run as pl

    _path, pipe = one_step
    pipe.export.enabled = False
    clock = [0.0]
    monkeypatch.setattr(pl.time, "perf_counter", lambda: clock[0])
    todo = {}  # step name -> (action, seconds, train_loss) of the next invocation

    def fake_training(step, _pipe, _console):
        action, seconds, loss = todo[step.name]
        clock[0] += seconds
        if action != "skipped":
            step.dir.mkdir(parents=True, exist_ok=True)
            summary = {"steps": 2, "train_loss": loss, "wall_s": seconds - 10, "eval_after": {"eval_loss": 0.5}}
            step.done_marker.write_text(json.dumps({"stage": step.kind, "summary": summary}))
        return {"action": action}

    monkeypatch.setattr(pl, "_run_training", fake_training)
    path = pipe.dir / "pipeline_summary.json"

    def run(**actions):
        todo.update(actions)
        pl.run_pipeline(pipe, Console(file=io.StringIO()))
        doc = json.loads(path.read_text())
        return doc, {r["name"]: (r["action"], r["wall_s"], r["trained_wall_s"]) for r in doc["steps"]}

    doc, rows = run(sft=("trained", 1000.0, 2.0), dpo=("trained", 500.0, 0.7))
    assert rows == {"sft": ("trained", 1000.0, 990.0), "dpo": ("trained", 500.0, 490.0)}
    assert (doc["wall_s"], doc["last_run_wall_s"]) == (1500.0, 1500.0)
    before = (path.read_bytes(), path.stat().st_mtime_ns)

    run(sft=("skipped", 0.2, None), dpo=("skipped", 0.2, None))  # nothing to do: the file stays as it was
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before

    doc, rows = run(dpo=("retrained", 400.0, 0.6))
    assert rows == {"sft": ("trained", 1000.0, 990.0), "dpo": ("retrained", 400.0, 390.0)}
    assert (doc["wall_s"], doc["last_run_wall_s"]) == (1400.2, 400.2)  # 0.2 (sft skipped) + 400 now + 1000 kept

    (pipe.steps[0].done_marker).write_text(json.dumps({"stage": "sft", "summary": {"steps": 2, "train_loss": 1.9,
                                                                                     "wall_s": 42.0}}))
    doc, rows = run(sft=("skipped", 0.2, None), dpo=("skipped", 0.2, None))
    assert rows == {"sft": ("skipped", 0.2, 42.0), "dpo": ("retrained", 400.0, 390.0)}  # sft: not the run above
    assert (doc["wall_s"], doc["last_run_wall_s"]) == (400.4, 0.4)


# --- the pair rule ----------------------------------------------------------------------------------------------------


def test_choose_pair_best_vs_worst():
    pick = choose_pair([0.2, 0.9, -0.5, 0.9], ["a", "b", "c", "d"], "ref", 5.0)
    assert pick == {"chosen": "b", "rejected": "c", "chosen_score": 0.9, "rejected_score": -0.5,
                    "source": "completions"}


def test_choose_pair_reference_when_all_tied():
    pick = choose_pair([0.0, 0.0, 0.0], ["x", "y", "z"], "#### 7", 1.0)
    assert pick["source"] == "reference" and (pick["chosen"], pick["rejected"]) == ("#### 7", "x")
    assert choose_pair([0.0, 0.0], ["x", "y"], "#### 7", 1.0, use_reference=False) == "all completions scored alike"
    assert choose_pair([1.0, 1.0], ["x", "y"], "#### 7", 1.0) == "all completions scored alike, reference not better"
    assert choose_pair([0.0, 0.0], ["x", "y"], None, None) == "all completions scored alike, no reference answer"


def test_choose_pair_min_gap():
    assert choose_pair([0.1, 0.3], ["a", "b"], None, None, min_gap=0.5).startswith("all completions scored alike")
    assert choose_pair([0.1, 0.7], ["a", "b"], None, None, min_gap=0.5)["chosen"] == "b"


# --- the command ------------------------------------------------------------------------------------------------------


def test_cli_help_dry_run_and_errors(tmp_path, capsys):
    from llmtune.commands.cli import main

    with pytest.raises(SystemExit) as info:
        main(["pipeline", "--help"])
    assert info.value.code == 0 and "--dry-run" in capsys.readouterr().out
    path = tiny_pipeline(tmp_path, [{"name": "sft", "stage": "sft"}, {"name": "dpo", "stage": "dpo"}])
    assert main(["pipeline", str(path), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert "recipe OK" in err and "dpo" in err and not (tmp_path / "runs").exists()  # nothing written
    assert main(["pipeline", str(path), "dpo.train.micro_batch_size=3", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert "stage 2 'dpo': train.global_batch_size: must be a multiple of micro_batch_size (3)" in err


def test_plan_resumes_from_the_newest_complete_checkpoint_not_a_partial_one(one_step):
    _path, pipe = one_step
    sft = pipe.steps[0]
    fake_run(sft, complete=False, checkpoint=True)
    (sft.dir / "checkpoints" / "checkpoint-5").mkdir()  # a save killed half-way (old code resumed from it)
    (sft.dir / "checkpoints" / "checkpoint-5" / "adapter_model.safetensors").write_bytes(b"x")
    action, _recipe, why = plan_stage(sft, pipe)
    assert action == "resume" and "checkpoint-3" in why
    shutil.rmtree(sft.dir / "checkpoints" / "checkpoint-3")
    assert plan_stage(sft, pipe)[0] == "restart"  # only the partial one is left: nothing to resume


def test_dry_run_reports_what_a_qlora_chain_step_would_refuse(tmp_path):
    """A QLoRA DPO step after a QLoRA SFT step stacks the SFT adapter on the 4-bit base: the two must quantize it
    alike, and the SFT adapter must be LoRA only. The dry run (nothing trained yet) reports both, as training
    would; 4-bit settings a step leaves at their defaults are inherited and are no problem (old code: valid, then
    training refused any quantized from_run)."""
    q4 = {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}
    fine = tiny_pipeline(tmp_path, [
        {"name": "sft", "stage": "sft", "recipe": {"model": q4}},
        {"name": "dpo", "stage": "dpo", "recipe": {"model": {"load_in_4bit": True}}},  # fp4 inherited
    ])
    assert load_pipeline(fine, base_dir=tmp_path).steps[1].recipe.model.load_in_4bit
    bad = tiny_pipeline(tmp_path, [
        {"name": "sft", "stage": "sft", "recipe": {"model": q4, "adapter": {"modules_to_save": ["lm_head"]}}},
        {"name": "dpo", "stage": "dpo", "recipe": {"model": {"load_in_4bit": True, "dtype": "bf16"}}},
    ])
    with pytest.raises(RecipeError) as err:
        load_pipeline(bad, base_dir=tmp_path)
    problems = dict(err.value.problems)
    assert "model.dtype: fp32" in problems["stage 2 'dpo': model.dtype"]
    assert "holds whole tensors (lm_head" in problems["stage 2 'dpo': model.from_run"]


def test_pipeline_under_a_multi_task_srun_or_a_launcher_is_refused(tmp_path, capsys, monkeypatch):
    """`srun --ntasks-per-node 8 llmtune pipeline ...` (issue 32): every task ran every step, each relaunching its own
    torchrun, and wrote the export 8 times. Refused with the way that works; a one-task srun step is fine."""
    from llmtune.commands.cli import main

    path = tiny_pipeline(tmp_path, [{"name": "sft", "stage": "sft"}])
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    srun = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "16",
            "SLURM_NTASKS": "16", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2",
            "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_LOCALID": "3", "SLURM_NODEID": "0",
            "SLURM_STEP_NODELIST": "gpu[01-02]"}  # task 3 of `srun --nodes 2 --ntasks-per-node 8`
    for key, value in srun.items():
        monkeypatch.setenv(key, value)
    assert main(["pipeline", str(path)]) == 1
    err = capsys.readouterr().err
    assert "a task of an srun step of 16 tasks" in err and "srun --ntasks 1" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):  # started by torchrun
        monkeypatch.setenv(key, {"RANK": "1", "WORLD_SIZE": "2"}.get(key, "0"))
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")
    assert main(["pipeline", str(path)]) == 1
    assert "rank 1 of 2 processes of a launcher" in capsys.readouterr().err


def test_a_multi_node_step_is_refused_at_load(tmp_path):
    """torchrun on this node would wait for the other nodes' ranks, which nothing starts."""
    path = tiny_pipeline(tmp_path, [{"name": "sft", "stage": "sft", "overrides": {"distributed.nnodes": 2}}])
    with pytest.raises(RecipeError) as err:
        load_pipeline(path, base_dir=tmp_path)
    assert any(p.endswith("distributed.nnodes") and "a pipeline runs on one node" in m for p, m in err.value.problems)
