"""load_model / load_tokenizer on the tiny Llama: dtype rules, attention kernel, bitsandbytes 4/8 bit on CPU."""

from __future__ import annotations

import pytest
import torch

from llmtune.config import ModelConfig, PrecisionConfig
from llmtune.models import ModelLoadError, load_model, load_tokenizer, resolve_dtype
from llmtune.models.load import build_quantization_config, resolve_compute_dtype
from llmtune.models.tiny import make_tiny_tokenizer

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    ("dtype", "bf16", "fp16", "expected"),
    [
        ("auto", False, False, FP32),
        ("auto", True, False, BF16),
        ("auto", False, True, FP16),
        ("fp32", True, False, FP32),  # explicit wins over precision
        ("fp16", False, False, FP16),
        ("bf16", False, True, BF16),
    ],
)
def test_dtype_rule(dtype, bf16, fp16, expected):
    assert resolve_dtype(ModelConfig(dtype=dtype), PrecisionConfig(bf16=bf16, fp16=fp16)) == expected


@pytest.mark.parametrize(
    ("dtype", "bf16", "expected"), [("auto", True, BF16), ("fp16", False, FP16), ("auto", False, FP32)]
)
def test_loaded_weights_have_the_resolved_dtype(tiny_dir, dtype, bf16, expected):
    model = load_model(ModelConfig(name_or_path=str(tiny_dir), dtype=dtype), PrecisionConfig(bf16=bf16))
    assert {p.dtype for p in model.parameters()} == {expected}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_implementation_reaches_the_model(tiny_dir, attn):
    model = load_model(ModelConfig(name_or_path=str(tiny_dir), attn_implementation=attn), PrecisionConfig())
    assert model.config._attn_implementation == attn


def test_missing_attention_kernel_is_a_clear_error(tiny_dir):
    pytest.importorskip("transformers")
    try:
        import flash_attn  # noqa: F401

        pytest.skip("flash-attn is installed here")
    except ImportError:
        pass
    cfg = ModelConfig(name_or_path=str(tiny_dir), attn_implementation="flash_attention_2")
    with pytest.raises(ModelLoadError, match=r"attn_implementation=.flash_attention_2.*try auto, sdpa or eager"):
        load_model(cfg, PrecisionConfig())


def test_tokenizer_gets_eos_as_pad_and_right_padding(tmp_path):
    tok = make_tiny_tokenizer(pad_equals_eos=True)
    tok.pad_token = None
    tok.padding_side = "left"
    tok.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")  # resolve_model_source wants an HF model dir
    loaded = load_tokenizer(ModelConfig(name_or_path=str(tmp_path)))
    assert loaded.pad_token == "<|im_end|>" and loaded.pad_token_id == loaded.eos_token_id
    assert loaded.padding_side == "right"
    assert loaded.chat_template  # kept


def test_tokenizer_keeps_its_own_pad(tmp_path):
    make_tiny_tokenizer(pad_equals_eos=False).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    loaded = load_tokenizer(ModelConfig(name_or_path=str(tmp_path)))
    assert loaded.pad_token == "<pad>" and loaded.pad_token_id != loaded.eos_token_id


# ------------------------------------------------------------------ bitsandbytes


@pytest.mark.parametrize(
    ("kw", "bf16", "compute"),
    [({}, False, FP32), ({}, True, BF16), ({"bnb_4bit_compute_dtype": "fp16"}, True, FP16)],
)
def test_4bit_config(kw, bf16, compute):
    pytest.importorskip("bitsandbytes")
    cfg = ModelConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=False, **kw)
    q = build_quantization_config(cfg, PrecisionConfig(bf16=bf16))
    assert q.load_in_4bit and not q.load_in_8bit
    assert q.bnb_4bit_quant_type == "fp4" and q.bnb_4bit_use_double_quant is False
    assert q.bnb_4bit_compute_dtype == compute == resolve_compute_dtype(cfg, PrecisionConfig(bf16=bf16))


def test_4bit_and_8bit_together_is_an_error(tiny_dir):
    cfg = ModelConfig(name_or_path=str(tiny_dir), load_in_4bit=True, load_in_8bit=True)
    with pytest.raises(ModelLoadError, match="both true"):
        load_model(cfg, PrecisionConfig())


@pytest.mark.parametrize(("quant_type", "double"), [("nf4", True), ("fp4", False)])
def test_4bit_load_on_cpu(tiny_dir, batch, quant_type, double):
    pytest.importorskip("bitsandbytes")
    cfg = ModelConfig(
        name_or_path=str(tiny_dir), load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double
    )
    model = load_model(cfg, PrecisionConfig())
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "Linear4bit"
    assert q_proj.weight.quant_state.quant_type == quant_type
    assert (q_proj.weight.quant_state.state2 is not None) == double  # nested (double) quantization state
    assert type(model.lm_head).__name__ == "Linear"  # the output head stays in full precision
    out = model(**batch)
    assert torch.isfinite(out.loss)


def test_8bit_load_and_forward_on_cpu(tiny_dir, batch):
    """bitsandbytes >= 0.48 runs LLM.int8 on CPU (inputs are cast to fp16 for the int8 quantization)."""
    pytest.importorskip("bitsandbytes")
    model = load_model(ModelConfig(name_or_path=str(tiny_dir), load_in_8bit=True), PrecisionConfig())
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Linear8bitLt"
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, 12, model.config.vocab_size) and torch.isfinite(logits).all()


def test_score_head_load_prints_no_load_report_and_warns_only_for_really_missing_weights(tmp_path, capfd, caplog):
    """A one-score model from a causal LM checkpoint always lacks score.weight (a trained RM restores it from its
    adapter): transformers' LOAD REPORT table (raw ANSI codes, "score.weight | MISSING") is not printed; a weight
    that is really missing is named in a plain warning."""
    import logging

    from safetensors.torch import load_file, save_file

    from llmtune.models.tiny import save_tiny_model

    base = save_tiny_model(tmp_path / "base")
    capfd.readouterr()
    with caplog.at_level(logging.DEBUG):
        load_model(ModelConfig(name_or_path=str(base)), PrecisionConfig(), head="score")
    captured = capfd.readouterr()
    text = captured.out + captured.err + caplog.text
    assert "LOAD REPORT" not in text and "\x1b[" not in text and "MISSING" not in text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    weights = load_file(str(base / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(base / "model.safetensors"), metadata={"format": "pt"})
    caplog.clear()
    with caplog.at_level(logging.INFO):
        load_model(ModelConfig(name_or_path=str(base)), PrecisionConfig(), head="score")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].endswith("initialised at random: model.norm.weight")
