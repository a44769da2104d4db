"""`llmtune grpo` through the CLI on a tiny random Llama: an SFT run, then GRPO with two weighted reward functions;
run dir, metrics (per-source rewards, all-equal groups, clip fractions, KL 0 before the first update, timing),
samples, resume reproducing the uninterrupted run (also for every advantage_estimator x importance_sampling_level,
with an abstaining reward function and DAPO's overlong penalty), 4x1 == 1x4 accumulation, export loading in plain
transformers, and the pipeline step."""

import json
import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmtune.commands.cli import main
from llmtune.utils import read_jsonl
from tests.integration.flops_expect import PEAK, check_mfu
from tests.integration.plots_expect import summary_of
from tests.integration.rl_workspace import COMMON, cut_back_to_first_iteration, rl_workspace, write_recipe



def grpo_recipe(root, name, **extra):
    train = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 4, "learning_rate": 5e-2,
             "save_steps": 2, "eval_batch_size": 4, "save_total_limit": 5, **extra.pop("train", {})}
    reward = {"functions": [{"function": str(root / "my_rewards.py") + ":length_reward", "weight": 1.0},
                            {"function": "llmtune.rewards:format_reward", "weight": 0.5}]}
    return write_recipe(
        root, name, "grpo", model=extra.pop("model", {"from_run": str(root / "sft")}),
        data={"datasets": [{"path": str(root / "prompts.jsonl")}], "max_length": 64, "val_size": 4},
        grpo={"num_generations": 2, "rollout_batch_size": 8, "beta": 0.1,
              "epsilon_high": 0.28, **extra.pop("grpo", {})},
        rollout={"max_new_tokens": 8, **extra.pop("rollout", {})},
        reward=reward, train=train, output={"dir": str(root / name), "plot": extra.pop("plot", False)}, **COMMON,
        **extra)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return rl_workspace(tmp_path_factory.mktemp("grpo"))


@pytest.fixture(scope="module")
def grpo_run(workspace):
    with pytest.MonkeyPatch.context() as mp:  # a peak, so that metrics.jsonl has an MFU (test_grpo_mfu_is_logged)
        mp.setenv("LLMTUNE_PEAK_TFLOPS", str(PEAK))
        assert main(["grpo", str(grpo_recipe(workspace, "grpo", plot=True))]) == 0  # plots/ drawn once here
    return workspace / "grpo"


def test_grpo_mfu_is_logged(workspace, grpo_run):  # training passes over their own time; sampling apart
    records = list(read_jsonl(grpo_run / "metrics.jsonl"))
    check_mfu(records, workspace / "model", "train_tokens_per_s", lora_r=4)
    rollouts = [r for r in records if "generation_tokens_per_s" in r]
    assert rollouts
    for r in rollouts:
        assert r["generation_tflops_per_s"] > 0
        assert r["generation_mfu"] == pytest.approx(r["generation_tflops_per_s"] / PEAK, rel=1e-9)


def test_grpo_summary_plot_shows_reward_kl_length_and_clipping(grpo_run):
    summary = summary_of(grpo_run, "grpo")
    assert list(summary) == ["reward_mean", "kl", "completion_length", "clip_fraction_low, clip_fraction_high",
                             "truncated_fraction"]
    steps = {name: {label: [s for s, _ in points] for label, points in panel.items()}
             for name, panel in summary.items()}
    assert steps["reward_mean"] == {"train": [1, 3], "eval": [0, 4]}  # rollouts of 2 steps; greedy eval joins it
    assert steps["clip_fraction_low, clip_fraction_high"] == {"clip_fraction_low": [1, 2, 3, 4],
                                                              "clip_fraction_high": [1, 2, 3, 4]}


def _losses(run):
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r and "train_runtime" not in r]


def test_grpo_run_dir_metrics_and_samples(workspace, grpo_run):
    run = grpo_run
    lineage = json.loads((run / "lineage.json").read_text())
    assert lineage["stage"] == "grpo" and [e["stage"] for e in lineage["previous_adapters"]] == ["sft"]
    policy = load_file(run / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in policy.items())  # trained
    logs = list(read_jsonl(run / "metrics.jsonl"))
    train_logs = [r for r in logs if "policy_loss" in r]
    assert [r["step"] for r in train_logs] == [1, 2, 3, 4]
    rollouts = train_logs[::2]  # rollout batch 8 = 2 optimizer steps of 4 completions: rollouts at steps 1 and 3
    assert all("reward_mean" not in r for r in train_logs[1::2])
    for r in rollouts:
        for key in ("reward_mean", "reward_std", "rewards/length_reward_mean", "rewards/format_reward_mean",
                    "all_equal_group_fraction", "completion_length", "truncated_fraction", "generation_tokens_per_s",
                    "rollout_kl"):
            assert key in r and math.isfinite(r[key]), key
        assert 0 <= r["all_equal_group_fraction"] <= 1 and 0 < r["generation_share"] <= 1
    for r in train_logs:
        for key in ("policy_loss", "clip_fraction_low", "clip_fraction_high", "entropy", "kl", "train_tokens_per_s"):
            assert key in r and math.isfinite(r[key]), key
    # the first step runs on the policy that sampled = the reference (LoRA B = 0): KL 0, ratio 1, nothing clipped
    assert train_logs[0]["kl"] == pytest.approx(0.0, abs=1e-7) and train_logs[0]["rollout_kl"] == 0.0
    assert train_logs[0]["clip_fraction_low"] == 0 and train_logs[0]["clip_fraction_high"] == 0
    evals = [r for r in logs if "eval_reward" in r]
    assert len(evals) == 2 and evals[0]["eval_kl"] == 0.0 and evals[-1]["eval_prompts"] == 4
    assert "eval_rewards/length_reward" in evals[-1]
    samples = list(read_jsonl(run / "samples.jsonl"))
    assert {s["iteration"] for s in samples} == {0, 1}
    assert set(samples[0]["rewards"]) == {"length_reward", "format_reward"}
    r = samples[0]["rewards"]
    assert samples[0]["reward"] == pytest.approx(r["length_reward"] + 0.5 * r["format_reward"])


def _resume_and_compare(workspace, run, recipe_fn):
    """Copy ``run`` (4 steps = 2 iterations, checkpoints every 2 steps), cut it back to checkpoint-2 and resume:
    losses, samples and the final adapter equal the uninterrupted run's."""
    copy = workspace / f"{run.name}_resumed"
    cut_back_to_first_iteration(run, copy)
    assert main(["grpo", str(recipe_fn(copy.name)), "train.resume_from=latest"]) == 0
    assert len(_losses(run)) == 4 and _losses(copy) == pytest.approx(_losses(run), abs=1e-6)
    # the rollouts sampled again after the checkpoint replace the interrupted run's, once each
    samples, original = (read_jsonl(r / "samples.jsonl") for r in (copy, run))
    assert [(s["step"], s["completion"]) for s in samples] == [(s["step"], s["completion"]) for s in original]
    one, two = (load_file(r / "adapter" / "adapter_model.safetensors") for r in (copy, run))
    assert one.keys() == two.keys() and all(torch.allclose(one[k], two[k], atol=1e-6) for k in one)


def test_resume_reproduces_the_uninterrupted_run(workspace, grpo_run):
    _resume_and_compare(workspace, grpo_run, lambda name: grpo_recipe(workspace, name))


ESTIMATORS_X_LEVELS = [(e, lv) for e in ("grpo", "rloo", "reinforce_plus_plus") for lv in ("token", "sequence")]


@pytest.mark.parametrize("estimator, level", ESTIMATORS_X_LEVELS)
def test_each_estimator_and_ratio_level_trains_two_iterations_and_resumes_exactly(workspace, estimator, level):
    """advantage_estimator x importance_sampling_level, with a reward function that abstains on some completions
    and DAPO's overlong penalty: 2 iterations of 2 optimizer steps (old log-probs from the sampling policy, so the
    ratios and the importance-weighted KL are live), then a resume from the first iteration's checkpoint."""
    def recipe(name):
        # 2 prompts x G 2 per iteration, 2 passes (num_iterations) of 1 optimizer step each: the second step trains on
        # completions of the policy before the first (old log-probs live); the base model directly (no SFT chain)
        path = grpo_recipe(workspace, name, grpo={"advantage_estimator": estimator, "importance_sampling_level": level,
                                                  "overlong_buffer_tokens": 4, "rollout_batch_size": 4,
                                                  "num_iterations": 2},
                           train={"save_total_limit": 2}, model={"name_or_path": str(workspace / "model")})
        doc = yaml.safe_load(path.read_text())
        doc["reward"] = {"function": str(workspace / "my_rewards.py") + ":sometimes"}
        doc["data"]["val_size"] = 0
        path.write_text(yaml.safe_dump(doc))
        return path

    name = f"grpo_{estimator}_{level}"
    assert main(["grpo", str(recipe(name))]) == 0
    run = workspace / name
    logs = [r for r in read_jsonl(run / "metrics.jsonl") if "policy_loss" in r]
    assert [r["step"] for r in logs] == [1, 2, 3, 4] and all(math.isfinite(r["loss"]) for r in logs)
    rollouts = [r for r in logs if "reward_mean" in r]
    assert len(rollouts) == 2
    for r in rollouts:
        assert 0 < r["rewards/abstained"] < 1  # completions of even length: every function abstained
        assert r["trained_completion_fraction"] == pytest.approx(1 - r["rewards/abstained"])  # ... and not trained
        assert -1.0 <= r["rewards/overlong_penalty_mean"] <= 0.0
    for s in read_jsonl(run / "samples.jsonl"):
        if len(s["completion"]) % 2 == 0:
            assert s["reward"] is None and s["rewards"] == {"sometimes": None} and not s["trained"]
            assert s["advantage"] == 0.0
        else:
            assert s["trained"] and s["reward"] <= s["rewards"]["sometimes"]  # + overlong penalty <= 0
    _resume_and_compare(workspace, run, recipe)


def test_accumulation_4x1_equals_1x4(workspace):
    """Two optimizer steps per rollout batch (old log-probs from the sampling policy) and groups spanning
    micro-batches: micro 1 x 4 accumulation and micro 4 x 1 give the same steps."""
    runs = {}
    for micro in (1, 4):
        name = f"grpo_micro{micro}"
        recipe = grpo_recipe(workspace, name, grpo={"rollout_batch_size": 8, "loss_aggregation": "sequence_mean"},
                             train={"micro_batch_size": micro, "max_steps": 2, "save_steps": None,
                                    "learning_rate": 1e-2})
        assert main(["grpo", str(recipe), "data.val_size=0"]) == 0
        runs[micro] = workspace / name
    assert _losses(runs[1]) == pytest.approx(_losses(runs[4]), abs=1e-5)
    norms = [[r["grad_norm"] for r in read_jsonl(runs[m] / "metrics.jsonl") if "grad_norm" in r] for m in (1, 4)]
    assert len(norms[0]) == 2 and norms[0] == pytest.approx(norms[1], rel=1e-5)  # the same gradients
    one, four = (load_file(runs[m] / "adapter" / "adapter_model.safetensors") for m in (1, 4))
    assert all(torch.allclose(one[k], four[k], atol=1e-5) for k in one)
    assert any(v.abs().sum() > 0 for k, v in one.items() if "lora_B" in k)


def test_export_of_a_grpo_run_loads_in_plain_transformers(workspace, grpo_run):
    from transformers import AutoModelForCausalLM

    assert main(["export", str(grpo_run)]) == 0
    model = AutoModelForCausalLM.from_pretrained(grpo_run / "merged")
    assert model.config.num_hidden_layers == 2
    ids = torch.tensor([[1, 5, 9]])
    assert torch.isfinite(model(ids).logits).all()


@pytest.mark.parametrize("mode", ["drop", "resample"])
def test_dynamic_sampling_counts_drops_and_resamples_all_equal_groups(workspace, mode):
    name = f"grpo_{mode}"
    recipe = grpo_recipe(workspace, name, grpo={"dynamic_sampling": mode, "max_resample_rounds": 3, "beta": 0.0},
                         train={"max_steps": 2, "save_steps": None})
    doc = yaml.safe_load(recipe.read_text())
    doc["reward"] = {"function": str(workspace / "my_rewards.py") + ":only_ones"}
    recipe.write_text(yaml.safe_dump(doc))
    assert main(["grpo", str(recipe), "data.val_size=0"]) == 0
    first = next(r for r in read_jsonl(workspace / name / "metrics.jsonl") if "reward_mean" in r)
    assert 0 < first["all_equal_group_fraction"] < 1  # counted before anything is dropped or resampled
    after = first.get("all_equal_group_fraction_after_resampling", first["all_equal_group_fraction"])
    assert first["trained_completion_fraction"] == pytest.approx(1 - after)  # what is still all-equal is dropped
    if mode == "resample":
        assert first["resample_rounds"] >= 1 and after < first["all_equal_group_fraction"]


def test_replace_groups_repads_prompts_left_and_completions_right():
    from llmtune.rewards.shaping import Shaping, shape
    from llmtune.rl.types import LENGTH, STOP, RolloutBatch, Trajectory
    from llmtune.stages.grpo.trainer import replace_groups

    def traj(row, prompt, completion, ended, group):
        return Trajectory(row, prompt, completion, [1] * len(completion), None, 0, STOP if ended else LENGTH,
                          group=group)

    def scored(batch, values):
        total = torch.tensor(values)
        shaping = Shaping(2, overlong_buffer_tokens=1, overlong_penalty_factor=0.5)
        return shape(batch, total, {"r": total.clone()}, shaping, completions=[str(v) for v in values])

    # groups laid out interleaved (ids 7, 3, 7, 3): replacing group 7 must touch rows 0 and 2, not rows 0 and 1
    batch = RolloutBatch.from_trajectories([traj("a", [5], [8], True, 7), traj("b", [6, 7], [8], True, 3),
                                            traj("a", [5], [9], True, 7), traj("b", [6, 7], [9], True, 3)], 0)
    rewards = scored(batch, [1.0, 0.0, 1.0, 1.0])
    extra = RolloutBatch.from_trajectories([traj("c", [1, 2, 3], [4, 4], False, 0),
                                            traj("c", [1, 2, 3], [4], True, 0)], 0)
    extra_rewards = scored(extra, [2.0, math.nan])
    b, out = replace_groups(batch, rewards, extra, extra_rewards, [(7, 0)], pad_id=0)
    assert b.prompt_ids.tolist() == [[1, 2, 3], [0, 6, 7], [1, 2, 3], [0, 6, 7]]
    assert b.prompt_mask.tolist() == [[1, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]]
    assert b.completion_ids.tolist() == [[4, 4], [8, 0], [4, 0], [9, 0]]
    assert b.completion_mask.tolist() == [[1, 1], [1, 0], [1, 0], [1, 0]]
    assert out.total.tolist() == [1.5, 0.0, 0.0, 1.0] and b.rows == ["c", "b", "c", "b"]
    assert b.ended.tolist() == [False, True, True, True]
    assert out.per_source["r"][[0, 1, 3]].tolist() == [2.0, 0.0, 1.0] and math.isnan(out.per_source["r"][2])
    assert out.abstained.tolist() == [False, False, True, False] and out.terms["overlong"].tolist() == [-0.5, 0, 0, 0]
    assert out.completions == ["2.0", "0.0", "nan", "1.0"] and out.trains.tolist() == [True, True, False, True]
    assert b.group_ids.tolist() == [7, 3, 7, 3]  # the slots keep their ids


def test_grpo_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["grpo", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "grpo.num_generations" in out and "grpo.loss_aggregation" in out and "reward.functions" in out
    for key, source in [("grpo.advantage_estimator", "Ahmadian et al. 2024"),
                        ("grpo.importance_sampling_level", "Zheng et al. 2025"),
                        ("grpo.sequence_epsilon_low", "GSPO paper"), ("grpo.sequence_epsilon_high", "GSPO paper"),
                        ("grpo.overlong_buffer_tokens", "Yu et al. 2025"), ("grpo.overlong_penalty_factor", "DAPO"),
                        ("grpo.scale_rewards", "true/false")]:
        assert key in out and source in out.split(key, 1)[1].split("\n  grpo.", 1)[0], key


def test_an_eval_where_every_function_abstains_logs_no_nan(workspace):
    """Every reward function abstains on every eval prompt (here: at the evaluation before training): that eval has no
    eval_reward (not NaN: metrics.jsonl is strict JSON) and says so; the later eval scores as usual."""
    (workspace / "abstain_first.py").write_text("""calls = []
def reward(prompts, completions):
    calls.append(1)
    return [None if len(calls) == 1 else float(len(c) % 7) for c in completions]
""")
    recipe = grpo_recipe(workspace, "abstain_eval", train={"max_steps": 2})
    doc = yaml.safe_load(recipe.read_text())
    doc["reward"] = {"functions": [{"function": str(workspace / "abstain_first.py") + ":reward"}]}
    recipe.write_text(yaml.safe_dump(doc))
    assert main(["grpo", str(recipe)]) == 0
    run = workspace / "abstain_eval"

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in {run}"))

    evals = [strict(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval_prompts"' in line]
    assert [e["step"] for e in evals] == [0, 2]
    assert "eval_reward" not in evals[0] and evals[0]["eval_rewards/abstained"] == 1.0
    assert math.isfinite(evals[1]["eval_reward"]) and "eval_rewards/abstained" not in evals[1]
    samples = [strict(line) for line in (run / "eval_samples_step0.jsonl").read_text().splitlines()]
    assert samples and all(s["score"] is None for s in samples)
