"""DPO stage: each loss against hand-computed values, the adapter-disabled reference, fp32 log-probs."""

import math

import numpy as np
import pytest
import torch

from llmtune.config import RecipeError, load_recipe
from llmtune.core.ops import token_logps
from llmtune.models import attach_adapter
from llmtune.models.tiny import make_tiny_llama
from llmtune.stages import DPOStage
from llmtune.stages.dpo import dpo_loss

# One pair with h = (chosen - rejected) - (ref_chosen - ref_rejected) = (-10 + 12) - (-11 + 11) = 2 and one with h = 0.
LOGPS = dict(chosen_logps=torch.tensor([-10.0, -5.0]), rejected_logps=torch.tensor([-12.0, -4.0]),
             ref_chosen_logps=torch.tensor([-11.0, -5.0]), ref_rejected_logps=torch.tensor([-11.0, -4.0]))


@pytest.mark.parametrize("loss_type, smoothing, expected", [
    # beta h = 0.2: -log sigmoid(0.2) = 0.5981389; h = 0: log 2
    ("sigmoid", 0.0, [0.59813887, 0.69314718]),
    # cDPO eps 0.1: 0.9 * 0.5981389 + 0.1 * (-log sigmoid(-0.2) = 0.7981389) = 0.6181389; h = 0 stays log 2
    ("sigmoid", 0.1, [0.61813887, 0.69314718]),
    # rDPO eps 0.1: (0.9 * 0.5981389 - 0.1 * 0.7981389) / 0.8 = 0.5731389; h = 0: (0.8 log 2) / 0.8 = log 2
    ("robust", 0.1, [0.57313887, 0.69314718]),
    # IPO: (h - 1 / (2 beta))^2 = (2 - 5)^2 = 9 and (0 - 5)^2 = 25
    ("ipo", 0.0, [9.0, 25.0]),
    # hinge: max(0, 1 - beta h) = 0.8 and 1
    ("hinge", 0.0, [0.8, 1.0]),
])
def test_losses_hand_values(loss_type, smoothing, expected):
    losses, chosen_rewards, rejected_rewards = dpo_loss(**LOGPS, beta=0.1, loss_type=loss_type,
                                                        label_smoothing=smoothing)
    torch.testing.assert_close(losses, torch.tensor(expected), atol=1e-6, rtol=0)
    # rewards = beta * (logps - ref_logps)
    torch.testing.assert_close(chosen_rewards, torch.tensor([0.1, 0.0]))
    torch.testing.assert_close(rejected_rewards, torch.tensor([-0.1, 0.0]))


def test_label_smoothing_config_rules():
    with pytest.raises(RecipeError, match="label_smoothing applies"):
        load_recipe(raw={"dpo": {"loss_type": "ipo", "label_smoothing": 0.1}}, stage="dpo")
    with pytest.raises(RecipeError, match="robust needs label_smoothing"):
        load_recipe(raw={"dpo": {"loss_type": "robust"}}, stage="dpo")
    with pytest.raises(RecipeError, match="precompute_ref_logps"):
        DPOStage(load_recipe(raw={"adapter": {"type": "none"}}, stage="dpo"))


def test_eval_metrics_hand_values(tmp_path):
    stage = DPOStage(load_recipe(raw={"output": {"dir": str(tmp_path)}}, stage="dpo"))
    m = stage.eval_metrics({k: v.double().numpy() for k, v in LOGPS.items()})
    assert m["loss"] == pytest.approx((0.59813887 + 0.69314718) / 2, abs=1e-6)
    assert m["rewards/chosen"] == pytest.approx(0.05) and m["rewards/rejected"] == pytest.approx(-0.05)
    assert m["rewards/accuracies"] == 0.5  # the h = 0 pair is a tie and does not count
    assert m["rewards/margins"] == pytest.approx(0.1)
    assert m["logps/chosen"] == pytest.approx(-7.5) and m["logps/rejected"] == pytest.approx(-8.0)
    assert m["pairs"] == 2


def policy(tokenizer, tmp_path, **dpo):
    recipe = load_recipe(raw={"adapter": {"lora_r": 4, "lora_dropout": 0.0}, "dpo": dpo,
                              "output": {"dir": str(tmp_path)}}, stage="dpo")
    model = attach_adapter(make_tiny_llama(tokenizer, seed=0), recipe.adapter, gradient_checkpointing=False,
                           quantized=False)
    return DPOStage(recipe), model


def test_step_zero_policy_equals_reference(tmp_path, tokenizer, pairs, collate):
    """A fresh LoRA has B = 0, so policy == reference: loss log 2, zero margins, no pair counted accurate."""
    stage, model = policy(tokenizer, tmp_path)
    batch = collate(pairs(4))
    loss, metrics = stage.loss(model, batch, torch.tensor(4))
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
    assert metrics["rewards/margins"] == 0.0 and metrics["rewards/chosen"] == 0.0
    assert metrics["rewards/accuracies"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values())
    loss.backward()
    assert any(p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)


def test_reference_is_the_base_with_the_adapter_disabled(tmp_path, tokenizer, pairs, collate):
    stage, model = policy(tokenizer, tmp_path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # a trained adapter: policy != reference
    base = make_tiny_llama(tokenizer, seed=0)  # an independent copy of the same base weights
    batch = collate(pairs(3))
    ref_c, ref_r = stage.reference_logps(model, batch)
    base_c, base_r = stage.logps(base, batch)
    torch.testing.assert_close(ref_c, base_c, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref_r, base_r, atol=1e-5, rtol=0)
    pol_c, _ = stage.logps(model, batch)
    assert (pol_c - ref_c).abs().max() > 1e-3
    assert not ref_c.requires_grad


def test_logps_sum_completion_tokens_only_in_fp32(tmp_path, tokenizer, pairs, collate):
    stage, model = policy(tokenizer, tmp_path)
    rows = pairs(2)
    batch = collate(rows)
    chosen, rejected = stage.logps(model, batch)
    # by hand: the first pair's chosen completion, unpadded, token by token
    row = rows[0]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([row["chosen_input_ids"]])).logits[0].double()
    logp = torch.log_softmax(logits, -1)
    n = row["prompt_length"]
    expected = sum(float(logp[t - 1, row["chosen_input_ids"][t]]) for t in range(n, len(row["chosen_input_ids"])))
    assert chosen[0].item() == pytest.approx(expected, abs=1e-4)
    model_bf16 = model.to(torch.bfloat16)
    chosen16, _ = stage.logps(model_bf16, batch)
    assert chosen16.dtype == torch.float32 and torch.isfinite(chosen16).all()
    logits16 = stage.logits(model_bf16, batch)
    assert logits16.dtype == torch.bfloat16 and token_logps(logits16, batch["labels"])[0].dtype == torch.float32


def test_precomputed_reference_matches_on_the_fly(tmp_path, tokenizer, pairs, collate):
    import contextlib
    from types import SimpleNamespace

    from datasets import Dataset

    from llmtune.core.stage import PairCollator, StageData

    stage, model = policy(tokenizer, tmp_path, precompute_ref_logps=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    rows = Dataset.from_list(pairs(5))
    trainer = SimpleNamespace(model=model, args=SimpleNamespace(per_device_eval_batch_size=2),
                              accelerator=SimpleNamespace(autocast=contextlib.nullcontext),
                              _prepare_inputs=lambda b: b)
    data = StageData(rows, None, None, PairCollator(collate))
    prepared = stage.prepare_data(trainer, data)
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(prepared.train.column_names)
    batch = prepared.collator([prepared.train[i] for i in range(5)])
    assert batch["ref_chosen_logps"].shape == (5,)
    on_the_fly = stage.reference_logps(model, {k: v for k, v in batch.items() if not k.startswith("ref_")})
    torch.testing.assert_close(batch["ref_chosen_logps"], on_the_fly[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(batch["ref_rejected_logps"], on_the_fly[1], atol=1e-5, rtol=0)
    loss_pre, _ = stage.loss(model, batch, torch.tensor(5))
    loss_fly, _ = stage.loss(model, {k: v for k, v in batch.items() if not k.startswith("ref_")}, torch.tensor(5))
    assert loss_pre.item() == pytest.approx(loss_fly.item(), abs=1e-5)
    assert np.isfinite(loss_pre.item())
