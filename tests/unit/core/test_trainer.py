"""Core trainer wiring: weight decay groups, early stopping, precision checks."""

import pytest
import torch
from datasets import Dataset

from llmtune.config import RecipeError, load_recipe
from llmtune.core.guard import check_precision
from llmtune.core.trainer import CoreTrainer, build_training_args
from llmtune.data import SFTCollator
from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer
from llmtune.stages import SFTStage


def make_trainer(tmp_path, train: dict, n_rows: int = 8, eval_rows: int = 0):
    tokenizer = make_tiny_tokenizer()
    recipe = load_recipe(raw={"train": {"micro_batch_size": 2, "global_batch_size": 2, **train},
                              "adapter": {"type": "none"}, "output": {"dir": str(tmp_path)},
                              "data": {"val_size": eval_rows}}, stage="sft")
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": (ids := torch.randint(10, len(tokenizer), (12,), generator=g).tolist()),
             "labels": [-100] * 4 + ids[4:]} for _ in range(n_rows + eval_rows)]
    from llmtune.core.trainer import early_stopping

    return CoreTrainer(
        model=make_tiny_llama(tokenizer),
        args=build_training_args(recipe, tmp_path, has_eval=eval_rows > 0),
        train_dataset=Dataset.from_list(rows[:n_rows]),
        eval_dataset=Dataset.from_list(rows[n_rows:]) if eval_rows else None,
        data_collator=SFTCollator(tokenizer),
        callbacks=early_stopping(recipe),
        stage=SFTStage(recipe),
    )


def test_no_weight_decay_on_biases_and_norm_weights(tmp_path):
    trainer = make_trainer(tmp_path, {"weight_decay": 0.1, "max_steps": 1})
    trainer.create_optimizer()
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    decayed = {names[id(p)] for g in trainer.optimizer.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    plain = {names[id(p)] for g in trainer.optimizer.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert {n for n in names.values() if "norm" in n} <= plain
    assert "model.layers.0.self_attn.q_proj.weight" in decayed and "lm_head.weight" in decayed
    assert not any("norm" in n or n.endswith("bias") for n in decayed)


def test_early_stopping_stops_when_eval_loss_stops_improving(tmp_path):
    # lr 3.0 on a tiny model makes eval loss rise after the first steps; patience 1 stops the run early
    trainer = make_trainer(tmp_path, {"learning_rate": 3.0, "max_steps": 20, "eval_steps": 1, "max_grad_norm": 0,
                                      "early_stopping_patience": 1, "lr_scheduler": "constant"},
                           n_rows=40, eval_rows=4)
    trainer.train()
    evals = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    assert trainer.state.global_step < 20
    assert evals[-1] >= min(evals)  # stopped because the last eval did not improve on the best


def test_fp16_on_cpu_is_refused_with_an_explanation():
    recipe = load_recipe(raw={"precision": {"fp16": True}}, stage="sft")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: fp16 is allowed")
    with pytest.raises(RecipeError, match="precision.fp16.*needs a CUDA GPU"):
        check_precision(recipe)


def test_bf16_on_cpu_trains_as_check_precision_advises(tmp_path):
    """check_precision tells CPU users to use precision.bf16; transformers refused it ('Your setup doesn't support
    bf16/gpu', a traceback after the model was loaded) until build_training_args asked for the CPU explicitly."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    tokenizer = make_tiny_tokenizer()
    recipe = load_recipe(raw={"train": {"micro_batch_size": 2, "global_batch_size": 2, "max_steps": 1},
                              "precision": {"bf16": True}, "adapter": {"type": "none"},
                              "output": {"dir": str(tmp_path)}}, stage="sft")
    check_precision(recipe)
    args = build_training_args(recipe, tmp_path, has_eval=False)
    assert args.bf16 and args.use_cpu
    rows = [{"input_ids": list(range(10, 22)), "labels": [-100] * 4 + list(range(14, 22))}] * 4
    trainer = CoreTrainer(model=make_tiny_llama(tokenizer), args=args, train_dataset=Dataset.from_list(rows),
                          data_collator=SFTCollator(tokenizer), stage=SFTStage(recipe))
    trainer.train()
    assert trainer.state.global_step == 1 and torch.isfinite(torch.tensor(trainer.state.log_history[0]["loss"]))
