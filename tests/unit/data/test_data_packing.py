"""Packing: exact labels/positions, and packed logits equal per-row logits on a tiny Llama; the collator."""

from __future__ import annotations

import pytest
import torch

from llmtune.data import SFTCollator, build_sft_data
from llmtune.data.packing import pack_rows
from llmtune.data.tokenize import SFTTokenizer
from llmtune.models.tiny import make_tiny_llama

X = -100


def test_pack_rows_exact():
    rows = [([1, 2, 3], [X, 2, 3]), ([4, 5, 6, 7, 8], [4, 5, 6, 7, 8]), ([9, 10], [X, 10]), ([11, 12, 13, 14], [X, X, 13, 14])]
    packed = pack_rows(rows, max_length=8)
    # best-fit decreasing: [5 tokens] + [3 tokens]; [4 tokens] + [2 tokens]; rows keep file order inside
    assert packed == [
        {"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "labels": [X, 2, 3, X, 5, 6, 7, 8], "position_ids": [0, 1, 2, 0, 1, 2, 3, 4]},
        {"input_ids": [9, 10, 11, 12, 13, 14], "labels": [X, 10, X, X, 13, 14], "position_ids": [0, 1, 0, 1, 2, 3]},
    ]
    with pytest.raises(ValueError, match="does not fit"):
        pack_rows([([1] * 9, [1] * 9)], max_length=8)


def test_build_with_packing(tok, write, cfg):
    path = write("t.jsonl", [{"text": f"apples {i}"} for i in range(12)])
    plain = build_sft_data(cfg(path, max_length=16), tok)
    packed = build_sft_data(cfg(path, max_length=16, packing=True), tok)
    assert packed.report.train_rows == 12 and packed.report.train_sequences == len(packed.train) < 12
    assert packed.report.tokens == plain.report.tokens
    rows = {tuple(r["input_ids"]): r["labels"] for r in plain.train}
    for seq in packed.train:
        assert len(seq["input_ids"]) <= 16
        starts = [i for i, p in enumerate(seq["position_ids"]) if p == 0]
        for s, e in zip(starts, starts[1:] + [len(seq["input_ids"])]):
            ids = tuple(seq["input_ids"][s:e])
            assert seq["labels"][s] == X and seq["labels"][s + 1 : e] == rows[ids][1:]
            assert seq["position_ids"][s:e] == list(range(e - s))
    # the only trained labels lost are those at position 0, which a causal LM never predicts
    assert packed.report.trained_tokens == plain.report.trained_tokens - 12


def _chat_rows(tok):
    fn = SFTTokenizer(tok, 128)
    convos = [
        [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "I am fine."}],
        [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "It is 5."}],
        [{"role": "user", "content": "Write a poem about the sea."}, {"role": "assistant", "content": "The sea is wide."}],
    ]
    return [fn({"messages": m}) for m in convos]


@torch.no_grad()
def test_packed_logits_equal_single_row_logits(tok):
    model = make_tiny_llama(tok).eval()
    rows = _chat_rows(tok)
    packed = pack_rows([(r.input_ids, r.labels) for r in rows], max_length=128)
    assert len(packed) == 1
    batch = SFTCollator(tok)(packed)
    assert "attention_mask" not in batch  # a 2-D mask would switch off packed-sequence detection
    logits = model(**{k: batch[k] for k in ("input_ids", "position_ids")}, use_cache=False).logits  # (1, T, V)
    starts = [i for i, p in enumerate(packed[0]["position_ids"]) if p == 0]
    assert len(starts) == 3  # rows keep their order inside the packed sequence
    for k, s in enumerate(starts):
        ids = torch.tensor([rows[k].input_ids])
        alone = model(input_ids=ids, use_cache=False).logits  # (1, T_k, V)
        torch.testing.assert_close(logits[:, s : s + ids.shape[1]], alone, atol=1e-5, rtol=0)
    # Control: with an all-ones attention mask the rows attend to each other and the logits differ.
    mixed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                  attention_mask=torch.ones_like(batch["input_ids"]), use_cache=False).logits
    assert not torch.allclose(mixed[:, starts[1]:], logits[:, starts[1]:], atol=1e-3)


@torch.no_grad()
def test_padded_packed_batch_logits_equal_single_rows(tok):
    model = make_tiny_llama(tok).eval()
    rows = _chat_rows(tok)
    seqs = [pack_rows([(r.input_ids, r.labels) for r in rows[:2]], 128)[0], pack_rows([(rows[2].input_ids, rows[2].labels)], 128)[0]]
    batch = SFTCollator(tok, pad_to_multiple_of=8)(seqs)
    B, T = batch["input_ids"].shape
    assert B == 2 and T % 8 == 0 and T >= len(seqs[0]["input_ids"])
    n1 = len(seqs[1]["input_ids"])
    assert batch["labels"][1, n1:].eq(X).all() and batch["position_ids"][1, n1:].tolist() == list(range(n1, n1 + T - n1))
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    alone = model(input_ids=torch.tensor([rows[2].input_ids]), use_cache=False).logits
    torch.testing.assert_close(logits[1:, :n1], alone, atol=1e-5, rtol=0)
    n0 = len(rows[0].input_ids)
    alone0 = model(input_ids=torch.tensor([rows[0].input_ids]), use_cache=False).logits
    alone1 = model(input_ids=torch.tensor([rows[1].input_ids]), use_cache=False).logits
    torch.testing.assert_close(logits[:1, :n0], alone0, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits[:1, n0 : n0 + len(rows[1].input_ids)], alone1, atol=1e-5, rtol=0)


def test_collator_unpacked_batch_and_errors(tok):
    batch = SFTCollator(tok, pad_to_multiple_of=4)([
        {"input_ids": [5, 6, 7], "labels": [X, 6, 7]},
        {"input_ids": torch.tensor([8, 9]), "labels": torch.tensor([X, 9])},
    ])
    assert batch["input_ids"].tolist() == [[5, 6, 7, 1], [8, 9, 1, 1]]
    assert batch["labels"].tolist() == [[X, 6, 7, X], [X, 9, X, X]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0]]
    assert set(batch) == {"input_ids", "labels", "attention_mask"} and batch["input_ids"].dtype == torch.long
    with pytest.raises(ValueError, match="mixes packed rows"):
        SFTCollator(tok)([{"input_ids": [1], "labels": [1], "position_ids": [0]}, {"input_ids": [1], "labels": [1]}])
    with pytest.raises(ValueError, match="2 input_ids but 1 labels"):
        SFTCollator(tok)([{"input_ids": [1, 2], "labels": [1]}])


def _list_plan(lengths, max_length):
    """Best-fit decreasing as the list implementation did it (the reference for the array one)."""
    from bisect import bisect_left, insort

    order = sorted(range(len(lengths)), key=lambda k: (-lengths[k], k))
    bins, free = [], []
    for k in order:
        n = lengths[k]
        j = bisect_left(free, (n, -1))
        if j < len(free):
            room, b = free.pop(j)
            bins[b].append(k)
        else:
            room, b = max_length, len(bins)
            bins.append([k])
        if room - n > 0:
            insort(free, (room - n, b))
    return [sorted(members) for members in bins]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pack_plan_is_best_fit_decreasing(seed):
    import random

    from llmtune.data.packing import pack_plan

    rng = random.Random(seed)
    lengths = [rng.choice([rng.randrange(1, 9), rng.randrange(1, 64), 64]) for _ in range(500)]
    plan = pack_plan(lengths, 64)
    assert [b.tolist() for b in plan] == _list_plan(lengths, 64)
    assert sorted(k for b in plan for k in b.tolist()) == list(range(500))  # every row once
    assert all(sum(lengths[k] for k in b.tolist()) <= 64 for b in plan)
