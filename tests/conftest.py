"""Test-wide setup: nothing is downloaded, seeds are fixed, global torch state is restored.

Autouse fixture for every test: ``HF_HUB_OFFLINE=1`` (also set at import, before huggingface_hub reads
it), Python/NumPy/torch seeded with 0, the torch default dtype restored afterwards, and a
``torch.distributed`` process group left behind by a test destroyed.
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported anywhere: nothing is downloaded
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warnings from datasets.map workers

import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _isolated_state(monkeypatch):
    """Offline hub, seeds fixed at 0, default dtype and process groups restored after the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
