"""Gradient accumulation is exact for the pairwise stages: 4x1 and 1x4 pairs give the same gradients and loss.

The step loss is the sum of per-pair losses over all micro-batches divided by the pairs of the whole step
(``count_items`` = pairs), so the split does not matter; pairs of different lengths make padding differ too.
"""

import pytest
import torch
from datasets import Dataset
from transformers import LlamaForSequenceClassification, TrainerCallback

from llmtune.config import load_recipe
from llmtune.core.stage import PairCollator, with_pair_length
from llmtune.core.trainer import CoreTrainer, build_training_args
from llmtune.models import attach_adapter
from llmtune.models.tiny import make_tiny_llama
from llmtune.stages import DPOStage, RMStage


class GradCapture(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def build_model(stage_name, tokenizer, adapter):
    model = make_tiny_llama(tokenizer, seed=0)
    if stage_name == "rm":
        config = model.config
        config.num_labels = 1
        torch.manual_seed(0)
        head = LlamaForSequenceClassification(config)
        head.model.load_state_dict(model.model.state_dict())
        model = head
    model = attach_adapter(model, adapter, gradient_checkpointing=False, quantized=False)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)  # policy != reference, so per-pair DPO losses differ
    return model


def one_step(tmp_path, stage_name, micro, tokenizer, rows, collate):
    stage_cls = {"rm": RMStage, "dpo": DPOStage}[stage_name]
    recipe = load_recipe(raw={
        "train": {"micro_batch_size": micro, "global_batch_size": 4, "max_steps": 1, "max_grad_norm": 0,
                  "learning_rate": 1e-3, "eval_at_start": False},
        "adapter": {"lora_r": 4, "lora_dropout": 0.0},
        "output": {"dir": str(tmp_path / f"{stage_name}{micro}")},
    }, stage=stage_name)
    stage = stage_cls(recipe)
    capture = GradCapture()
    trainer = CoreTrainer(
        model=build_model(stage_name, tokenizer, recipe.adapter),
        args=build_training_args(recipe, tmp_path / f"{stage_name}{micro}", has_eval=False),
        train_dataset=with_pair_length(Dataset.from_list(rows)),
        data_collator=PairCollator(collate),
        callbacks=[capture],
        stage=stage,
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h][0]
    return capture.grads, logged, trainer.trained_tokens


@pytest.mark.parametrize("stage_name", ["dpo", "rm"])
def test_same_gradients_for_4x1_and_1x4(tmp_path, tokenizer, pairs, collate, stage_name):
    rows = pairs(4)
    ref_grads, ref_log, ref_items = one_step(tmp_path, stage_name, 4, tokenizer, rows, collate)
    grads, log, items = one_step(tmp_path, stage_name, 1, tokenizer, rows, collate)
    assert ref_items == items == 4  # pairs, not sequences or tokens
    assert log["loss"] == pytest.approx(ref_log["loss"], rel=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name, g in grads.items():
        # float noise only: padding differs between the splits (a wrong normalisation is off by a factor ~4)
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())
    if stage_name == "dpo":
        assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected"} <= set(log)
