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


def test_orpo_nll_on_prompt_hand_value():
    """orpo.nll_on_prompt: NLL = -(completion + prompt log-probs) / (completion + prompt tokens); the odds-ratio
    term is unchanged. Pair 0: (-2 - 4) / (2 + 2) = 1.5; pair 1: (-3 - 1) / (3 + 1) = 1.0."""
    prompt_logps, prompt_tokens = torch.tensor([-4.0, -1.0]), torch.tensor([2.0, 1.0])
    losses, rc, rr, extra = orpo_loss(C, R, NC, NR, beta=0.1, prompt_logps=prompt_logps, prompt_tokens=prompt_tokens)
    torch.testing.assert_close(extra["nll_loss"], torch.tensor([1.5, 1.0]))
    torch.testing.assert_close(losses, torch.tensor([1.5 + 0.1 * 0.2381830, 1.0 + 0.1 * math.log(2)]), atol=1e-6,
                               rtol=0)
    torch.testing.assert_close(extra["log_odds_chosen"], torch.tensor([1.3132617, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rc, torch.tensor([-0.1, -0.1]))  # rewards: completion token-means, as before


@pytest.mark.parametrize("on_prompt", [False, True])
def test_orpo_nll_on_prompt_is_the_whole_chosen_sequence(tokenizer, pairs, collate, tmp_path, on_prompt):
    """beta = 0: the loss is the token-mean NLL of each chosen sequence over its completion (default) or over all
    its real tokens after the first (nll_on_prompt), from the logits of a plain forward, averaged over pairs."""
    recipe = load_recipe(raw={"orpo": {"beta": 0.0, "nll_on_prompt": on_prompt}, "adapter": {"lora_dropout": 0.0},
                              "output": {"dir": str(tmp_path)}}, stage="orpo")
    model = make_tiny_llama(tokenizer, seed=0)
    batch = collate(pairs(4))
    stage = ORPOStage(recipe)
    loss, metrics = stage.loss(model, batch, torch.tensor(4))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    every = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    sums, counts = per_sequence_loss_sum(logits[:4], (every if on_prompt else batch["labels"])[:4])
    assert loss.item() == pytest.approx(float((sums / counts).mean()), rel=1e-5)
    assert metrics["nll_loss"] == pytest.approx(loss.item(), rel=1e-5)
    # evaluation reduces the same statistics to the same loss
    stats = {k: v.detach().double().numpy() for k, v in stage.eval_stats(model, batch).items()}
    assert stage.eval_metrics(stats)["loss"] == pytest.approx(loss.item(), rel=1e-5)


@pytest.mark.parametrize("stage_name", ["orpo", "simpo", "dpo"])
def test_a_pair_without_trained_tokens_is_not_an_item(tokenizer, pairs, collate, tmp_path, stage_name):
    """A pair whose chosen row has no trained token is not counted and adds nothing to the loss (ORPO/SimPO
    divided by its 0 tokens: NaN); the other pairs' loss is unchanged."""
    recipe = load_recipe(raw={"adapter": {"lora_dropout": 0.0}, "output": {"dir": str(tmp_path)}}, stage=stage_name)
    stage = STAGES[stage_name](recipe)
    model = make_tiny_llama(tokenizer, seed=0)
    rows = pairs(3)
    empty = {**rows[0], "chosen_labels": [-100] * len(rows[0]["chosen_labels"])}
    with torch.no_grad():
        kept = stage.loss(model, collate(rows[1:]), torch.tensor(2))[0]
        batch = collate([empty, *rows[1:]])
        assert int(stage.count_items(batch)) == 2  # old code: 3
        loss, metrics = stage.loss(model, batch, stage.count_items(batch))
    assert torch.isfinite(loss) and loss.item() == pytest.approx(kept.item(), rel=1e-5)
    assert all(math.isfinite(v) for v in metrics.values())


LOG1MEXP_POINTS = [-1e-12, -3e-8, -1e-7, -1e-3, -0.1, -0.69, -math.log(2), -0.7, -5.0, -30.0, -80.0]


def _log1mexp_reference(x: float) -> float:
    """log(1 - e^x) with 60 significant digits (mpmath), of the float x exactly as given."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workdps(60):
        return float(mpmath.log(1 - mpmath.exp(mpmath.mpf(x))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log1mexp_matches_a_high_precision_reference_near_zero_and_far(dtype):
    """Issue 21 bug 3: the old clamp at -1e-7 gave log(1 - p) = -16.1 instead of -17.3 at x = -3e-8."""
    x = torch.tensor(LOG1MEXP_POINTS, dtype=dtype)
    expected = torch.tensor([_log1mexp_reference(v) for v in x.tolist()], dtype=torch.float64)
    y = log1mexp(x)
    assert y.dtype == dtype
    rtol = 2e-7 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(y.double(), expected, rtol=rtol, atol=0)
    assert log1mexp(torch.tensor([-3e-8])).item() == pytest.approx(-17.3221, abs=1e-4)  # old code: -16.1181
    # fp16/bf16 inputs are computed in fp32 (an fp16 x = -3e-8 is the fp16 subnormal -2.98e-8)
    half = torch.tensor([-3e-8], dtype=torch.float16)
    assert log1mexp(half).dtype == torch.float32
    assert log1mexp(half).item() == pytest.approx(_log1mexp_reference(half.item()), rel=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log1mexp_gradient_is_exact_and_finite_down_to_minus_1e_12(dtype):
    """d/dx log(1 - e^x) = -e^x / (1 - e^x) = -1 / expm1(-x): finite for every x < 0, on both branches and at
    the branch point; torch.where never mixes in the other branch's inf/NaN."""
    x = torch.tensor(LOG1MEXP_POINTS, dtype=dtype, requires_grad=True)
    log1mexp(x).sum().backward()
    expected = torch.tensor([-1 / math.expm1(-v) for v in x.detach().double().tolist()], dtype=torch.float64)
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad.double(), expected, rtol=1e-6 if dtype == torch.float32 else 1e-12, atol=0)
    assert x.grad[0].item() == pytest.approx(-1e12, rel=1e-6)  # x = -1e-12


def test_orpo_loss_and_gradient_stay_finite_and_exact_as_p_goes_to_one():
    """Chosen completions with mean log-prob -1e-12 and -3e-8 (p ~ 1), in the fp32 the loss computes in: the log-odds
    a - log(1 - e^a) are exact (old clamp: the same 17.97 for both), loss and gradient finite and exact."""
    a = torch.tensor([-1e-12, -3e-8], requires_grad=True)
    b = torch.tensor([-2.0, -2.0])
    losses, *_, extra = orpo_loss(a, b, torch.ones(2), torch.ones(2), beta=1.0)
    points = a.detach().double().tolist()  # the fp32 values exactly
    log_odds = [v - _log1mexp_reference(v) - (-2.0 - _log1mexp_reference(-2.0)) for v in points]  # 29.48, 19.17
    torch.testing.assert_close(extra["log_odds_chosen"].double(), torch.tensor(log_odds, dtype=torch.float64),
                               rtol=1e-6, atol=0)
    losses.sum().backward()
    assert torch.isfinite(losses).all() and torch.isfinite(a.grad).all()
    # d loss / da = -1 - sigmoid(-L) * (1 + 1 / expm1(-a))
    grads = [-1 - (1 / (1 + math.exp(L))) * (1 + 1 / math.expm1(-v)) for v, L in zip(points, log_odds)]
    torch.testing.assert_close(a.grad.double(), torch.tensor(grads, dtype=torch.float64), rtol=1e-5, atol=0)


def test_log1mexp_of_zero_is_finite():
    """A token-mean log-prob that rounds to 0 (p = 1 in the dtype) is read as -finfo.tiny: finite, no NaN."""
    x = torch.zeros(1, requires_grad=True)
    y = log1mexp(x)
    y.backward()
    assert y.item() == pytest.approx(math.log(torch.finfo(torch.float32).tiny)) and torch.isfinite(x.grad).all()


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
    import llmtune.stages.dpo as dpo_module

    scope = dpo_module.reference_scope

    def counted_scope(m):
        counts["reference"] += 1
        return scope(m)

    capture = GradCapture()
    trainer = CoreTrainer(model=model, args=build_training_args(recipe, out, has_eval=False),
                          train_dataset=with_pair_length(Dataset.from_list(rows)), data_collator=PairCollator(collate),
                          callbacks=[capture], stage=STAGES[stage_name](recipe))
    with pytest.MonkeyPatch.context() as mp:  # the reference forwards (DPO's reference_scope) are counted
        mp.setattr(dpo_module, "reference_scope", counted_scope)
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
