"""Gradient accumulation is exact: 8x1, 2x4 and 1x8 give the same gradients and the same logged loss.

The step loss is the summed token loss over all micro-batches divided by the trained tokens of the
whole step (transformers #34191); averaging per micro-batch would weight the 3-token row like the 60-token one.
"""

import json

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from llmtune.config import load_recipe
from llmtune.core.trainer import CoreTrainer, build_training_args
from llmtune.data import SFTCollator
from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer
from llmtune.stages import SFTStage

LENGTHS = [3, 5, 40, 7, 60, 4, 9, 33]


def rows(vocab: int) -> Dataset:
    g = torch.Generator().manual_seed(0)
    out = []
    for n in LENGTHS:
        ids = torch.randint(10, vocab, (n,), generator=g).tolist()
        prompt = n // 2  # masked prompt: the first half is not trained
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return Dataset.from_list(out)


class GradCapture(TrainerCallback):
    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def one_step(tmp_path, micro: int, tokenizer):
    recipe = load_recipe(raw={
        "train": {"micro_batch_size": micro, "global_batch_size": 8, "max_steps": 1, "max_grad_norm": 0,
                  "learning_rate": 1e-3, "eval_at_start": False},
        "output": {"dir": str(tmp_path / f"m{micro}")},
        "adapter": {"type": "none"},
    }, stage="sft")
    model = make_tiny_llama(tokenizer, seed=0)
    capture = GradCapture()
    trainer = CoreTrainer(
        model=model,
        args=build_training_args(recipe, tmp_path / f"m{micro}", has_eval=False),
        train_dataset=rows(len(tokenizer)),
        data_collator=SFTCollator(tokenizer),
        callbacks=[capture],
        stage=SFTStage(recipe),
    )
    trainer.train()
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return capture.grads, logged[0], trainer.trained_tokens


def test_same_gradients_and_loss_for_any_micro_batch_split(tmp_path):
    tokenizer = make_tiny_tokenizer()
    ref_grads, ref_loss, ref_tokens = one_step(tmp_path, 8, tokenizer)
    expected_tokens = sum(n - n // 2 for n in LENGTHS)  # trained targets after the causal shift
    assert ref_tokens == expected_tokens
    for micro in (1, 2):
        grads, loss, tokens = one_step(tmp_path, micro, tokenizer)
        assert tokens == expected_tokens
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert grads.keys() == ref_grads.keys() and len(grads) > 0
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=1e-5, atol=1e-7, msg=f"{name} (micro {micro})")



def test_logged_loss_is_the_token_mean_not_the_mean_of_row_means(tmp_path):
    import torch.nn.functional as F

    tokenizer = make_tiny_tokenizer()
    _, logged, _ = one_step(tmp_path, 1, tokenizer)
    model = make_tiny_llama(tokenizer, seed=0)
    sums, counts = [], []
    with torch.no_grad():
        for row in rows(len(tokenizer)):
            ids, labels = torch.tensor([row["input_ids"]]), torch.tensor(row["labels"][1:])
            logits = model(input_ids=ids).logits[0, :-1]
            sums.append(F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
            counts.append((labels != -100).sum())
    token_mean = float(sum(sums) / sum(counts))
    row_mean = float(sum(s / c for s, c in zip(sums, counts)) / len(sums))
    assert logged == pytest.approx(token_mean, rel=1e-5)
    assert abs(token_mean - row_mean) > 1e-3  # the two definitions differ on these rows
