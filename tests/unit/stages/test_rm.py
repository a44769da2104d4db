"""Reward model stage: Bradley-Terry loss, tie-aware accuracy, scores read at the last real token."""

import math

import numpy as np
import pytest
import torch
from transformers import LlamaForSequenceClassification

from llmtune.config import load_recipe
from llmtune.models import attach_adapter, sequence_scores
from llmtune.models.tiny import make_tiny_llama
from llmtune.stages import RMStage
from llmtune.stages.rm import bradley_terry_loss, pair_metrics



def neg_log_sigmoid(x: float) -> float:
    return math.log1p(math.exp(-x))


def test_bradley_terry_loss_hand_values():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    # -log sigmoid(1) = log(1 + e^-1) = 0.3132617; -log sigmoid(0) = log 2; -log sigmoid(-2) = 2.1269280
    expected = torch.tensor([0.31326169, 0.69314718, 2.12692801])
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected), expected, atol=1e-6, rtol=0)


def test_margin_and_reward_centering_hand_values():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 0.0])
    # margin 0.5: -log sigmoid(1 - 0.5) = 0.4740770, -log sigmoid(0 - 0.5) = 0.9740770
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected, margin=0.5),
                               torch.tensor([0.47407698, 0.97407698]), atol=1e-6, rtol=0)
    # centering 0.01 * (r_c + r_r)^2: + 0.01 * 9 = 0.09 on the first pair, + 0 on the second
    torch.testing.assert_close(bradley_terry_loss(chosen, rejected, center_rewards_coef=0.01),
                               torch.tensor([0.31326169 + 0.09, 0.69314718]), atol=1e-6, rtol=0)


def test_accuracy_does_not_count_ties():
    m = pair_metrics(np.array([1.0, 2.0, 3.0, 0.5]), np.array([0.0, 2.0, 4.0, 0.5]))
    assert m["accuracy"] == 0.25  # only the first pair; the two ties are not correct (trl #1012)
    assert m["ties"] == 0.5
    assert m["margin"] == pytest.approx((1.0 + 0.0 - 1.0 + 0.0) / 4)
    assert m["chosen"] == pytest.approx(6.5 / 4) and m["rejected"] == pytest.approx(6.5 / 4)


def test_eval_metrics_reduce_over_all_pairs(tmp_path):
    stage = RMStage(load_recipe(raw={"rm": {"margin": 0.5}, "output": {"dir": str(tmp_path)}}, stage="rm"))
    m = stage.eval_metrics({"chosen": np.array([2.0, 0.0]), "rejected": np.array([1.0, 0.0])})
    assert m["loss"] == pytest.approx((0.47407698 + 0.97407698) / 2, abs=1e-6)
    assert m["accuracy"] == 0.5 and m["ties"] == 0.5 and m["pairs"] == 2


def score_model(tokenizer, pad_token_id):
    causal = make_tiny_llama(tokenizer, seed=0)
    config = causal.config
    config.num_labels, config.pad_token_id = 1, pad_token_id
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(config).eval()
    model.model.load_state_dict(causal.model.state_dict())
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # scores of order 1, so atol 1e-5 is a real test
    return model


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_scores_are_the_same_left_right_and_unpadded(tokenizer, attn):
    model = score_model(tokenizer, tokenizer.pad_token_id)
    model.config._attn_implementation = attn
    rows = [[5, 17, 42, 99, 3, 250, 1], [12, 13, 14], [7, 8, 9, 10, 11]]  # the first ends with EOS (= pad)
    T, pad = max(map(len, rows)), tokenizer.pad_token_id
    with torch.no_grad():
        alone = torch.cat([sequence_scores(model, torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long))
                           for r in rows])
        for side in ("right", "left"):
            ids = torch.full((len(rows), T), pad)
            mask = torch.zeros((len(rows), T), dtype=torch.long)
            for b, r in enumerate(rows):
                span = slice(0, len(r)) if side == "right" else slice(T - len(r), T)
                ids[b, span], mask[b, span] = torch.tensor(r), 1
            torch.testing.assert_close(sequence_scores(model, ids, mask), alone, atol=1e-5, rtol=0, msg=side)
    assert alone.abs().max() > 0.1


def test_transformers_pooling_misreads_rows_ending_in_eos_when_pad_is_eos(tokenizer):
    """Why scores are read from the mask: HF pools at the last token != pad_token_id, one token early here."""
    model = score_model(tokenizer, tokenizer.pad_token_id)
    row = torch.tensor([[5, 17, 42, tokenizer.eos_token_id]])
    with torch.no_grad():
        ours = sequence_scores(model, row, torch.ones_like(row))
        hf = model(input_ids=row).logits[:, 0]
        hf_without_eos = model(input_ids=row[:, :-1]).logits[:, 0]
    torch.testing.assert_close(hf, hf_without_eos)  # HF ignored the final EOS
    assert not torch.allclose(ours, hf, atol=1e-4)


def test_rm_trains_lora_and_the_whole_score_head(tmp_path, tokenizer, pairs, collate):
    recipe = load_recipe(raw={"adapter": {"lora_r": 4, "lora_dropout": 0.0}, "output": {"dir": str(tmp_path)}},
                         stage="rm")
    stage = RMStage(recipe)
    assert recipe.adapter.modules_to_save == ["score"]
    model = stage.prepare_model(score_model(tokenizer, None), tokenizer)
    assert model.config.pad_token_id == tokenizer.pad_token_id
    model = attach_adapter(model, recipe.adapter, gradient_checkpointing=False, quantized=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("score.modules_to_save" in n for n in trainable) and any("lora_A" in n for n in trainable)
    batch = collate(pairs(4))
    loss, metrics = stage.loss(model, batch, torch.tensor(4))
    chosen, rejected = stage.scores(model, batch)
    assert loss.detach().item() == pytest.approx(float(bradley_terry_loss(chosen, rejected).mean().detach()), rel=1e-6)
    assert set(metrics) == {"accuracy", "ties", "margin", "chosen", "rejected"}
    loss.backward()
    head = [p for n, p in model.named_parameters() if "score.modules_to_save" in n][0]
    assert head.grad is not None and head.grad.abs().sum() > 0


def test_gradient_checkpointing_gives_the_same_gradients(tmp_path, tokenizer, pairs, collate):
    """Scores run the backbone directly (not the model's forward): checkpointing must still reach the LoRA weights."""
    grads = []
    for checkpointing in (False, True):
        recipe = load_recipe(raw={"adapter": {"lora_r": 4, "lora_dropout": 0.0}, "output": {"dir": str(tmp_path)}},
                             stage="rm")
        stage = RMStage(recipe)
        model = attach_adapter(score_model(tokenizer, tokenizer.pad_token_id), recipe.adapter,
                               gradient_checkpointing=checkpointing, quantized=False)
        model.train()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.2, generator=torch.Generator().manual_seed(3))
        loss, _ = stage.loss(model, collate(pairs(3)), torch.tensor(3))
        loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("lora_A" in n for n in grads[1])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_rm_stage_pads_with_a_token_no_sequence_contains_so_transformers_pools_like_llmtune(tokenizer, tmp_path):
    """pad == EOS (the tiny tokenizer, like SmolLM2): after prepare_model a row ending in EOS is scored the same by
    transformers' own pooling, unpadded and right-padded with the tokenizer's pad, as by llmtune."""
    from llmtune.data.templates import dedicated_pad_token

    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    stage = RMStage(load_recipe(raw={"output": {"dir": str(tmp_path)}}, stage="rm"))
    model = stage.prepare_model(score_model(tokenizer, tokenizer.pad_token_id), tokenizer)
    assert tokenizer.pad_token == "<unk>" == dedicated_pad_token(tokenizer)  # old code: stays <|im_end|>
    assert model.config.pad_token_id == tokenizer.pad_token_id != tokenizer.eos_token_id
    rows = [[5, 17, 42, tokenizer.eos_token_id], [12, 13, tokenizer.eos_token_id, 204, 7, tokenizer.eos_token_id]]
    T = max(map(len, rows))
    ids = torch.full((2, T), tokenizer.pad_token_id)
    mask = torch.zeros((2, T), dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, :len(r)], mask[b, :len(r)] = torch.tensor(r), 1
    with torch.no_grad():
        ours = sequence_scores(model, ids, mask)
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits[:, 0], ours, atol=1e-5, rtol=0)
        alone = torch.cat([model(input_ids=torch.tensor([r])).logits[:, 0] for r in rows])
        torch.testing.assert_close(alone, ours, atol=1e-5, rtol=0)


def test_every_pair_stage_builds_the_same_sequences_from_the_same_pairs(tmp_path):
    """One rendering (issue 21 bug 4): RM, DPO, ORPO, SimPO and KTO all see the template's exact output (scored
    where a consumer's apply_chat_template output ends); the "\\n" after the end-of-turn token is not trained."""
    import json

    from llmtune.models.tiny import make_tiny_tokenizer
    from llmtune.stages import STAGES

    path = tmp_path / "pairs.jsonl"
    path.write_text(json.dumps({"prompt": "Hi", "chosen": "Hello there.", "rejected": "Go."}) + "\n")
    raw = {"data": {"datasets": [{"path": str(path)}]}, "output": {"dir": str(tmp_path / "out")}}
    tok = make_tiny_tokenizer()
    conversation = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]
    consumer = list(tok.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"])
    assert consumer[-2] == tok.eos_token_id
    for name in ("rm", "dpo", "orpo", "simpo", "kto"):
        row = STAGES[name](load_recipe(raw=raw, stage=name)).build_data(tok, str(tmp_path)).train[0]
        ids, labels = (row["input_ids"], row["labels"]) if name == "kto" else (row["chosen_input_ids"],
                                                                                row["chosen_labels"])
        assert ids == consumer, name  # old code: DPO/ORPO/SimPO/KTO without the final "\\n"
        assert labels[-2:] == [tok.eos_token_id, -100], name


def test_without_an_unused_token_export_adds_a_pad_token_and_an_embedding_row(tokenizer, monkeypatch):
    import llmtune.data.templates as templates
    from llmtune.models.heads import ADDED_PAD_TOKEN, use_dedicated_pad

    monkeypatch.setattr(templates, "dedicated_pad_token", lambda tok, rows=None: None)  # every token is in use
    model = score_model(tokenizer, tokenizer.pad_token_id)
    rows = model.get_input_embeddings().weight.shape[0]
    assert not use_dedicated_pad(model, tokenizer)  # training: no resize, the pad stays
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert use_dedicated_pad(model, tokenizer, add=True)
    assert tokenizer.pad_token == ADDED_PAD_TOKEN and tokenizer.pad_token_id == rows == model.config.pad_token_id
    assert model.get_input_embeddings().weight.shape[0] == rows + 1
    row = torch.tensor([[5, 17, 42, tokenizer.eos_token_id, tokenizer.pad_token_id]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=row).logits[:, 0], sequence_scores(model, row, mask))
