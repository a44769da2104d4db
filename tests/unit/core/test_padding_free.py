"""Padding-free SFT batches and shared-prompt DPO pairs: the same log-probs and gradients as the padded batches."""

import pytest
import torch

from llmtune.config import load_recipe
from llmtune.core import padding_free
from llmtune.core.lm_head import masked_token_logps, pair_logps, shared_prompt_rows
from llmtune.core.ops import count_trained_tokens
from llmtune.core.padding_free import PaddingFreeCollator, use_varlen_attention
from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer
from llmtune.stages import SFTStage
from tests.unit.core.test_lm_head import grads, lora_model, padded_batch
from tests.unit.stages.conftest import collate_pairs, make_pairs


def rows_of_batch(batch):
    n = batch["attention_mask"].sum(-1).tolist()
    return [{"input_ids": batch["input_ids"][i, :k], "labels": batch["labels"][i, :k]} for i, k in enumerate(n)]


def test_collator_concatenates_rows_with_positions_and_masks_row_starts():
    rows = [{"input_ids": [5, 6, 7], "labels": [5, 6, 7]}, {"input_ids": [8, 9], "labels": [-100, 9]}]
    batch = PaddingFreeCollator()(rows)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1]]
    assert batch["row_index"].tolist() == [[0, 0, 0, 1, 1]]
    # 8 must not be a target of 7 (the end of the previous row): -100 at every row start
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9]]
    assert "attention_mask" not in batch
    with pytest.raises(ValueError, match="row 0"):
        PaddingFreeCollator()([{"input_ids": [1, 2], "labels": [1]}])


def test_padding_free_matches_padded_loss_and_gradients():
    model, batch = lora_model(), padded_batch()
    logps, _ = masked_token_logps(model, batch, batch["labels"])
    (-logps.sum()).backward()
    expected = grads(model)
    assert use_varlen_attention(model.get_base_model())
    packed = PaddingFreeCollator()(rows_of_batch(batch))
    assert count_trained_tokens(packed["labels"]) == count_trained_tokens(batch["labels"])
    got_logps, _ = masked_token_logps(model, packed, packed["labels"])
    (-got_logps.sum()).backward()
    torch.testing.assert_close(got_logps, logps.detach(), rtol=1e-5, atol=1e-5)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
    # a padded batch under the varlen kernel is transformers' SDPA with its mask: unchanged
    again, _ = masked_token_logps(model, batch, batch["labels"])
    torch.testing.assert_close(again.detach(), logps.detach(), rtol=1e-6, atol=1e-6)


def test_no_attention_across_rows(monkeypatch):
    model, batch = lora_model(), padded_batch()
    use_varlen_attention(model.get_base_model())
    calls = []
    monkeypatch.setattr(padding_free, "row_starts", lambda pos, f=padding_free.row_starts: calls.append(1) or f(pos))
    packed = PaddingFreeCollator()(rows_of_batch(batch))
    changed = {k: v.clone() for k, v in packed.items()}
    changed["input_ids"][0, 1:6] = 3  # tokens of row 0 only
    with torch.no_grad():
        a, keep = masked_token_logps(model, packed, packed["labels"])
        b, _ = masked_token_logps(model, changed, changed["labels"])
    assert calls  # the row-by-row kernel ran
    later = packed["row_index"][keep] > 0
    torch.testing.assert_close(a[later], b[later], rtol=0, atol=0)
    assert not torch.allclose(a[~later], b[~later])


def test_eager_models_keep_their_kernel():
    model = make_tiny_llama(make_tiny_tokenizer())
    model.config._attn_implementation = "eager"
    assert not use_varlen_attention(model)
    assert model.config._attn_implementation == "eager"


def test_sft_eval_stats_per_row_match_padded():
    model, batch = lora_model(), padded_batch()
    stage = SFTStage(load_recipe(raw={"stage": "sft"}))
    with torch.no_grad():
        padded = stage.eval_stats(model, batch)
        use_varlen_attention(model.get_base_model())
        packed = stage.eval_stats(model, PaddingFreeCollator()(rows_of_batch(batch)))
    torch.testing.assert_close(packed["loss_sum"], padded["loss_sum"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed["n_tokens"], padded["n_tokens"])


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_prompt_pairs_match_separate_rows(attention):
    model = lora_model()
    model.get_base_model().config._attn_implementation = attention
    batch = collate_pairs(make_pairs(5))
    chosen, rejected = pair_logps(model, batch, share_prompt=False)
    (chosen.sum() - 2 * rejected.sum()).backward()
    expected = grads(model)
    seen = []
    handle = model.get_base_model().model.register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs["input_ids"].shape), with_kwargs=True)
    got_c, got_r = pair_logps(model, batch, share_prompt=True)
    handle.remove()
    assert seen[0][0] == 5  # one row per pair, not 2B = 10
    assert seen[0][1] < batch["input_ids"].shape[1] * 2
    (got_c.sum() - 2 * got_r.sum()).backward()
    torch.testing.assert_close(got_c, chosen.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_r, rejected.detach(), rtol=1e-5, atol=1e-5)
    for name, grad in grads(model).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-4, atol=1e-5, msg=name)


def test_shared_prompt_rows_layout_and_refusals():
    rows = [{"chosen_input_ids": [1, 2, 3, 4], "chosen_labels": [-100, -100, 3, 4],
             "rejected_input_ids": [1, 2, 5], "rejected_labels": [-100, -100, 5], "prompt_length": 2}]
    batch = collate_pairs(rows)
    shared = shared_prompt_rows(batch, torch.bool)
    assert shared["input_ids"].tolist() == [[1, 2, 3, 4, 5]]
    assert shared["position_ids"].tolist() == [[0, 1, 2, 3, 2]]  # the rejected token keeps its own position
    mask = shared["attention_mask"][0, 0]
    assert mask[4].tolist() == [True, True, False, False, True]  # rejected sees the prompt and itself only
    assert shared["targets"].tolist() == [3, 4, 5]
    assert shared["rejected"].tolist() == [False, False, True]
    bad = dict(batch)
    bad["input_ids"] = batch["input_ids"].clone()
    bad["input_ids"][1, 0] = 9  # the two sides no longer share their prompt
    assert shared_prompt_rows(bad, torch.bool) is None
