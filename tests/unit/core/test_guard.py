"""Non-finite guard of the core trainer: a step with a NaN/inf loss or gradient norm is not applied, is counted and
logged; N in a row stop the run (exit code 3); a CUDA out-of-memory error becomes exit code 4 with advice."""

import json

import pytest
import torch
import yaml
from datasets import Dataset
from transformers import TrainerCallback

from llmtune.config import load_recipe
from llmtune.core.guard import NonFiniteError, check_trainable_weights
from llmtune.core.trainer import CoreTrainer, build_training_args
from llmtune.data import SFTCollator
from llmtune.errors import EXIT_NONFINITE, EXIT_OOM
from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer, save_tiny_model
from llmtune.stages import SFTStage


class Snapshots(TrainerCallback):
    """Weights and AdamW first moments after every optimizer step, by global_step."""

    def __init__(self):
        self.weights, self.moments = {}, {}
        self.trainer = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = self.trainer.optimizer
        self.moments[state.global_step] = [opt.state[p]["exp_avg"].clone() for g in opt.param_groups
                                           for p in g["params"] if "exp_avg" in opt.state.get(p, {})]


def make_trainer(tmp_path, train: dict, n_rows: int = 16):
    tokenizer = make_tiny_tokenizer()
    recipe = load_recipe(raw={"train": {"micro_batch_size": 2, "global_batch_size": 2, "max_steps": 6,
                                        "learning_rate": 1e-2, "lr_scheduler": "linear", "group_by_length": False,
                                        **train},
                              "adapter": {"type": "none"}, "output": {"dir": str(tmp_path)}}, stage="sft")
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(10, len(tokenizer), (12,), generator=g).tolist()),
             "labels": [-100] * 4 + ids[4:]} for _ in range(n_rows)]
    snaps = Snapshots()
    trainer = CoreTrainer(model=make_tiny_llama(tokenizer), args=build_training_args(recipe, tmp_path, False),
                          train_dataset=Dataset.from_list(rows), data_collator=SFTCollator(tokenizer),
                          callbacks=[snaps], stage=SFTStage(recipe))
    snaps.trainer = trainer
    return trainer, snaps


def inject_nan(model, calls: set[int]):
    """Forward hook on the embeddings: NaN activations at the given (0-based) training forward calls."""
    count = {"n": 0}

    def hook(module, args, output):
        n = count["n"]
        count["n"] += 1
        return output * float("nan") if n in calls else output

    return model.model.embed_tokens.register_forward_hook(hook)


def test_a_nan_step_is_not_applied_and_later_steps_train(tmp_path):
    trainer, snaps = make_trainer(tmp_path, {})
    inject_nan(trainer.model, {2})  # the forward of optimizer step 3
    trainer.train()
    w, m = snaps.weights, snaps.moments
    for name in w[2]:
        assert torch.equal(w[3][name], w[2][name]), name  # step 3 changed no weight
        assert all(torch.isfinite(p).all() for p in w[6].values())
    assert all(torch.equal(a, b) for a, b in zip(m[3], m[2]))  # nor the AdamW moments
    assert any(not torch.equal(w[4][n], w[3][n]) for n in w[3])  # step 4 trains again
    logs = trainer.state.log_history
    skipped = [r for r in logs if "nonfinite_step" in r]
    assert len(skipped) == 1 and skipped[0]["nonfinite_step"] == 3 and skipped[0]["step"] == 3
    assert skipped[0]["nonfinite_loss"] == "nan" and len(skipped[0]["nonfinite_rows"]) == 2
    losses = {r["step"]: r for r in logs if "loss" in r}
    assert sorted(losses) == [1, 2, 4, 5, 6]  # no loss record for the skipped step, and no NaN in any
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in losses.values())
    assert losses[6]["nonfinite_steps"] == 1 and losses[2]["nonfinite_steps"] == 0
    # the linear schedule did not advance for the skipped step: step 4 uses the LR step 3 would have used
    lr0 = 1e-2
    assert losses[4]["learning_rate"] == pytest.approx(lr0 * (1 - 2 / 6))
    assert trainer.nonfinite_steps == 1


def test_accumulation_drops_every_micro_batch_of_a_nonfinite_step(tmp_path):
    trainer, snaps = make_trainer(tmp_path, {"micro_batch_size": 1, "global_batch_size": 2, "max_steps": 3})
    inject_nan(trainer.model, {3})  # second micro-batch of optimizer step 2; its first one was finite
    trainer.train()
    w = snaps.weights
    assert all(torch.equal(w[2][n], w[1][n]) for n in w[1])
    assert any(not torch.equal(w[3][n], w[2][n]) for n in w[2])
    skipped = [r for r in trainer.state.log_history if "nonfinite_step" in r]
    assert [r["nonfinite_step"] for r in skipped] == [2] and len(skipped[0]["nonfinite_rows"]) == 2


def test_three_nonfinite_steps_in_a_row_stop_the_run_naming_step_rows_and_causes(tmp_path):
    trainer, snaps = make_trainer(tmp_path, {})
    inject_nan(trainer.model, {1, 2, 3})
    with pytest.raises(NonFiniteError) as err:
        trainer.train()
    msg = str(err.value)
    assert err.value.exit_code == EXIT_NONFINITE == 3
    assert "optimizer step 4" in msg and "3 optimizer steps in a row" in msg and "learning rate" in msg
    assert "fp16" in msg and "bad row" in msg
    rows = [r for r in trainer.state.log_history if "nonfinite_step" in r][-1]["nonfinite_rows"]
    assert f"{rows[0]}, {rows[1]}" in msg
    w = snaps.weights
    assert max(w) == 4 and all(torch.equal(w[4][n], w[1][n]) for n in w[1])  # steps 2-4 changed nothing


def test_max_nonfinite_steps_is_a_recipe_option(tmp_path):
    trainer, _ = make_trainer(tmp_path, {"max_nonfinite_steps": 4})
    inject_nan(trainer.model, {1, 2, 3})
    trainer.train()  # 3 in a row are tolerated with a limit of 4
    assert trainer.nonfinite_steps == 3 and trainer.state.global_step == 6


def test_nonfinite_trainable_weights_are_refused(tmp_path):
    trainer, _ = make_trainer(tmp_path, {})
    with torch.no_grad():
        trainer.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("inf")
    with pytest.raises(NonFiniteError, match="model.layers.0.mlp.up_proj.weight"):
        check_trainable_weights(trainer)


# ---- through the CLI -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("guard")
    model_dir = save_tiny_model(root / "model")
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                          {"role": "assistant", "content": f"It is {i + 1}."}]} for i in range(16)]
    (root / "data.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    recipe = {"stage": "sft", "model": {"name_or_path": str(model_dir)},
              "data": {"datasets": [{"path": str(root / "data.jsonl")}], "max_length": 64},
              "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
              "train": {"micro_batch_size": 2, "global_batch_size": 2, "max_steps": 6, "learning_rate": 1e-3}}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root


def hooked_attach(monkeypatch, hook):
    import llmtune.core.runner as runner

    original = runner.attach_adapter

    def attach(model, *args, **kwargs):
        model = original(model, *args, **kwargs)
        model.get_input_embeddings().register_forward_hook(hook)
        return model

    monkeypatch.setattr(runner, "attach_adapter", attach)


def test_cli_nan_steps_exit_3_without_lineage(cli_workspace, monkeypatch, capsys):
    from llmtune.commands.cli import main

    count = {"n": 0}

    def hook(module, args, output):
        count["n"] += 1
        return output * float("nan") if count["n"] >= 3 else output

    hooked_attach(monkeypatch, hook)
    run = cli_workspace / "run_nan"
    code = main(["sft", str(cli_workspace / "recipe.yaml"), f"output.dir={run}"])
    err = capsys.readouterr().err
    assert code == EXIT_NONFINITE
    assert "Traceback" not in err and "error: stopped at optimizer step 5" in err and "Rows of the batch" in err
    assert not (run / "lineage.json").exists() and not (run / "adapter").exists()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_step"] for r in records if "nonfinite_step" in r] == [3, 4, 5]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]


def test_cli_out_of_memory_exits_4_with_figures_and_advice(cli_workspace, monkeypatch, capsys):
    from llmtune.commands.cli import main

    def hook(module, args, output):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    hooked_attach(monkeypatch, hook)
    run = cli_workspace / "run_oom"
    code = main(["sft", str(cli_workspace / "recipe.yaml"), f"output.dir={run}"])
    err = capsys.readouterr().err
    assert code == EXIT_OOM
    assert "Traceback" not in err and "out of GPU memory (CUDA out of memory. Tried to allocate 2.00 GiB)" in err
    for advice in ("train.micro_batch_size (now 2)", "train.gradient_checkpointing", "model.load_in_4bit",
                   "distributed.zero_stage", "data.max_length (now 64)"):
        assert advice in err
    assert "Memory:" in err
    assert not (run / "lineage.json").exists()


def test_fp16_loss_scale_overflows_are_left_to_the_scaler_not_counted(tmp_path):
    """With a GradScaler (fp16 on CUDA) overflowing gradients under a finite loss are routine: the scaler skips the
    update and halves its scale. The guard must not count them toward the stop. CPU cannot run fp16 mixed
    precision, so a real CPU GradScaler is put in the accelerator's place and the gradients are made inf by a hook."""
    trainer, snaps = make_trainer(tmp_path, {"max_steps": 4})

    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # the optimizer is built in train()
    first = next(p for p in trainer.model.parameters() if p.requires_grad)
    first.register_hook(lambda grad: grad * float("inf"))
    trainer.train()
    assert trainer.nonfinite_steps == 0 and trainer.fp16_overflow_steps == 4 and trainer.state.global_step == 4
    losses = [r for r in trainer.state.log_history if "loss" in r]
    assert losses[-1]["fp16_overflow_steps"] == 4 and "grad_norm" not in losses[-1]
    assert trainer.accelerator.scaler.get_scale() == 1024.0 / 2**4  # the scaler skipped and halved every time
    assert all(torch.equal(snaps.weights[4][n], snaps.weights[1][n]) for n in snaps.weights[1])


@pytest.mark.slow  # ~50 s on 2 shared cores: PPO rollouts
def test_cli_ppo_skips_a_nonfinite_optimizer_step(cli_workspace, monkeypatch):
    """PPO's optimizer steps run in the same trainer loop: NaN in one training forward (not in the rollouts, which
    run in eval mode) skips that step; the record lists the step's prompt rows; the run finishes."""
    from llmtune.commands.cli import main

    prompts = [{"prompt": f"What is {i} + 1?", "completion": f"{i + 1}"} for i in range(12)]
    (cli_workspace / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    recipe = {"stage": "ppo", "model": {"name_or_path": str(cli_workspace / "model")},
              "data": {"datasets": [{"path": str(cli_workspace / "prompts.jsonl")}], "max_length": 64},
              "adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0},
              "ppo": {"rollout_batch_size": 4, "ppo_epochs": 1}, "rollout": {"max_new_tokens": 4},
              "reward": {"function": "llmtune.rewards:gsm8k_reward"},
              "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 3, "learning_rate": 1e-3},
              "output": {"dir": str(cli_workspace / "ppo")}}
    (cli_workspace / "ppo.yaml").write_text(yaml.safe_dump(recipe))
    count = {"n": 0}

    def hook(module, args, output):
        if not module.training:  # rollouts and evaluation
            return output
        count["n"] += 1
        # 2 embedding calls per micro-batch (policy pass + value pass), 2 micro-batches per step: the 5th call is
        # the first micro-batch of optimizer step 2
        return output * float("nan") if count["n"] == 5 else output

    hooked_attach(monkeypatch, hook)
    assert main(["ppo", str(cli_workspace / "ppo.yaml")]) == 0
    records = [json.loads(line) for line in (cli_workspace / "ppo" / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if "nonfinite_step" in r]
    assert [r["nonfinite_step"] for r in skipped] == [2] and len(skipped[0]["nonfinite_rows"]) == 4
    assert all(0 <= r < 12 for r in skipped[0]["nonfinite_rows"])
    assert json.loads((cli_workspace / "ppo" / "lineage.json").read_text())["summary"]["nonfinite_steps"] == 1


def test_export_names_nonfinite_adapter_weights(cli_workspace, capsys):
    from safetensors.torch import load_file, save_file

    from llmtune.commands.cli import main

    run = cli_workspace / "run_export"
    assert main(["sft", str(cli_workspace / "recipe.yaml"), f"output.dir={run}", "train.max_steps=1"]) == 0
    weights = run / "adapter" / "adapter_model.safetensors"
    state = load_file(str(weights))
    name = sorted(k for k in state if "lora_B" in k)[0]
    state[name][0, 0] = float("nan")
    save_file(state, str(weights))
    capsys.readouterr()
    assert main(["export", str(run)]) == 1
    err = capsys.readouterr().err
    assert "NaN/inf values in 1 tensor(s)" in err and name.replace(".weight", "") in err and "Traceback" not in err
    assert not (run / "merged" / "model.safetensors").exists()
