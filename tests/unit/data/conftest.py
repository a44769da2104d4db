"""Fixtures for llmtune.data tests: tiny offline tokenizers and writers for small data files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmtune.config.schema import DataConfig, DatasetConfig
from llmtune.models.tiny import make_tiny_tokenizer

ASSETS = Path(__file__).resolve().parents[2] / "assets"


@pytest.fixture()
def tok():
    """ChatML tiny tokenizer: BOS <|im_start|> (0), EOS = pad = <|im_end|> (1), no BOS added by itself."""
    return make_tiny_tokenizer()


@pytest.fixture()
def assets() -> Path:
    return ASSETS


@pytest.fixture()
def write(tmp_path):
    """``write(name, rows)``: a .json (array) or .jsonl file of rows in tmp_path; returns its path."""

    def _write(name: str, rows: list) -> Path:
        path = tmp_path / name
        if name.endswith(".jsonl"):
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            path.write_text(json.dumps(rows, indent=1))
        return path

    return _write


def data_cfg(*sources, **kwargs) -> DataConfig:
    """A DataConfig from source dicts (or bare paths) and data-level keyword arguments."""
    datasets = [DatasetConfig(**s) if isinstance(s, dict) else DatasetConfig(path=str(s)) for s in sources]
    return DataConfig(datasets=datasets, **kwargs)


@pytest.fixture()
def cfg():
    return data_cfg
