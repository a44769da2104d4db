"""The LM head at trained positions only: the same losses, log-probs and gradients as the full-logits path."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from llmtune.config import load_recipe
from llmtune.core import lm_head
from llmtune.core.lm_head import (
    TokenLogps,
    masked_token_logps,
    next_token_targets,
    per_token_logps,
    sequence_logps,
)
from llmtune.core.ops import causal_lm_loss_sum, token_logps
from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer
from llmtune.stages import DPOStage, SFTStage


def lora_model(tie: bool = False):
    model = make_tiny_llama(make_tiny_tokenizer(), tie_word_embeddings=tie)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    for name, p in model.named_parameters():  # non-zero B: the LoRA path changes the outputs
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return model


def padded_batch(B=3, T=14, vocab=300):
    ids = torch.randint(5, vocab, (B, T))
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 9:], mask[2, 6:] = 0, 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :4] = -100  # prompt
    labels[0, 7] = -100  # a hole inside a completion (multi-turn)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def grads(model):
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return out


def test_next_token_targets_shift():
    labels = torch.tensor([[-100, -100, 7, 8, -100], [-100, 5, -100, -100, -100]])
    keep, targets = next_token_targets(labels)
    # position t is kept when labels[t + 1] is trained; targets in row-major order
    assert keep.tolist() == [[False, True, True, False, False], [True, False, False, False, False]]
    assert targets.tolist() == [7, 8, 5]


@pytest.mark.parametrize("tie", [False, True])
def test_sft_loss_and_gradients_match_full_logits(tie):
    model, batch = lora_model(tie), padded_batch()
    full, n = causal_lm_loss_sum(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                 batch["labels"])
    full.backward()
    expected = grads(model)
    logps, keep = masked_token_logps(model, batch, batch["labels"])
    assert logps.shape == (int(n),) and int(keep.sum()) == int(n)
    (-logps.sum()).backward()
    got = grads(model)
    torch.testing.assert_close(-logps.sum(), full.detach(), rtol=1e-5, atol=1e-5)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_sequence_and_per_token_logps_match_token_logps():
    model, batch = lora_model(), padded_batch()
    with torch.no_grad():
        dense, _ = token_logps(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                               batch["labels"])
        torch.testing.assert_close(sequence_logps(model, batch, batch["labels"]), dense.sum(-1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(per_token_logps(model, batch, batch["labels"]), dense, rtol=1e-5, atol=1e-5)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        hot, _ = token_logps(logits / 0.7, batch["labels"])
        torch.testing.assert_close(per_token_logps(model, batch, batch["labels"], temperature=0.7), hot,
                                   rtol=1e-5, atol=1e-5)


def test_head_runs_on_trained_positions_only():
    model, batch = lora_model(), padded_batch()
    rows = []
    head = model.get_base_model().lm_head
    handle = head.register_forward_hook(lambda m, inp, out: rows.append(inp[0].reshape(-1, inp[0].shape[-1]).shape[0]))
    recipe = load_recipe(raw={"stage": "sft"})
    SFTStage(recipe).loss(model, batch, torch.tensor(10))
    handle.remove()
    assert rows == [int((batch["labels"][:, 1:] != -100).sum())]  # not B * T = 42


def test_fallback_without_masked_head_gives_the_same(monkeypatch):
    model, batch = lora_model(), padded_batch()
    with torch.no_grad():
        fast = sequence_logps(model, batch, batch["labels"])
        monkeypatch.setattr(lm_head, "supports_masked_head", lambda m: False)
        slow = sequence_logps(model, batch, batch["labels"])
    torch.testing.assert_close(fast, slow, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logps_function_chunks_and_gradient(dtype):
    logits = (torch.randn(7, 50) * 3).to(dtype).requires_grad_()
    targets = torch.randint(0, 50, (7,))
    weights = torch.randn(7)
    ref = torch.log_softmax(logits.float(), -1).gather(1, targets[:, None]).squeeze(1)
    (ref * weights).sum().backward()
    expected, logits.grad = logits.grad.clone(), None
    got = TokenLogps.apply(logits.detach().clone().requires_grad_(), targets, 3)  # 3 chunks of rows
    torch.testing.assert_close(got, ref.detach(), rtol=1e-6, atol=1e-6)
    x = logits.detach().clone().requires_grad_()
    out = TokenLogps.apply(x, targets, 3)
    (out * weights).sum().backward()
    assert x.grad.dtype == dtype
    torch.testing.assert_close(x.grad, expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="only once"):
        y = logits.detach().clone().requires_grad_()
        z = TokenLogps.apply(y * 1.0, targets, 3).sum()
        z.backward(retain_graph=True)
        z.backward()


def test_all_masked_micro_batch_is_a_differentiable_zero():
    model, batch = lora_model(), padded_batch()
    batch["labels"][:] = -100
    logps, _ = masked_token_logps(model, batch, batch["labels"])
    loss = -logps.sum()
    loss.backward()
    assert float(loss) == 0.0


def test_dpo_stage_logps_match_full_logits(pairs_batch):
    recipe = load_recipe(raw={"stage": "dpo"})
    model = lora_model()
    with torch.no_grad():
        chosen, rejected = DPOStage(recipe).logps(model, pairs_batch)
        dense, _ = token_logps(model(input_ids=pairs_batch["input_ids"],
                                     attention_mask=pairs_batch["attention_mask"]).logits, pairs_batch["labels"])
    n = chosen.shape[0]
    torch.testing.assert_close(chosen, dense.sum(-1)[:n], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rejected, dense.sum(-1)[n:], rtol=1e-5, atol=1e-5)


@pytest.fixture
def pairs_batch():
    from tests.unit.stages.conftest import collate_pairs, make_pairs

    return collate_pairs(make_pairs(4))


def test_pair_logps_refuses_an_odd_batch_instead_of_dropping_its_last_row():
    """(2B, T) means chosen rows then rejected rows: 3 rows would pair row 0 with row 1 and silently drop row 2."""
    model = lora_model()
    batch = padded_batch(B=3)
    with pytest.raises(ValueError, match="got 3 rows"):
        lm_head.pair_logps(model, batch)


def test_kto_scores_every_row_of_an_odd_micro_batch():
    """KTO rows are unrelated sequences: a micro-batch of 1 or 3 rows gets one summed log-prob per row."""
    from llmtune.stages import KTOStage

    model = lora_model()
    batch = padded_batch(B=3)
    stage = KTOStage(load_recipe(raw={"output": {"dir": "/tmp/unused"}}, stage="kto"))
    got = stage.sequence_logps(model, batch)
    want = token_logps(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                       batch["labels"])[0].sum(-1)  # (3,): row 2 too
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
