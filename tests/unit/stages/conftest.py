"""Fixtures for stage tests: hand-built preference pairs and a collator with the data layer's batch layout.

``collate_pairs`` builds what ``llmtune.data.PreferenceCollator`` returns (rows 0..B-1 chosen, B..2B-1 rejected,
right-padded, labels -100 on prompt and padding), so the stages' losses are tested on batches built by hand.
"""

from __future__ import annotations

import pytest
import torch

from llmtune.models.tiny import make_tiny_tokenizer


def make_pairs(n: int = 6, vocab: int = 300, seed: int = 0) -> list[dict]:
    """``n`` pairs with an identical prompt prefix, prompt/completion lengths varying per pair."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        prompt = torch.randint(10, vocab, (3 + i % 4,), generator=g).tolist()
        chosen = torch.randint(10, vocab, (2 + i % 3,), generator=g).tolist()
        rejected = torch.randint(10, vocab, (4 + (i * 2) % 5,), generator=g).tolist()
        rows.append({
            "chosen_input_ids": prompt + chosen, "chosen_labels": [-100] * len(prompt) + chosen,
            "rejected_input_ids": prompt + rejected, "rejected_labels": [-100] * len(prompt) + rejected,
            "prompt_length": len(prompt),
        })
    return rows


def collate_pairs(rows: list[dict], pad_id: int = 1) -> dict[str, torch.Tensor]:
    """(2B, T) input_ids / attention_mask / labels: chosen rows, then rejected rows, right-padded."""
    seqs = [(r["chosen_input_ids"], r["chosen_labels"]) for r in rows]
    seqs += [(r["rejected_input_ids"], r["rejected_labels"]) for r in rows]
    T = max(len(ids) for ids, _ in seqs)
    input_ids = torch.full((len(seqs), T), pad_id)
    labels = torch.full((len(seqs), T), -100)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for b, (ids, lab) in enumerate(seqs):
        input_ids[b, : len(ids)], labels[b, : len(ids)], mask[b, : len(ids)] = torch.tensor(ids), torch.tensor(lab), 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


@pytest.fixture()
def tokenizer():
    return make_tiny_tokenizer()


@pytest.fixture()
def pairs():
    """``pairs(n, seed=0)``: see :func:`make_pairs`."""
    return make_pairs


@pytest.fixture()
def collate():
    """``collate(rows)``: see :func:`collate_pairs`."""
    return collate_pairs
