"""Crash-safe checkpoints, resume planning, metrics.jsonl repair and signal handling (llmtune.core.checkpoint,
rundir, callbacks, preempt) on hand-built directories."""

import json
import logging
import signal

import pytest
import torch

from llmtune.config import RecipeError
from llmtune.core import checkpoint as ck
from llmtune.core.callbacks import read_metrics, truncate_metrics
from llmtune.core.preempt import PreemptedError, StopOnSignalCallback, StopRequest
from llmtune.core.rundir import RunDir
from llmtune.utils import append_jsonl, read_jsonl


@pytest.fixture
def logs(caplog):
    """Captured llmtune log lines (the package logger does not propagate once the CLI set up its handler)."""
    logger = logging.getLogger("llmtune")
    logger.addHandler(caplog.handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)


def make_checkpoint(root, step, complete=True, files=("adapter_model.safetensors", "optimizer.pt")):
    path = root / "checkpoints" / f"checkpoint-{step}"
    path.mkdir(parents=True)
    for name in files:
        (path / name).write_bytes(b"x" * 10)
    (path / ck.TRAINER_STATE).write_text(json.dumps({"global_step": step}))
    if complete:
        ck.write_marker(path, step)
    else:  # what transformers leaves when killed during a save: files, no trainer_state.json
        (path / ck.TRAINER_STATE).unlink()
    return path


def test_marker_makes_a_checkpoint_complete_and_detects_a_short_file(tmp_path):
    path = make_checkpoint(tmp_path, 2)
    assert ck.is_complete(path)
    (path / "optimizer.pt").write_bytes(b"x" * 3)  # truncated after the marker was written (no fsync honoured)
    assert "optimizer.pt has 3 bytes, 10 were written" == ck.why_incomplete(path)
    assert not ck.is_complete(make_checkpoint(tmp_path, 3, complete=False))
    legacy = tmp_path / "checkpoints" / "checkpoint-1"  # written before markers existed: trainer_state.json is last
    legacy.mkdir()
    (legacy / ck.TRAINER_STATE).write_text("{}")
    assert ck.is_complete(legacy)


def test_latest_skips_partial_checkpoints_and_says_so(tmp_path, logs):
    make_checkpoint(tmp_path, 2)
    make_checkpoint(tmp_path, 4, complete=False)
    staged = tmp_path / "checkpoints" / ck.STAGING / "checkpoint-6"
    staged.mkdir(parents=True)
    run = RunDir(tmp_path)
    found = run.resolve_resume("latest")
    assert found.name == "checkpoint-2"  # old code: transformers' get_last_checkpoint -> the partial checkpoint-4
    assert "checkpoint-4: incomplete" in logs.text and "left in place" in logs.text
    assert (tmp_path / "checkpoints" / "checkpoint-4").is_dir() and staged.is_dir()  # nothing deleted


def test_latest_without_a_complete_checkpoint_names_the_partial_ones(tmp_path):
    make_checkpoint(tmp_path, 3, complete=False)
    with pytest.raises(RecipeError) as info:
        RunDir(tmp_path).resolve_resume("latest")
    assert "no complete checkpoint (incomplete, skipped: checkpoint-3)" in str(info.value)
    with pytest.raises(RecipeError, match="not a complete checkpoint"):
        RunDir(tmp_path).resolve_resume(str(tmp_path / "checkpoints" / "checkpoint-3"))


def test_auto_resumes_an_unfinished_run_and_starts_fresh_when_nothing_is_kept(tmp_path):
    run = RunDir(tmp_path / "run")
    assert run.plan("auto", overwrite=False) is None  # new directory
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "recipe.resolved.yaml").write_text("stage: sft\n")  # a failed set-up attempt
    assert run.plan("auto", overwrite=False) is None  # starts fresh instead of refusing
    with pytest.raises(RecipeError, match="no complete checkpoint: start it again with train.resume_from=auto"):
        run.plan(None, overwrite=False)  # never resuming: refused, with a hint that works
    make_checkpoint(tmp_path / "run", 2)
    assert run.plan("auto", overwrite=False).name == "checkpoint-2"
    assert run.plan("auto", overwrite=True) is None  # overwrite replaces the run
    (tmp_path / "run" / "lineage.json").write_text("{}")  # finished: auto neither resumes nor mixes
    with pytest.raises(RecipeError, match="already holds a run; it finished"):
        run.plan("auto", overwrite=False)
    assert run.plan("latest", overwrite=False).name == "checkpoint-2"  # extending a finished run stays possible


def test_fresh_start_after_a_failed_attempt_keeps_partial_checkpoints(tmp_path, logs):
    root = tmp_path / "run"
    root.mkdir()
    for name in ("recipe.resolved.yaml", "data_report.json", "metrics.jsonl"):
        (root / name).write_text("old")
    (root / "plots").mkdir()
    (root / "plots" / "summary.png").write_text("old")
    partial = make_checkpoint(root, 1, complete=False)
    RunDir(root).prepare(resume=False, overwrite=False, resume_from="auto")
    assert not (root / "recipe.resolved.yaml").exists() and not (root / "metrics.jsonl").exists()
    assert not (root / "plots").exists()  # the old attempt's curves are not shown as this run's
    assert partial.is_dir() and "starting again" in logs.text and "checkpoint-1: incomplete" in logs.text


def test_rotation_counts_only_complete_checkpoints_and_keeps_the_newest(tmp_path):
    for step in (1, 2):
        make_checkpoint(tmp_path, step)
    for step in (3, 4):
        make_checkpoint(tmp_path, step, complete=False)
    deleted = ck.rotate(tmp_path / "checkpoints", limit=1)
    assert [p.name for p in deleted] == ["checkpoint-1"]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint-2", "checkpoint-3", "checkpoint-4"]  # the only complete one and the partial ones
    assert ck.rotate(tmp_path / "checkpoints", limit=1) == []
    make_checkpoint(tmp_path, 5)
    assert [p.name for p in ck.rotate(tmp_path / "checkpoints", 1, keep=[tmp_path / "checkpoints" / "checkpoint-2"])] \
        == []  # best (2) and newest (5) are both protected


def test_commit_is_a_rename_and_replaces_an_older_save_of_the_same_step(tmp_path):
    root = tmp_path / "checkpoints"
    old = make_checkpoint(tmp_path, 4, complete=False)
    staged = root / ck.STAGING / "checkpoint-4"
    staged.mkdir(parents=True)
    (staged / "adapter_model.safetensors").write_bytes(b"new")
    ck.write_marker(staged, 4)
    ck.commit(staged, old)
    assert ck.is_complete(old) and (old / "adapter_model.safetensors").read_bytes() == b"new"
    assert not (root / ck.STAGING).exists()


def test_estimate_counts_trainable_weights_and_adam_state():
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 1))
    model[0].requires_grad_(False)
    est = ck.estimate_checkpoint_bytes(model)
    assert est["weights"] == 11 * 4 and est["optimizer"] == 11 * 8
    assert est["total"] == est["weights"] + est["optimizer"] + est["other"]
    assert ck.estimate_checkpoint_bytes(model, master_weights=True)["optimizer"] == 11 * 12


def test_free_space_check_names_needed_and_free(tmp_path, monkeypatch):
    monkeypatch.setattr(ck, "free_bytes", lambda path: 5 * ck.MIB)
    with pytest.raises(ck.CheckpointSaveError) as info:
        ck.check_free_space(tmp_path, {"weights": 1, "optimizer": 2, "other": 20 * ck.MIB, "total": 20 * ck.MIB + 3})
    assert info.value.exit_code == 5
    assert "needs about 20.0 MiB" in str(info.value) and "only 5.0 MiB are free" in str(info.value)
    ck.check_free_space(tmp_path, {"weights": 1, "optimizer": 2, "other": 3, "total": 6})


def test_torn_metrics_lines_are_skipped_and_later_appends_stay_whole(tmp_path, logs):
    path = tmp_path / "metrics.jsonl"
    append_jsonl(path, {"step": 1, "loss": 2.0})
    with open(path, "a") as fh:
        fh.write('{"step": 2, "lo')  # cut by a crash
    append_jsonl(path, {"step": 2, "loss": 1.5})  # old code glued this to the torn fragment
    with pytest.raises(json.JSONDecodeError):
        read_jsonl(path)
    assert read_metrics(path) == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    assert "skipped 1 line(s)" in logs.text and "line 2" in logs.text


def test_resumed_steps_replace_their_earlier_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    for record in ({"step": 0, "eval_loss": 3.0}, {"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.9},
                   {"step": 2, "eval_loss": 2.5}, {"step": 3, "loss": 1.8}, {"step": 3, "train_runtime": 1.0}):
        append_jsonl(path, record)
    with open(path, "a") as fh:
        fh.write('{"step": 4')
    assert truncate_metrics(path, 2) == 2  # step 3 and the summary of the interrupted attempt
    assert [(r["step"], sorted(r)) for r in read_jsonl(path)] == [
        (0, ["eval_loss", "step"]), (1, ["loss", "step"]), (2, ["loss", "step"]), (2, ["eval_loss", "step"])]
    append_jsonl(path, {"step": 2, "loss": 1.7})  # a record repeated without truncation: the last one wins
    assert [r.get("loss") for r in read_metrics(path) if "loss" in r] == [2.0, 1.7]


def test_signal_during_training_stops_after_the_step_and_a_second_one_exits(monkeypatch):
    from transformers import TrainerControl, TrainerState, TrainingArguments

    request = StopRequest()
    callback = StopOnSignalCallback(request, can_stop=lambda: True)
    args, state, control = TrainingArguments(output_dir="/tmp/unused", report_to="none"), TrainerState(), \
        TrainerControl()
    state.global_step = 3
    callback.on_step_end(args, state, control)
    assert not control.should_save and callback.stopped is None
    request.phase = "training"
    request._handle(signal.SIGTERM, None)
    request._handle(signal.SIGTERM, None)  # the same stop delivered twice (torchrun forwards it): ignored
    callback.on_step_end(args, state, control)
    assert control.should_save and control.should_training_stop and callback.stopped == (signal.SIGTERM, 3)
    exits = []
    monkeypatch.setattr("os._exit", exits.append)
    request._first -= 10  # a user's second signal, later
    request._handle(signal.SIGINT, None)
    assert exits == [130]


def test_ppo_waits_for_the_end_of_an_iteration_and_setup_signals_raise():
    from transformers import TrainerControl, TrainerState, TrainingArguments

    request = StopRequest()
    request.phase = "training"
    request._handle(signal.SIGUSR1, None)
    control = TrainerControl()
    StopOnSignalCallback(request, can_stop=lambda: False).on_step_end(
        TrainingArguments(output_dir="/tmp/unused", report_to="none"), TrainerState(), control)
    assert not control.should_training_stop
    with pytest.raises(PreemptedError) as info:
        StopRequest()._handle(signal.SIGTERM, None)  # before training: nothing to save, stop now
    assert info.value.exit_code == 75
    with pytest.raises(KeyboardInterrupt):
        StopRequest()._handle(signal.SIGINT, None)


def test_relaunch_reports_rank_0s_exit_code_not_torchruns(tmp_path, monkeypatch):
    from llmtune.core import launch

    report = tmp_path / "code.txt"
    report.write_text("")
    monkeypatch.setenv(launch.EXIT_CODE_FILE, str(report))
    for key, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(key, value)
    exits = []
    monkeypatch.setattr("os._exit", exits.append)
    with pytest.raises(SystemExit):  # (os._exit is patched, so the function goes on to sys.exit)
        launch.exit_process(75)  # what a preempted rank 0 does
    assert exits == [75] and report.read_text() == "75"

    class FakeTorchrun:  # fails as torchrun does when a worker failed (exit 1), after rank 0 wrote its code
        def __init__(self, cmd, env):
            with open(env[launch.EXIT_CODE_FILE], "w") as fh:
                fh.write("75")

        def wait(self):
            return 1

        def poll(self):
            return 1

    monkeypatch.setattr(launch.subprocess, "Popen", FakeTorchrun)
    from llmtune.config import load_recipe

    recipe = load_recipe(raw={"stage": "sft", "model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d"}]},
                              "distributed": {"nproc_per_node": 2}}, stage="sft")
    assert launch.relaunch("sft", "r.yaml", [], recipe) == 75


def test_a_kill_during_rotation_leaves_no_partial_checkpoint(tmp_path, monkeypatch):
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step)

    def killed(path, ignore_errors=False):  # the process dies inside the deletion, after some files went
        next(p for p in sorted(path.iterdir()) if p.is_file()).unlink()
        raise KeyboardInterrupt

    monkeypatch.setattr(ck.shutil, "rmtree", killed)
    with pytest.raises(KeyboardInterrupt):
        ck.rotate(tmp_path / "checkpoints", limit=2)
    complete, partial = ck.scan(tmp_path / "checkpoints")
    # old code (rmtree in place): a checkpoint-1 missing files, a partial that rotation never counts or removes
    assert [p.name for p in complete] == ["checkpoint-2", "checkpoint-3"] and partial == []
    monkeypatch.undo()
    ck.clean_staging(tmp_path / "checkpoints")  # what the next save does first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["checkpoint-2", "checkpoint-3"]


def test_resume_allows_how_but_not_what_is_computed_to_change(tmp_path):
    """A run started before train.gradient_checkpointing: auto (resolved false) resumes under the new default;
    tokenization processes and the data cache may change too; the learning rate may not."""
    import yaml

    from llmtune.config import RecipeError, load_recipe
    from llmtune.core.rundir import RECIPE, RunDir

    old = load_recipe(raw={"train": {"gradient_checkpointing": False}, "data": {"num_proc": 1}}).model_dump(mode="json")
    del old["data"]["cache"]  # an older llmtune did not write this key
    (tmp_path / RECIPE).write_text(yaml.safe_dump(old))
    run = RunDir(tmp_path)
    run.check_resume_recipe(load_recipe(raw={"data": {"cache": False, "num_proc": 4}}).model_dump(mode="json"))
    with pytest.raises(RecipeError) as info:
        run.check_resume_recipe(load_recipe(raw={"train": {"learning_rate": 1e-3}}).model_dump(mode="json"))
    assert [key for key, _ in info.value.problems] == ["train.learning_rate"]


GRPO = {"stage": "grpo", "reward": {"function": "llmtune.rewards:gsm8k_reward"}, "train": {"max_steps": 2}}


def test_resume_may_change_where_the_rollout_engine_runs_but_not_what_it_samples(tmp_path):
    """A rollout server that died comes back at another url (or the run goes on with hf): the same command with the
    new url resumes; rollout.vllm keys that change the samples or the loss are still refused, key by key."""
    import yaml

    from llmtune.config import RecipeError, load_recipe
    from llmtune.core.rundir import RECIPE, RunDir

    old = load_recipe(raw={**GRPO, "rollout": {"engine": "vllm", "vllm": {
        "mode": "server", "url": "http://127.0.0.1:8000"}}}, stage="grpo").model_dump(mode="json")
    (tmp_path / RECIPE).write_text(yaml.safe_dump(old))
    run = RunDir(tmp_path)
    for changed in ({"engine": "vllm", "vllm": {"mode": "server", "url": "http://10.0.0.2:9000",
                                                "request_timeout_s": 30}},
                    {"engine": "hf"}):
        run.check_resume_recipe(load_recipe(raw={**GRPO, "rollout": changed},
                                            stage="grpo").model_dump(mode="json"))
    with pytest.raises(RecipeError) as info:
        run.check_resume_recipe(load_recipe(raw={**GRPO, "rollout": {"engine": "vllm", "vllm": {
            "mode": "server", "url": "http://127.0.0.1:8000", "importance_sampling_cap": 3.0}}},
            stage="grpo").model_dump(mode="json"))
    assert [key for key, _ in info.value.problems] == ["rollout.vllm.importance_sampling_cap"]


def test_no_rank_fsyncs_the_staged_checkpoint_before_every_rank_has_written_it(tmp_path, monkeypatch):
    """A rank that walks the staged tree while another still writes into it can list a file that is gone when it
    opens it (ENOENT, seen in a 2-rank GRPO run under load): the fsync comes after a collective that follows the
    writes. One process here: the collective, transformers' save and the fsync are recorded in order."""
    from types import SimpleNamespace

    from transformers import Trainer

    from llmtune.core import trainer as core_trainer

    events = []

    def transformers_save(self, model, trial):
        staged = tmp_path / ck.STAGING / f"checkpoint-{self.state.global_step}"
        staged.mkdir(parents=True)
        (staged / "rng_state_0.pth").write_bytes(b"x")
        events.append("write")

    def agree(trainer, flag):
        events.append("agree")
        return flag

    monkeypatch.setattr(Trainer, "_save_checkpoint", transformers_save)
    monkeypatch.setattr(Trainer, "_get_output_dir", lambda self, trial: str(tmp_path))
    monkeypatch.setattr(core_trainer, "all_ranks_agree", agree)
    monkeypatch.setattr(ck, "fsync_tree", lambda root: events.append("fsync"))
    trainer = object.__new__(core_trainer.CoreTrainer)
    trainer.state = SimpleNamespace(global_step=4, best_model_checkpoint=None)
    trainer.args = SimpleNamespace(world_size=1, save_total_limit=None)
    trainer.accelerator = SimpleNamespace(wait_for_everyone=lambda: events.append("barrier"))
    trainer.is_world_process_zero = lambda: True
    trainer.trained_tokens = trainer.seen_tokens = trainer.nonfinite_steps = 0
    trainer.save_extra_state = lambda staged: events.append("extra")
    trainer._save_checkpoint(None, None)
    assert events == ["barrier", "write", "extra", "agree", "fsync", "agree", "barrier"]
    assert ck.newest_complete(tmp_path, report=False) == tmp_path / "checkpoint-4"
