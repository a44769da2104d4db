"""Fixtures for llmtune.models tests: offline hub, tiny saved models, a fixed batch."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported anywhere: nothing is downloaded

import pytest
import torch

from llmtune.models.tiny import save_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A 2-layer random Llama (hidden 32, untied head) + chatml tokenizer saved as a local HF directory."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture()
def cache_dir(tmp_path, monkeypatch):
    """An empty llmtune conversion cache; $LLMTUNE_CACHE points elsewhere so cfg.cache_dir must win."""
    monkeypatch.setenv("LLMTUNE_CACHE", str(tmp_path / "env-cache"))
    return tmp_path / "cache"


@pytest.fixture()
def batch():
    """(B=2, T=12) input_ids with labels; ids < 400 fit the tiny vocabulary."""
    gen = torch.Generator().manual_seed(1)
    input_ids = torch.randint(10, 390, (2, 12), generator=gen)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}
