"""`llmtune ppo` through the CLI on a tiny random Llama: an SFT run, an RM run, then PPO with the RM as reward and
PPO with a reward function; run dir, both adapters, metrics, samples, export of the chain, resume."""

import json
import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model
from llmtune.utils import read_jsonl
from tests.integration.flops_expect import PEAK, check_mfu

QA = [("What is 2 + 3?", "It is 5. #### 5", "It is 7."), ("Say hello.", "Hello! How are you today?", "No."),
      ("What is 12 * 7?", "12 * 7 = 84. #### 84", "12 * 7 = 74."), ("Name a color.", "The sea is blue.", "Dog.")]
COMMON = {"adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0}}


def write_recipe(root, name, stage, **sections):
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"stage": stage, **sections}))
    return path


def ppo_recipe(root, name, reward, **extra):
    train = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 4, "learning_rate": 1e-2,
             "save_steps": 2, "eval_batch_size": 4, "save_total_limit": 5, **extra.pop("train", {})}
    return write_recipe(
        root, name, "ppo", model={"from_run": str(root / "sft")},
        data={"datasets": [{"path": str(root / "prompts.jsonl")}], "max_length": 64, "val_size": 4},
        ppo={"rollout_batch_size": 4, "ppo_epochs": 2, "kl_coef": 0.05, "kl_target": 1.0,
             "missing_eos_penalty": -1.0, **extra.pop("ppo", {})},
        rollout={"max_new_tokens": 8, **extra.pop("rollout", {})},
        reward=reward, train=train, output={"dir": str(root / name)}, **COMMON, **extra)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("ppo")
    model_dir = save_tiny_model(root / "model")
    pairs = [{"prompt": f"{q} ({i})", "chosen": c, "rejected": r} for i in range(3) for q, c, r in QA]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": c}]}
             for _ in range(3) for q, c, _r in QA]
    (root / "sft.jsonl").write_text("\n".join(json.dumps(r) for r in chats) + "\n")
    prompts = [{"prompt": f"{q} ({i})", "completion": c} for i in range(4) for q, c, _ in QA]
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    train = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2}
    sft = write_recipe(root, "sft", "sft", model={"name_or_path": str(model_dir)},
                       data={"datasets": [{"path": str(root / "sft.jsonl")}], "max_length": 64},
                       train=train, output={"dir": str(root / "sft")}, **COMMON)
    rm = write_recipe(root, "rm", "rm", model={"name_or_path": str(model_dir)},
                      data={"datasets": [{"path": str(root / "pairs.jsonl"), "format": "preference"}],
                            "max_length": 64}, train=train, output={"dir": str(root / "rm")}, **COMMON)
    for command, recipe in (("sft", sft), ("rm", rm)):
        assert main([command, str(recipe)]) == 0, command
    return root


def test_ppo_with_reward_model(workspace, ppo_rm_run):
    run = ppo_rm_run
    lineage = json.loads((run / "lineage.json").read_text())
    assert lineage["stage"] == "ppo" and lineage["model_head"] == "causal_lm"
    assert [e["stage"] for e in lineage["previous_adapters"]] == ["sft"]
    policy = load_file(run / "adapter" / "adapter_model.safetensors")
    value = load_file(run / "adapter" / "value" / "adapter_model.safetensors")
    head = load_file(run / "adapter" / "value" / "value_head.safetensors")
    hidden = json.loads((workspace / "model" / "config.json").read_text())["hidden_size"]
    assert head["weight"].shape == (1, hidden) and head["weight"].abs().sum() > 0
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in policy.items())  # trained
    assert any(k.endswith("lora_B.weight") and v.abs().sum() > 0 for k, v in value.items())
    logs = list(read_jsonl(run / "metrics.jsonl"))
    train_logs = [r for r in logs if "policy_loss" in r]
    assert [r["step"] for r in train_logs] == [1, 2, 3, 4]
    rollout = [r for r in logs if "score_mean" in r]
    assert len(rollout) == 2  # two PPO iterations of 2 optimizer steps
    for r in rollout:
        assert all(math.isfinite(r[k]) for k in ("score_mean", "kl", "entropy", "response_length", "kl_coef"))
        assert 0 <= r["truncated_fraction"] <= 1
    assert rollout[0]["kl"] == 0.0  # first rollout: the policy IS the reference
    evals = [r for r in logs if "eval_score" in r]
    assert len(evals) == 2 and all(math.isfinite(r["eval_kl"]) for r in evals)
    assert evals[0]["eval_kl"] == 0.0 and evals[-1]["eval_prompts"] == 4
    samples = list(read_jsonl(run / "samples.jsonl"))
    assert {s["iteration"] for s in samples} == {0, 1}
    assert (run / "checkpoints" / "checkpoint-2" / "ppo_state.json").is_file()


def test_ppo_with_reward_function(workspace):
    math_prompts = [{"prompt": f"What is {a} + {b}?", "completion": f"{a} + {b} = {a + b}. #### {a + b}"}
                    for a in range(4) for b in range(4)]
    (workspace / "math.jsonl").write_text("\n".join(json.dumps(p) for p in math_prompts) + "\n")
    recipe = ppo_recipe(workspace, "ppo_fn", {"function": "llmtune.rewards:gsm8k_reward"},
                        ppo={"normalize_scores": True})
    doc = yaml.safe_load(recipe.read_text())
    doc["data"]["datasets"] = [{"path": str(workspace / "math.jsonl")}]
    recipe.write_text(yaml.safe_dump(doc))
    assert main(["ppo", str(recipe)]) == 0
    logs = list(read_jsonl(workspace / "ppo_fn" / "metrics.jsonl"))
    assert all(math.isfinite(r["loss"]) for r in logs if "loss" in r)
    assert all(0.0 <= r["score_mean"] <= 1.0 for r in logs if "score_mean" in r)


def _adapter(run):
    return {**load_file(run / "adapter" / "adapter_model.safetensors"),
            **{f"value/{k}": v for k, v in load_file(run / "adapter" / "value" / "adapter_model.safetensors").items()},
            **{f"head/{k}": v for k, v in load_file(run / "adapter" / "value" / "value_head.safetensors").items()}}


def _losses(run):
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl") if "loss" in r and "train_runtime" not in r]


@pytest.fixture(scope="module")
def ppo_rm_run(workspace):
    if not (workspace / "ppo_rm" / "lineage.json").is_file():
        with pytest.MonkeyPatch.context() as mp:  # a peak, so that metrics.jsonl has an MFU (test_ppo_mfu_is_logged)
            mp.setenv("LLMTUNE_PEAK_TFLOPS", str(PEAK))
            assert main(["ppo", str(ppo_recipe(workspace, "ppo_rm", {"from_run": str(workspace / "rm")}))]) == 0
    return workspace / "ppo_rm"


def test_ppo_mfu_is_logged(workspace, ppo_rm_run):  # policy and value passes over the training time; sampling apart
    records = list(read_jsonl(ppo_rm_run / "metrics.jsonl"))
    check_mfu(records, workspace / "model", "train_tokens_per_s", lora_r=4, adapters=2, value=True)
    rollouts = [r for r in records if "generation_tokens_per_s" in r]
    assert rollouts
    for r in rollouts:
        assert r["generation_tflops_per_s"] > 0
        assert r["generation_mfu"] == pytest.approx(r["generation_tflops_per_s"] / PEAK, rel=1e-9)


def test_resume_from_an_iteration_checkpoint_reproduces_the_run(workspace, ppo_rm_run):
    import shutil

    copy = workspace / "ppo_resumed"
    shutil.copytree(ppo_rm_run, copy)
    for name in ("adapter", "checkpoints/checkpoint-4"):
        shutil.rmtree(copy / name)
    (copy / "lineage.json").unlink()
    kept = [r for r in read_jsonl(copy / "metrics.jsonl") if r.get("step", 0) <= 2 and "train_runtime" not in r]
    (copy / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    recipe = ppo_recipe(workspace, "ppo_resumed", {"from_run": str(workspace / "rm")})
    assert main(["ppo", str(recipe), "train.resume_from=latest"]) == 0
    assert _losses(copy) == pytest.approx(_losses(ppo_rm_run), abs=1e-6)
    resumed, original = _adapter(copy), _adapter(ppo_rm_run)
    assert resumed.keys() == original.keys()
    for key in original:
        assert torch.allclose(resumed[key], original[key], atol=1e-6), key


def test_accumulation_split_gives_the_same_steps(workspace, ppo_rm_run):
    recipe = ppo_recipe(workspace, "ppo_micro4", {"from_run": str(workspace / "rm")}, train={"micro_batch_size": 4})
    assert main(["ppo", str(recipe)]) == 0
    assert _losses(workspace / "ppo_micro4") == pytest.approx(_losses(ppo_rm_run), abs=1e-5)
    one, two = _adapter(workspace / "ppo_micro4"), _adapter(ppo_rm_run)
    for key in one:
        assert torch.allclose(one[key], two[key], atol=1e-5), key


def test_resume_with_more_steps_follows_the_longer_schedule_from_the_first_resumed_step(workspace, ppo_rm_run):
    import shutil

    copy = workspace / "ppo_extended"
    shutil.copytree(ppo_rm_run, copy)
    for name in ("adapter", "checkpoints/checkpoint-4"):
        shutil.rmtree(copy / name)
    (copy / "lineage.json").unlink()
    (copy / "metrics.jsonl").unlink()
    recipe = ppo_recipe(workspace, "ppo_extended", {"from_run": str(workspace / "rm")})
    assert main(["ppo", str(recipe), "train.resume_from=latest", "train.max_steps=6"]) == 0
    logged = {r["step"]: r["learning_rate"] for r in read_jsonl(copy / "metrics.jsonl") if "learning_rate" in r}
    # cosine over 6 steps, no warm-up: step k runs at 1e-2 * (1 + cos(pi * (k - 1) / 6)) / 2 (the CoreTrainer test
    # checks that the logged learning_rate is the one the optimizer applied); old code: step 3 ran at the 4-step
    # schedule's 5.0e-3 instead of 7.5e-3
    expected = {k: 1e-2 * (1 + math.cos(math.pi * (k - 1) / 6)) / 2 for k in range(3, 7)}
    assert logged == pytest.approx(expected, rel=1e-6)


class ReportingEngine:
    """A rollout engine that reports log-probs (as vLLM does): the hf engine for the tokens, and as its log-probs the
    trainer's own plus ``shift`` nats (a known, constant engine/trainer mismatch). Records its syncs and closes."""

    def __init__(self, recipe, policy, pad_id, shift: float, calls: list):
        from llmtune.rl.engines.hf import HFEngine

        self.hf = HFEngine(policy, pad_id)
        self.policy, self.pad_id, self.temperature = policy, pad_id, recipe.rollout.temperature
        self.shift, self.calls = shift, calls

    def generate(self, prompts, sampling, budgets=None, keys=None, version=None):  # the engine interface
        from llmtune.rl.forward import rollout_forward
        from llmtune.rl.model import PolicyModel
        from llmtune.rl.types import RolloutBatch, Trajectory

        completions = self.hf.generate(prompts, sampling, budgets, keys, version)
        if sampling.greedy:
            return completions
        batch = RolloutBatch.from_trajectories([Trajectory.single_turn({}, p, c) for p, c in zip(prompts, completions)],
                                               self.pad_id, self.policy.device)
        logps = rollout_forward(PolicyModel(self.policy.model), batch.model_inputs(), batch.completion_ids,
                                temperature=self.temperature, chunk_rows=8).logps
        for c, row in zip(completions, logps.tolist()):
            c.logprobs = [v + self.shift for v in row[:len(c.token_ids)]]
        return completions

    def sync(self, version):
        self.calls.append(("sync", version))

    def close(self):
        self.calls.append(("close", None))


def test_engine_log_probs_weight_the_policy_loss(workspace, ppo_rm_run, monkeypatch):
    """An engine whose log-probs are the trainer's + ln 2 (ratio 1/2 on every token, below the cap): the rollout
    metrics show the mismatch, every truncated IS weight is 1/2, so the optimizer steps' policy loss is half
    the hf run's (same samples: the engine samples with transformers' generate and the same seeds) while the value
    loss is unchanged; the engine is synced to the step before every rollout batch and eval, and closed once."""
    import llmtune.rl.trainer as rl_trainer

    calls = []
    monkeypatch.setattr(rl_trainer, "build_engine", lambda recipe, policy, site, pad_id: ReportingEngine(
        recipe, policy, pad_id, math.log(2.0), calls))
    recipe = ppo_recipe(workspace, "ppo_engine", {"from_run": str(workspace / "rm")})
    assert main(["ppo", str(recipe)]) == 0
    assert calls == [("sync", 0), ("sync", 0), ("sync", 2), ("sync", 4), ("close", None)]  # eval, 2 rollouts, eval
    logs = [r for r in read_jsonl(workspace / "ppo_engine" / "metrics.jsonl") if "policy_loss" in r]
    base = [r for r in read_jsonl(ppo_rm_run / "metrics.jsonl") if "policy_loss" in r]
    rollouts = [r for r in logs if "rollout/logprob_diff_mean" in r]
    assert len(rollouts) == 2
    for r in rollouts:
        assert r["rollout/logprob_diff_mean"] == pytest.approx(math.log(2.0), abs=1e-5)
        assert r["rollout/logprob_diff_max"] == pytest.approx(math.log(2.0), abs=1e-5)
        assert r["rollout/is_weight_mean"] == pytest.approx(0.5, abs=1e-5)
        assert r["rollout/is_clipped_fraction"] == 0.0
    # step 1 (same weights; its whitened advantages average ~0) and step 2 of the first rollout batch: Adam's update
    # does not depend on the scale of the gradient, so the weights after step 1 agree too (hf: -0.0305 at step 2)
    for step in (0, 1):
        assert logs[step]["policy_loss"] == pytest.approx(0.5 * base[step]["policy_loss"], rel=1e-3, abs=1e-9)
        assert logs[step]["value_loss"] == pytest.approx(base[step]["value_loss"], rel=1e-4)
    assert abs(base[1]["policy_loss"]) > 1e-3
    assert "rollout/logprob_diff_mean" not in next(r for r in base if "score_mean" in r)  # hf reports nothing
