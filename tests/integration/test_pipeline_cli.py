"""`llmtune pipeline` through the CLI on a tiny random Llama: SFT -> on-policy pairs -> DPO (on those pairs) -> PPO
-> export, then the same command again (everything skipped, nothing touched), an interrupted DPO (resumed from its
checkpoint, PPO and export redone because their input changed), a changed recipe (refused), and an interrupted
pairs step (continued after its last complete batch, same pairs)."""

import json
import shutil

import pytest
import yaml

from llmtune.commands.cli import main
from llmtune.config import DataConfig
from llmtune.data import build_preference_data
from llmtune.models.tiny import save_tiny_model
from llmtune.pipeline.pairs import build_pairs, read_samples
from llmtune.rewards.sources import RewardModelScorer, Scored
from llmtune.pipeline.spec import load_pipeline
from llmtune.utils import read_jsonl

pytestmark = pytest.mark.slow

QA = [("What is 2 + 3?", "It is 5. #### 5"), ("What is 12 * 7?", "12 * 7 = 84. #### 84"),
      ("Say hello.", "Hello! #### 1"), ("Name a color.", "Blue. #### 2")]
TOY_REWARD = '''
def score(prompts, completions, references):
    """1 for the reference itself; prompts starting with 'tie' score every completion 0; else length mod 5."""
    return [1.0 if c == r else 0.0 if p.startswith("tie") else float(len(c) % 5)
            for p, c, r in zip(prompts, completions, references)]
'''
COMMON = {"adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0}}
TRAIN = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2, "save_steps": 1,
         "save_total_limit": 5}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    model_dir = save_tiny_model(root / "model")
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
             for _ in range(3) for q, a in QA]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    prompts = [{"prompt": f"{'tie' if i % 2 else 'ask'} {i}: {q}", "completion": a}
               for i, (q, a) in enumerate(QA * 3)]  # 12 prompts, 6 of them 'tie'
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    (root / "toy_reward.py").write_text(TOY_REWARD)
    reward = {"function": f"{root / 'toy_reward.py'}:score"}
    stages = [
        {"name": "sft", "stage": "sft", "recipe": {
            "model": {"name_or_path": str(model_dir)}, "train": TRAIN, **COMMON,
            "data": {"datasets": [{"path": str(root / "sft.jsonl")}], "max_length": 64, "val_size": 2}}},
        {"name": "pairs", "kind": "pairs", "data": {"datasets": [{"path": str(root / "prompts.jsonl")}],
                                                    "max_length": 64},
         "k": 3, "reward": reward, "max_new_tokens": 6, "batch_size": 4},
        {"name": "dpo", "stage": "dpo", "recipe": {
            "data": {"datasets": [{"path": "{pairs}"}], "max_length": 64, "val_size": 2}, "train": TRAIN, **COMMON}},
        {"name": "ppo", "stage": "ppo", "recipe": {
            "data": {"datasets": [{"path": str(root / "prompts.jsonl")}], "max_length": 64, "val_size": 2},
            "reward": reward, "ppo": {"rollout_batch_size": 4, "ppo_epochs": 1}, "rollout": {"max_new_tokens": 6},
            "train": TRAIN, **COMMON}},
    ]
    path = root / "pipeline.yaml"
    path.write_text(yaml.safe_dump({"pipeline": {"dir": str(root / "runs"), "stages": stages,
                                                 "export": {"dtype": "fp32"}}}))
    assert main(["pipeline", str(path)]) == 0
    return root, path


def summary(root):
    return {r["name"]: r for r in json.loads((root / "runs" / "pipeline_summary.json").read_text())["steps"]}


def snapshot(root):
    """mtime and bytes of every file the pipeline wrote (pipeline_summary.json included)."""
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted((root / "runs").rglob("*")) if p.is_file()}


def test_chain_lineage_and_summary(workspace):
    root, _ = workspace
    runs = root / "runs"
    for name in ("sft", "dpo", "ppo"):
        assert (runs / name / "lineage.json").is_file()
    ppo = json.loads((runs / "ppo" / "lineage.json").read_text())
    assert [e["stage"] for e in ppo["previous_adapters"]] == ["sft", "dpo"]  # ppo continued dpo, dpo continued sft
    assert ppo["from_run"] == str(runs / "dpo")
    verification = json.loads((runs / "merged" / "verification.json").read_text())
    assert verification["passed"] and verification["run_dir"] == str(runs / "ppo")
    rows = summary(root)
    assert [rows[n]["action"] for n in ("sft", "pairs", "dpo", "ppo", "export")] == ["trained", "built", "trained",
                                                                                      "trained", "exported"]
    assert rows["sft"]["steps"] == 2 and rows["sft"]["metric"] == "eval_loss" and rows["sft"]["metric_value"] > 0
    assert rows["dpo"]["metric"] == "eval_rewards/accuracies" and 0 <= rows["dpo"]["metric_value"] <= 1
    assert rows["ppo"]["metric"] == "eval_score"
    assert rows["export"]["artifact"] == str(runs / "merged")


def test_pairs_file_and_report(workspace):
    root, _ = workspace
    out = root / "runs" / "pairs"
    report = json.loads((out / "pairs_report.json").read_text())
    samples = read_samples(out / "samples.jsonl")
    pairs = read_jsonl(out / "pairs.jsonl")
    assert report["prompts"] == len(samples) == 12 and report["completions"] == 36
    assert report["pairs"] == len(pairs) and report["pairs"] + sum(report["no_pair"].values()) == 12
    assert len(report["no_pair_indices"]) == sum(report["no_pair"].values())
    by_index = {s["index"]: s for s in samples}
    for pair in pairs:
        sample = by_index[pair["index"]]
        assert pair["chosen_score"] > pair["rejected_score"]
        rejected = pair["rejected"][0]["content"]
        assert rejected in sample["completions"] and pair["rejected_score"] == min(sample["scores"])
        if pair["source"] == "reference":
            assert pair["chosen"][0]["content"] == sample["reference"] and pair["chosen_score"] == 1.0
        else:
            assert pair["chosen_score"] == max(sample["scores"])
    ties = [s for s in samples if s["prompt"][-1]["content"].startswith("tie")]
    assert len(ties) == 6 and all(s["scores"] == [0.0, 0.0, 0.0] for s in ties)
    paired = {p["index"]: p["source"] for p in pairs}
    assert all(paired[s["index"]] == "reference" for s in ties)  # all tied -> the reference answer is chosen
    # the data layer reads the file as it is
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "runs" / "sft" / "adapter")
    data = build_preference_data(DataConfig(datasets=[{"path": str(out / "pairs.jsonl")}], max_length=64), tokenizer)
    assert data.report.sources[0].format == "preference_messages" and len(data.train) == len(pairs)


def test_rerun_skips_everything_untouched(workspace):
    root, path = workspace
    before = snapshot(root)
    assert main(["pipeline", str(path)]) == 0
    assert snapshot(root) == before  # pipeline_summary.json too: it keeps the numbers of the run that trained
    assert [summary(root)[n]["action"] for n in ("sft", "pairs", "dpo", "ppo", "export")] == [
        "trained", "built", "trained", "trained", "exported"]


def test_changed_recipe_is_refused(workspace, capsys):
    root, path = workspace
    before = snapshot(root)
    assert main(["pipeline", str(path), "dpo.dpo.beta=0.5"]) == 1
    err = capsys.readouterr().err
    assert "'dpo'" in err and "dpo.beta: 0.1 -> 0.5" in err and "dpo.output.overwrite=true" in err
    assert snapshot(root) == before


def test_interrupted_stage_resumes(workspace):
    """DPO killed after checkpoint-1 of 2: the rerun continues at step 2 (checkpoint-1 and the logged step-1 lines
    stay as they were), then trains PPO again (its input changed) and exports again."""
    root, path = workspace
    dpo = root / "runs" / "dpo"
    (dpo / "lineage.json").unlink()
    shutil.rmtree(dpo / "adapter")
    shutil.rmtree(dpo / "checkpoints" / "checkpoint-2")
    kept = [line for line in (dpo / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 1]
    (dpo / "metrics.jsonl").write_text("".join(line + "\n" for line in kept))
    ckpt = dpo / "checkpoints" / "checkpoint-1" / "trainer_state.json"
    ckpt_mtime, sft_adapter = ckpt.stat().st_mtime_ns, (root / "runs" / "sft" / "adapter").stat().st_mtime_ns
    ppo_lineage = (root / "runs" / "ppo" / "lineage.json").stat().st_mtime_ns

    assert main(["pipeline", str(path)]) == 0
    rows = summary(root)
    # sft and pairs were skipped: the summary keeps the numbers of the first run, which did their work
    assert [rows[n]["action"] for n in ("sft", "pairs", "dpo", "ppo", "export")] == ["trained", "built", "resumed",
                                                                                      "retrained", "exported"]
    assert ckpt.stat().st_mtime_ns == ckpt_mtime  # a restart would have deleted and rewritten it
    lines = (dpo / "metrics.jsonl").read_text().splitlines()
    assert lines[:len(kept)] == kept
    assert [json.loads(x)["step"] for x in lines if "loss" in json.loads(x)] == [1, 2]  # step 1 not trained again
    assert json.loads((dpo / "lineage.json").read_text())["summary"]["steps"] == 2
    assert (root / "runs" / "sft" / "adapter").stat().st_mtime_ns == sft_adapter
    assert (root / "runs" / "ppo" / "lineage.json").stat().st_mtime_ns > ppo_lineage


def test_interrupted_pairs_continue_with_the_same_pairs(workspace, tmp_path):
    root, path = workspace
    pipe = load_pipeline(path, base_dir=root)
    step, policy = pipe.step("pairs"), pipe.step("sft").dir
    full = (root / "runs" / "pairs" / "samples.jsonl").read_text().splitlines()
    (tmp_path / "samples.jsonl").write_text("".join(x + "\n" for x in full[:6]) + full[6][:20])  # killed mid-batch
    report = build_pairs(step.pairs, tmp_path, policy, base_dir=root)
    assert (tmp_path / "samples.jsonl").read_text().splitlines() == full  # prompts 4.. sampled again, same seeds
    assert (tmp_path / "pairs.jsonl").read_text() == (root / "runs" / "pairs" / "pairs.jsonl").read_text()
    assert report["prompts"] == 12


def test_pairs_scored_by_a_reward_model_run(workspace, tmp_path):
    """reward.from_run: an rm run scores every completion; a score does not depend on the batch it was read in."""
    root, path = workspace
    pairs = [{"prompt": q, "chosen": a, "rejected": "No."} for _ in range(3) for q, a in QA]
    (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in pairs))
    recipe = {"stage": "rm", "model": {"name_or_path": str(root / "model")}, **COMMON,
              "data": {"datasets": [{"path": str(tmp_path / "prefs.jsonl")}], "max_length": 64},
              "train": {**TRAIN, "save_steps": None}, "output": {"dir": str(tmp_path / "rm")}}
    (tmp_path / "rm.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["rm", str(tmp_path / "rm.yaml")]) == 0
    step = load_pipeline(path, [f"pairs.reward.from_run={tmp_path / 'rm'}", "pairs.reward.function=null",
                                "pairs.reward.batch_size=5"], base_dir=root).step("pairs")
    (tmp_path / "out").mkdir()
    report = build_pairs(step.pairs, tmp_path / "out", root / "runs" / "sft", base_dir=root)
    samples = read_samples(tmp_path / "out" / "samples.jsonl")
    assert report["prompts"] == 12 and all(len(set(s["scores"])) > 1 for s in samples)  # real-valued scores differ
    for pair in read_jsonl(tmp_path / "out" / "pairs.jsonl"):
        assert pair["source"] == "completions" and pair["chosen_score"] > pair["rejected_score"]
    scorer = RewardModelScorer(tmp_path / "rm", batch_size=1)  # one at a time: no padding
    first = samples[0]
    row = {"messages": json.dumps(first["prompt"])}
    alone = scorer(Scored([row] * len(first["completions"]), first["completions"])).tolist()
    assert alone == pytest.approx(first["scores"], abs=1e-5)
    assert scorer(Scored([row], [first["reference"]])).tolist() == pytest.approx([first["reference_score"]], abs=1e-5)
