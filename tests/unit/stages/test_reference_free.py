"""ORPO and SimPO: losses against hand-computed values and their limiting cases, no reference forward (counted),
exact accumulation (4x1 == 1x4)."""

import math

import pytest
import torch
from datasets import Dataset

from llmtune.config import load_recipe
from llmtune.core.ops import per_sequence_loss_sum
from llmtune.core.stage import PairCollator, with_pair_length
from llmtune.core.trainer import CoreTrainer, build_training_args
from llmtune.models import attach_adapter
from llmtune.models.tiny import make_tiny_llama
from llmtune.stages import DPOStage, ORPOStage, SimPOStage
from llmtune.stages.dpo import dpo_loss
from llmtune.stages.orpo import log1mexp, orpo_loss
from llmtune.stages.simpo import simpo_loss
from test_pairwise_accumulation import GradCapture, build_model

# Pair 0: chosen -2 over 2 tokens (mean a = -1), rejected -6 over 3 tokens (mean b = -2). Pair 1: both equal.
C, R = torch.tensor([-2.0, -3.0]), torch.tensor([-6.0, -3.0])
NC, NR = torch.tensor([2.0, 3.0]), torch.tensor([3.0, 3.0])


def test_orpo_hand_value():
    losses, rc, rr, extra = orpo_loss(C, R, NC, NR, beta=0.1)
    # log odds(-1) = -1 - log(1 - e^-1) = -0.5413249; log odds(-2) = -2 - log(1 - e^-2) = -1.8545865;
    # difference 1.3132617, log sigmoid = -0.2381830; loss = 1 + 0.1 * 0.2381830 = 1.0238183.
    # Pair 1: equal means -> log-odds difference 0, log sigmoid(0) = -log 2: loss = 1 + 0.1 log 2.
    torch.testing.assert_close(losses, torch.tensor([1.0238183, 1 + 0.1 * math.log(2)]), atol=1e-6, rtol=0)
    torch.testing.assert_close(extra["log_odds_chosen"], torch.tensor([1.3132617, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(extra["nll_loss"], torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(rc, torch.tensor([-0.1, -0.1]))
    torch.testing.assert_close(rr, torch.tensor([-0.2, -0.1]))


def test_orpo_beta_zero_is_sft_nll_on_chosen(tokenizer, pairs, collate, tmp_path):
    """beta = 0: the loss is the per-sequence token-mean NLL of the chosen completions, averaged over pairs."""
    recipe = load_recipe(raw={"orpo": {"beta": 0.0}, "adapter": {"lora_dropout": 0.0},
                              "output": {"dir": str(tmp_path)}}, stage="orpo")
    model = make_tiny_llama(tokenizer, seed=0)
    batch = collate(pairs(4))
    loss, metrics = ORPOStage(recipe).loss(model, batch, torch.tensor(4))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    sums, counts = per_sequence_loss_sum(logits[:4], batch["labels"][:4])
    assert loss.item() == pytest.approx(float((sums / counts).mean()), rel=1e-5)
    assert metrics["nll_loss"] == pytest.approx(loss.item(), rel=1e-5)


def test_log1mexp_is_accurate_and_finite_at_the_ends():
    x = torch.tensor([-1e-9, -0.1, -0.7, -5.0, -50.0], dtype=torch.float64, requires_grad=True)
    y = log1mexp(x)
    expected = torch.log(1 - torch.exp(x.detach().clamp(max=-1e-7)))
    expected[-1] = -math.exp(-50.0)  # 1 - exp(-50) rounds to 1 in float64; log1p(-exp(x)) does not lose it
    torch.testing.assert_close(y.detach(), expected, rtol=1e-9, atol=0)
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_simpo_hand_value_and_limits():
    # r_c = 2 * -1 = -2, r_r = 2 * -2 = -4: -log sigmoid(2 - 0.5) = log(1 + e^-1.5) = 0.2014133; pair 1: -log sigmoid(-0.5)
    losses, rc, rr, _ = simpo_loss(C, R, NC, NR, beta=2.0, gamma=0.5)
    torch.testing.assert_close(losses, torch.tensor([0.2014133, math.log1p(math.exp(0.5))]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rc, torch.tensor([-2.0, -2.0]))
    torch.testing.assert_close(rr, torch.tensor([-4.0, -2.0]))
    # gamma = 0 without length normalisation == DPO (sigmoid) with reference log-probs 0
    plain, *_ = simpo_loss(C, R, NC, NR, beta=0.3, gamma=0.0, length_normalize=False)
    dpo, *_ = dpo_loss(C, R, torch.zeros(2), torch.zeros(2), beta=0.3)
    torch.testing.assert_close(plain, dpo)
    # equal lengths n: length normalisation == DPO with beta / n
    n = torch.full((2,), 4.0)
    normed, *_ = simpo_loss(C, R, n, n, beta=2.0, gamma=0.0)
    torch.testing.assert_close(normed, dpo_loss(C, R, torch.zeros(2), torch.zeros(2), beta=0.5)[0])


def test_eval_metrics_are_dpo_names(tmp_path):
    stage = SimPOStage(load_recipe(raw={"output": {"dir": str(tmp_path)}}, stage="simpo"))
    m = stage.eval_metrics({"chosen_logps": C.double().numpy(), "rejected_logps": R.double().numpy(),
                            "chosen_tokens": NC.double().numpy(), "rejected_tokens": NR.double().numpy()})
    assert m["rewards/accuracies"] == 0.5  # pair 1 is a tie
    assert m["rewards/margins"] == pytest.approx(1.0) and m["logps/chosen"] == pytest.approx(-2.5)
    assert m["loss"] == pytest.approx((0.2014133 + math.log1p(math.exp(0.5))) / 2, abs=1e-6) and m["pairs"] == 2


def test_full_fine_tuning_is_allowed_without_reference(tmp_path):
    ORPOStage(load_recipe(raw={"adapter": {"type": "none"}, "output": {"dir": str(tmp_path)}}, stage="orpo"))


# ---- through the trainer: forwards counted, accumulation exact -------------------------------------------------
STAGES = {"orpo": ORPOStage, "simpo": SimPOStage, "dpo": DPOStage}


def train_one_step(tmp_path, stage_name, micro, tokenizer, rows, collate, extra=None):
    """One optimizer step of 4 pairs; returns (grads, first log record, policy forwards, reference contexts)."""
    out = tmp_path / f"{stage_name}{micro}"
    recipe = load_recipe(raw={
        "train": {"micro_batch_size": micro, "global_batch_size": 4, "max_steps": 1, "max_grad_norm": 0,
                  "learning_rate": 1e-3, "eval_at_start": False},
        "adapter": {"lora_r": 4, "lora_dropout": 0.0}, "output": {"dir": str(out)}, **(extra or {}),
    }, stage=stage_name)
    model = build_model("dpo", tokenizer, recipe.adapter)
    counts = {"forwards": 0, "reference": 0}
    model.base_model.model.register_forward_pre_hook(lambda *_: counts.__setitem__("forwards", counts["forwards"] + 1))
    disable = model.disable_adapter

    def counted_disable():
        counts["reference"] += 1
        return disable()

    model.disable_adapter = counted_disable
    capture = GradCapture()
    trainer = CoreTrainer(model=model, args=build_training_args(recipe, out, has_eval=False),
                          train_dataset=with_pair_length(Dataset.from_list(rows)), data_collator=PairCollator(collate),
                          callbacks=[capture], stage=STAGES[stage_name](recipe))
    trainer.train()
    return capture.grads, [h for h in trainer.state.log_history if "loss" in h][0], counts


@pytest.mark.parametrize("stage_name", ["orpo", "simpo"])
def test_no_reference_forward_and_exact_accumulation(tmp_path, tokenizer, pairs, collate, stage_name):
    rows = pairs(4)
    ref_grads, ref_log, counts4 = train_one_step(tmp_path, stage_name, 4, tokenizer, rows, collate)
    grads, log, counts1 = train_one_step(tmp_path, stage_name, 1, tokenizer, rows, collate)
    # reference-free: one policy forward per micro-batch and no adapter-disabled (reference) forward at all
    assert counts4 == {"forwards": 1, "reference": 0} and counts1 == {"forwards": 4, "reference": 0}
    assert log["loss"] == pytest.approx(ref_log["loss"], rel=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
            "logps/rejected"} <= set(log)


def test_dpo_counts_one_reference_forward_per_micro_batch(tmp_path, tokenizer, pairs, collate):
    """The counter itself works: DPO runs the adapter-disabled reference once per micro-batch."""
    _, _, counts = train_one_step(tmp_path, "dpo", 1, tokenizer, pairs(4), collate)
    assert counts == {"forwards": 8, "reference": 4}
