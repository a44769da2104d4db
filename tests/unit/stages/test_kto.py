"""KTO: the loss against hand-computed values and its limits, the KL reference point (mismatched pairs, clamp,
detach, estimated over the whole optimizer step), exact accumulation 4x1 == 1x4, eval metrics."""

import pytest
import torch
from datasets import Dataset

from llmtune.config import RecipeError, load_recipe
from llmtune.core.trainer import CoreTrainer, build_training_args
from llmtune.data.unpaired import UnpairedCollator
from llmtune.stages import KTOStage
from llmtune.stages.kto import kto_kl, kto_loss, mismatched_rows, pad_rows
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
    g = torch.Generator().manual_seed(seed)
    rows, shared = [], torch.randint(10, vocab, (4,), generator=g).tolist()
    for i in range(n):
        prompt = shared if same_prompt else torch.randint(10, vocab, (3 + i % 3,), generator=g).tolist()
        completion = torch.randint(10, vocab, (2 + i % 4,), generator=g).tolist()
        rows.append({"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion,
                     "prompt_length": len(prompt), "label": i % 2, "pair_index": -1})
    return rows


def test_mismatched_rows_rotate_completions_over_the_whole_step(tokenizer):
    rows = kto_rows(4)
    collate = UnpairedCollator(tokenizer)
    split = mismatched_rows([collate(rows[:1]), collate(rows[1:3]), collate(rows[3:])], max_length=64)
    whole = mismatched_rows([collate(rows)], max_length=64)
    assert split == whole  # the micro-batch split does not matter
    for i, (ids, labels) in enumerate(whole):
        p, nxt = rows[i]["prompt_length"], rows[(i + 1) % 4]
        assert ids == rows[i]["input_ids"][:p] + nxt["input_ids"][nxt["prompt_length"]:]
        assert labels == [-100] * p + nxt["input_ids"][nxt["prompt_length"]:]
    cut = mismatched_rows([collate(rows)], max_length=6)  # prompts have 3-5 tokens: completions are cut, never empty
    assert [len(ids) for ids, _ in cut] == [min(6, len(w)) for w, _ in whole]
    assert all(len(ids) > rows[i]["prompt_length"] for i, (ids, _) in enumerate(cut))


def test_mismatched_rows_skip_a_completion_of_the_same_prompt(tokenizer):
    """Paired data split into desirable/undesirable rows: the KL completion must come from another prompt."""
    rows = kto_rows(4)
    rows[1] = {**rows[1], "input_ids": rows[0]["input_ids"][: rows[0]["prompt_length"]] + [7, 8],
               "labels": [-100] * rows[0]["prompt_length"] + [7, 8], "prompt_length": rows[0]["prompt_length"]}
    out = mismatched_rows([UnpairedCollator(tokenizer)(rows)], max_length=64)
    p = rows[0]["prompt_length"]
    assert out[0][0][p:] == rows[2]["input_ids"][rows[2]["prompt_length"]:]  # row 1 shares row 0's prompt
    same = kto_rows(3, same_prompt=True)  # nothing else to pick: the next row
    out = mismatched_rows([UnpairedCollator(tokenizer)(same)], max_length=64)
    assert out[0][0] == same[0]["input_ids"][:4] + same[1]["input_ids"][4:]


def test_recipe_rules(tmp_path):
    with pytest.raises(RecipeError, match="adapter disabled"):
        KTOStage(load_recipe(raw={"adapter": {"type": "none"}}, stage="kto"))
    stage = KTOStage(load_recipe(raw={"train": {"global_batch_size": 1}}, stage="kto"))
    assert stage.preflight(".")[0][0] == "train.global_batch_size"


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
    kl_batch = pad_rows(mismatched_rows(batches, 64))
    with torch.no_grad():
        diff = stage.sequence_logps(model, kl_batch) - stage.sequence_ref_logps(model, kl_batch)
    assert float(batches[0]["kl"]) == pytest.approx(max(float(diff.mean()), 0.0), rel=1e-5)
    assert float(batches[1]["kl"]) == float(batches[0]["kl"])
