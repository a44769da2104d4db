"""KTO: the loss against hand-computed values and its limits, the KL reference point (mismatched pairs, clamp,
detach, estimated over the whole optimizer step), exact accumulation 4x1 == 1x4, eval metrics."""

import pytest
import torch
from datasets import Dataset

from llmtune.config import RecipeError, load_recipe
from llmtune.core.trainer import CoreTrainer, build_training_args
from llmtune.data.unpaired import UnpairedCollator
from llmtune.stages import KTOStage
from llmtune.stages.kto import kl_rows, kto_kl, kto_loss, pad_rows
from test_pairwise_accumulation import GradCapture, build_model

LOGPS, REF = torch.tensor([-10.0, -5.0]), torch.tensor([-11.0, -5.0])  # log-ratios r = [1, 0]
DESIRABLE = torch.tensor([True, False])


def test_loss_hand_values():
    # desirable: 2 * (1 - sigmoid(0.1 * (1 - 0.5))) = 2 * (1 - sigmoid(0.05)) = 0.9750052
    # undesirable: 1 * (1 - sigmoid(0.1 * (0.5 - 0))) = 0.4875026
    losses, rewards = kto_loss(LOGPS, REF, DESIRABLE, 0.5, beta=0.1, desirable_weight=2.0, undesirable_weight=1.0)
    torch.testing.assert_close(losses, torch.tensor([0.9750052, 0.4875026]), atol=1e-6, rtol=0)
    torch.testing.assert_close(rewards, torch.tensor([0.1, 0.0]))


def test_loss_limits():
    r = torch.tensor([-3.0, 0.0, 2.0])
    # KL reference point 0: a desirable and an undesirable row with the same log-ratio sum to 1 (1 - s + s)
    good, _ = kto_loss(r, torch.zeros(3), torch.ones(3, dtype=torch.bool), 0.0, beta=0.5)
    bad, _ = kto_loss(r, torch.zeros(3), torch.zeros(3, dtype=torch.bool), 0.0, beta=0.5)
    torch.testing.assert_close(good + bad, torch.ones(3))
    torch.testing.assert_close(good, 1 - torch.sigmoid(0.5 * r))
    # policy == reference with z0 = 0: every loss is 1/2 times its weight
    half, _ = kto_loss(r, r, DESIRABLE[[0, 1, 1]], 0.0, beta=0.1, desirable_weight=3.0, undesirable_weight=0.5)
    torch.testing.assert_close(half, torch.tensor([1.5, 0.25, 0.25]))


def test_reference_point_is_clamped_mean_and_never_differentiated():
    pol = torch.tensor([-4.0, -6.0], requires_grad=True)
    assert kto_kl(pol, torch.tensor([-5.0, -6.0])).item() == pytest.approx(0.5)  # mean(1, 0)
    assert kto_kl(pol, torch.tensor([-3.0, -5.0])).item() == 0.0  # mean(-1, -1) clamped at 0
    assert not kto_kl(pol, torch.tensor([-5.0, -6.0])).requires_grad
    z0 = torch.tensor(0.3, requires_grad=True)
    logps = LOGPS.clone().requires_grad_()
    kto_loss(logps, REF, DESIRABLE, z0, beta=0.1)[0].sum().backward()
    assert z0.grad is None and logps.grad.abs().sum() > 0


def kto_rows(n=4, vocab=300, seed=0, same_prompt=False):
    """Hand-built KTO rows; row i's KL sequence is its prompt + the completion of row i + 1 (cyclically)."""
    g = torch.Generator().manual_seed(seed)
    rows, shared = [], torch.randint(10, vocab, (4,), generator=g).tolist()
    for i in range(n):
        prompt = shared if same_prompt else torch.randint(10, vocab, (3 + i % 3,), generator=g).tolist()
        completion = torch.randint(10, vocab, (2 + i % 4,), generator=g).tolist()
        rows.append({"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion,
                     "prompt_length": len(prompt), "label": i % 2, "pair_index": -1})
    for i, row in enumerate(rows):
        p, nxt = row["prompt_length"], rows[(i + 1) % n]
        completion = nxt["input_ids"][nxt["prompt_length"]:]
        row["kl_input_ids"] = row["input_ids"][:p] + completion
        row["kl_labels"] = [-100] * p + completion
    return rows


def test_kl_rows_unpad_the_rows_own_mismatched_sequences(tokenizer):
    rows = kto_rows(4)
    collate = UnpairedCollator(tokenizer)
    split = kl_rows([collate(rows[:1]), collate(rows[1:3]), collate(rows[3:])])
    assert split == kl_rows([collate(rows)]) == [(r["kl_input_ids"], r["kl_labels"]) for r in rows]


def test_recipe_rules(tmp_path):
    with pytest.raises(RecipeError, match="adapter disabled"):
        KTOStage(load_recipe(raw={"adapter": {"type": "none"}}, stage="kto"))
    # a step of one row is fine now: every row brings its own mismatched completion (built with the data)
    assert KTOStage(load_recipe(raw={"train": {"global_batch_size": 1}}, stage="kto")).preflight(".") == []


def test_eval_metrics_pairwise_accuracy_and_whole_set_reference_point(tmp_path):
    stage = KTOStage(load_recipe(raw={"kto": {"beta": 1.0}, "output": {"dir": str(tmp_path)}}, stage="kto"))
    stats = {  # pairs 0 and 1 complete (pair 1 chosen below rejected), pair 2 only its chosen row, one unpaired row
        "logps": [-1.0, -3.0, -4.0, -2.0, -1.0, -2.0], "ref_logps": [-2.0, -2.0, -2.0, -2.0, -2.0, -2.0],
        "kl_logps": [-1.0, -2.0, -3.0, -1.0, -1.0, -1.0], "kl_ref_logps": [-1.5, -2.5, -3.5, -1.5, -1.5, -1.5],
        "label": [1, 0, 1, 0, 1, 1], "pair_index": [0, 0, 1, 1, 2, -1],
    }
    m = stage.eval_metrics({k: torch.tensor(v, dtype=torch.float64).numpy() for k, v in stats.items()})
    assert m["kl"] == pytest.approx(0.5)  # mean over the whole eval set
    assert m["rewards/accuracies"] == 0.5 and m["pairs"] == 2
    r = torch.tensor([1.0, -1.0, -2.0, 0.0, 1.0, 0.0])
    assert m["rewards/chosen"] == pytest.approx(0.0) and m["rewards/rejected"] == pytest.approx(-0.5)
    assert m["rewards/margins"] == pytest.approx(0.5) and m["logps/chosen"] == pytest.approx(-2.0)
    desirable = torch.tensor([1, 0, 1, 0, 1, 1]).bool()
    expected = torch.where(desirable, 1 - torch.sigmoid(r - 0.5), 1 - torch.sigmoid(0.5 - r)).mean()
    assert m["loss"] == pytest.approx(float(expected), rel=1e-6) and m["rows"] == 6


def train_one_step(tmp_path, micro, tokenizer, rows):
    out = tmp_path / f"kto{micro}"
    recipe = load_recipe(raw={
        "train": {"micro_batch_size": micro, "global_batch_size": 4, "max_steps": 1, "max_grad_norm": 0,
                  "learning_rate": 1e-3, "eval_at_start": False},
        "adapter": {"lora_r": 4, "lora_dropout": 0.0}, "data": {"max_length": 64},
        "kto": {"beta": 0.5, "desirable_weight": 1.5}, "output": {"dir": str(out)},
    }, stage="kto")
    stage = KTOStage(recipe)
    kls = []
    prepare = stage.prepare_step

    def recorded(trainer, batches):
        prepare(trainer, batches)
        kls.append([float(b["kl"]) for b in batches])

    stage.prepare_step = recorded
    capture = GradCapture()
    trainer = CoreTrainer(model=build_model("dpo", tokenizer, recipe.adapter),
                          args=build_training_args(recipe, out, has_eval=False),
                          train_dataset=Dataset.from_list(rows), data_collator=UnpairedCollator(tokenizer),
                          callbacks=[capture], stage=stage)
    trainer.train()
    return capture.grads, [h for h in trainer.state.log_history if "loss" in h][0], kls, trainer.trained_tokens


def test_same_gradients_and_reference_point_for_4x1_and_1x4(tmp_path, tokenizer):
    """z0 is estimated over the step's 4 rows either way; estimated per micro-batch of 1, each row would be paired
    with its own completion (z0 = the row's own log-ratio) and the gradients would differ."""
    rows = kto_rows(4, seed=5)  # rows whose step z0 is > 0 (not clamped) and whose own log-ratios differ
    ref_grads, ref_log, ref_kl, ref_items = train_one_step(tmp_path, 4, tokenizer, rows)
    grads, log, kl, items = train_one_step(tmp_path, 1, tokenizer, rows)
    assert ref_items == items == 4  # completions
    assert len(kl) == 1 and len(kl[0]) == 4 and len(set(kl[0])) == 1  # one z0 for the step, in each micro-batch
    assert kl[0][0] == pytest.approx(ref_kl[0][0], rel=1e-4) and ref_kl[0][0] > 0.01  # float noise of padding only
    assert log["loss"] == pytest.approx(ref_log["loss"], rel=1e-5)
    assert grads.keys() == ref_grads.keys() and len(grads) > 0
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())
    assert {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "kl"} <= set(log)
    assert "rewards/margins" in ref_log  # only micro-batches holding both labels log a margin
    assert log["rewards/chosen"] == pytest.approx(ref_log["rewards/chosen"], rel=1e-4)


def test_step_reference_point_equals_the_hand_estimate(tmp_path, tokenizer):
    """z0 of the step = clamp(mean over the mismatched rows of policy - reference summed log-probs, 0)."""
    rows = kto_rows(4, seed=5)
    recipe = load_recipe(raw={"adapter": {"lora_r": 4, "lora_dropout": 0.0}, "data": {"max_length": 64},
                              "output": {"dir": str(tmp_path)}}, stage="kto")
    stage, model = KTOStage(recipe), build_model("dpo", tokenizer, recipe.adapter)
    batches = [UnpairedCollator(tokenizer)(rows[:2]), UnpairedCollator(tokenizer)(rows[2:])]

    class Trainer:  # what prepare_step uses of CoreTrainer
        args = type("Args", (), {"device": torch.device("cpu"), "world_size": 1})()
        compute_loss_context_manager = staticmethod(torch.no_grad)

        def __init__(self):
            self.model = model

        @staticmethod
        def _prepare_inputs(batch):
            return batch

    stage.prepare_step(Trainer(), batches)
    kl_batch = pad_rows(kl_rows(batches))
    with torch.no_grad():
        diff = stage.sequence_logps(model, kl_batch) - stage.sequence_ref_logps(model, kl_batch)
    assert float(batches[0]["kl"]) == pytest.approx(max(float(diff.mean()), 0.0), rel=1e-5)
    assert float(batches[1]["kl"]) == float(batches[0]["kl"])


def _stage_and_model(tmp_path, tokenizer):
    recipe = load_recipe(raw={"adapter": {"lora_r": 4, "lora_dropout": 0.0}, "data": {"max_length": 64},
                              "kto": {"beta": 0.5}, "output": {"dir": str(tmp_path)}}, stage="kto")
    return KTOStage(recipe), build_model("dpo", tokenizer, recipe.adapter).eval()


def test_an_eval_batch_of_one_row_uses_its_mismatched_sequence(tmp_path, tokenizer):
    """Issue 21 bug 2: the last, smaller eval batch (or train.eval_batch_size: 1) holds one row; old code rotated
    completions within the batch and so paired the row with its OWN completion (KL term = its implied reward)."""
    stage, model = _stage_and_model(tmp_path, tokenizer)
    rows = kto_rows(3, seed=5)
    stats = stage.eval_stats(model, UnpairedCollator(tokenizer)(rows[2:]))  # one row
    hand = pad_rows([(rows[2]["kl_input_ids"], rows[2]["kl_labels"])])  # prompt 2 + completion of row 0
    with torch.no_grad():
        expected = stage.sequence_logps(model, hand) - stage.sequence_ref_logps(model, hand)
    kl = stats["kl_logps"] - stats["kl_ref_logps"]
    torch.testing.assert_close(kl, expected)
    own = stats["logps"] - stats["ref_logps"]
    assert abs(float(kl - own)) > 1e-3  # not the row's own log-ratio


def test_a_row_without_trained_tokens_is_not_an_item(tmp_path, tokenizer):
    """Issue 21 bug 2: old code counted every row (count_items = B) and added its loss (logps 0: 1 - sigmoid(-beta
    z0) x weight) although it has no log-prob; now it is left out of the count, the loss, z0 and the metrics."""
    stage, model = _stage_and_model(tmp_path, tokenizer)
    rows = kto_rows(4, seed=5)
    empty = {**rows[3], "labels": [-100] * len(rows[3]["labels"])}
    collate = UnpairedCollator(tokenizer)
    batch = collate([*rows[:3], empty])
    assert int(stage.count_items(batch)) == 3  # old code: 4
    with torch.no_grad():
        loss, metrics = stage.loss(model, batch, stage.count_items(batch))
        alone, alone_metrics = stage.loss(model, collate(rows[:3]), torch.tensor(3))
    assert loss.item() == pytest.approx(alone.item(), rel=1e-5)
    assert metrics["kl"] == pytest.approx(alone_metrics["kl"], rel=1e-5)
    stats = {k: v.detach().double().numpy() for k, v in stage.eval_stats(model, batch).items()}
    alone_stats = {k: v.detach().double().numpy() for k, v in stage.eval_stats(model, collate(rows[:3])).items()}
    m, ref = stage.eval_metrics(stats), stage.eval_metrics(alone_stats)
    assert m["rows"] == 3 and m["loss"] == pytest.approx(ref["loss"], rel=1e-6) and m["kl"] == pytest.approx(ref["kl"])
