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
# Tokenized data is cached per test (fixture below); builds outside a test (module fixtures, subprocesses) go to a
# directory of this session, never to the user's ~/.cache/llmtune/data.
import atexit
import shutil
import tempfile

_SESSION_DATA_CACHE = tempfile.mkdtemp(prefix="llmtune-test-data-cache-")
atexit.register(shutil.rmtree, _SESSION_DATA_CACHE, True)
os.environ["LLMTUNE_DATA_CACHE"] = _SESSION_DATA_CACHE

import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _isolated_state(monkeypatch, tmp_path_factory):
    """Offline hub, seeds fixed at 0, default dtype and process groups restored after the test; a data cache of the
    test's own (``LLMTUNE_DATA_CACHE``: a build is reused within a test, never across tests)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("LLMTUNE_DATA_CACHE", str(tmp_path_factory.mktemp("data-cache")))
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
