"""GGUF export (``llmtune export RUN --gguf TYPE``) on tiny models of each supported family, checked in llama.cpp.

Each family: a tiny model of transformers' own class, taught to answer the chat checks and to END its replies
(tests/unit/export/gguf_families.py), converted by llama.cpp's converter, run by llama.cpp (llama-cpp-python):
tokenization equal to the HF tokenizer's, chat prompt ids equal to ``apply_chat_template``'s, the reply and where it
stops equal, f16 logits within tolerance and greedy generations equal. Then: quantized types against f16, a broken
quantization caught, and the refusals (unknown pre-tokenizer, architecture, template Ollama cannot express).
Skipped only when llama-cpp-python is absent (``scripts/setup.sh`` installs it, so CI runs them).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from llmtune.export import modelfile as mf
from llmtune.models.tiny import make_tiny_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from gguf_families import save_merged  # noqa: E402

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (bash scripts/setup.sh)")

from llmtune.export.gguf_export import export_gguf  # noqa: E402
from llmtune.export.llamacpp import GGUFExportError, pretokenizer_by_structure  # noqa: E402


def _assert_float_entry(entry: dict) -> None:
    assert entry["tokenizer"]["mismatches"] == [] and entry["tokenizer"]["chat_template_embedded"]
    assert all(entry["tokenizer"]["stop_tokens_end_generation"].values())
    chats = entry["chat"]["conversations"]
    assert all(c["prompt_ids_equal"] for c in chats)
    assert all(c["reply_equal"] and c["stopped_alike"] for c in chats) and entry["chat"]["replies_alike"]
    assert sum(c["finish_reason"] == "stop" for c in chats) >= 2  # the taught replies end at <|im_end|> in llama.cpp
    assert entry["logits"]["max_abs_diff"] <= entry["logits"]["tolerance"]
    assert all(g["match"] for g in entry["generations"])
    assert entry["passed"]


ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM",
        "gemma3": "Gemma3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmo2": "Olmo2ForCausalLM"}


@pytest.mark.parametrize("family", list(ARCH))
def test_family_f16_matches_merged_model(tmp_path, family):
    merged = save_merged(tmp_path / "merged", family)
    report = export_gguf(merged, "f16", out_dir=tmp_path / "gguf")
    assert report["architecture"] == ARCH[family]
    assert report["pre_tokenizer"] == "gpt-2" and report["pre_tokenizer_source"] == "structure"
    _assert_float_entry(report["types"]["f16"])
    assert report["passed"] and report["modelfile"]["passed"]
    assert json.loads((tmp_path / "gguf" / "verification.json").read_text())["passed"]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """A hidden-256 Llama (rows of 256: real k-quant blocks) exported as f16, q8_0 and q4_k_m."""
    root = tmp_path_factory.mktemp("gguf-quant")
    merged = save_merged(root / "merged", "llama", hidden=256, steps=120)
    return root, export_gguf(merged, "q4_k_m,q8_0,f16", out_dir=root / "gguf")


def test_quantized_types_verified_against_f16(quantized):
    root, report = quantized
    assert report["passed"], json.dumps(report, indent=1)[:3000]
    sizes = {t: e["bytes"] for t, e in report["types"].items()}
    assert sizes["q4_k_m"] < sizes["q8_0"] < sizes["f16"]
    for t in ("q8_0", "q4_k_m"):
        q = report["types"][t]["quantization"]
        assert q["top1_agreement_vs_f16"] >= q["limits"]["top1"] and q["perplexity_ratio"] <= q["limits"]["ppl_ratio"]
        assert all(c["prompt_ids_equal"] for c in report["types"][t]["chat"]["conversations"])
    assert report["types"]["q8_0"]["quantization"]["mean_kl_vs_f16"] < report["types"]["q4_k_m"]["quantization"][
        "mean_kl_vs_f16"]
    assert sorted(p.name for p in (root / "gguf").iterdir()) == [
        "Modelfile", "model-f16.gguf", "model-q4_k_m.gguf", "model-q8_0.gguf", "verification.json"]


def test_modelfile_renders_the_hf_template_and_stops_at_eos(quantized):
    root, report = quantized
    spec = mf.parse_modelfile((root / "gguf" / "Modelfile").read_text())
    assert spec["from"] == "./model-q4_k_m.gguf"  # the first type asked for
    assert [v for k, v in spec["parameters"] if k == "stop"] == ["<|im_end|>"]
    tok = make_tiny_tokenizer()
    for conv in mf.check_conversations():
        gen = conv[-1]["role"] != "assistant"
        text = mf.render_go_template(spec["template"], {"Messages": [{"Role": m["role"], "Content": m["content"]}
                                                                     for m in conv]})
        assert text == tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
    assert report["modelfile"]["passed"] and report["modelfile"]["stop_equals_stop_tokens"]


def test_broken_quantization_is_caught(tmp_path, monkeypatch, capsys):
    """A quantizer that writes garbage (here: one in four q4_k_m blocks of every weight scrambled) fails the check."""
    import numpy as np
    from gguf import GGUFReader

    from llmtune.export import gguf_export, llamacpp

    def broken(src, dst, qtype, threads=None):
        seconds = llamacpp.quantize(src, dst, qtype, threads)
        reader = GGUFReader(dst, "r+")
        rng = np.random.default_rng(0)
        for tensor in reader.tensors:
            if tensor.name.startswith("blk.") and tensor.name.endswith(".weight") and tensor.data.ndim == 2:
                data = tensor.data.view(np.uint8).reshape(-1)
                data[::4] = rng.integers(0, 256, size=data[::4].shape, dtype=np.uint8)
        reader.data.flush()
        return seconds

    merged = save_merged(tmp_path / "merged", "llama", hidden=256, steps=120)
    monkeypatch.setattr(gguf_export, "quantize", broken)
    report = export_gguf(merged, "q4_k_m", out_dir=tmp_path / "gguf")
    q = report["types"]["q4_k_m"]["quantization"]
    assert not report["passed"] and not report["types"]["q4_k_m"]["passed"]
    assert q["top1_agreement_vs_f16"] < q["limits"]["top1"] or q["perplexity_ratio"] > q["limits"]["ppl_ratio"]
    assert not json.loads((tmp_path / "gguf" / "verification.json").read_text())["passed"]


def test_smollm_style_pretokenizer_named_by_structure(tmp_path):
    """SmolLM2's hub tokenizer splits digits one by one before byte-level BPE: llama.cpp's 'smollm'."""
    from tokenizers import pre_tokenizers

    tok = make_tiny_tokenizer(corpus=["1234567 3333 33 12345678 2024 1999"])
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    merged = save_merged(tmp_path / "merged", "llama", tokenizer=tok, steps=0)
    assert pretokenizer_by_structure(merged) == "smollm"
    report = export_gguf(merged, "f16", out_dir=tmp_path / "gguf", modelfile=False)
    assert report["pre_tokenizer"] == "smollm"
    assert report["types"]["f16"]["tokenizer"]["mismatches"] == []


def test_unknown_pretokenizer_is_refused(tmp_path):
    from tokenizers import pre_tokenizers

    tok = make_tiny_tokenizer()
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    merged = save_merged(tmp_path / "merged", "llama", tokenizer=tok, steps=0)
    with pytest.raises(GGUFExportError, match="does not know this tokenizer's pre-tokenizer.*WhitespaceSplit"):
        export_gguf(merged, "f16", out_dir=tmp_path / "gguf", modelfile=False)
    assert not list((tmp_path / "gguf").glob("model-*.gguf"))


QWEN3_LIKE = (  # the last assistant turn rendered differently from earlier ones (Qwen3 does so with its think block)
    "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\n' + message['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% if message['role'] == 'assistant' and loop.last %}{{ '<|im_start|>note\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_template_ollama_cannot_express_is_refused_before_converting(tmp_path):
    tok = make_tiny_tokenizer()
    tok.chat_template = QWEN3_LIKE
    merged = save_merged(tmp_path / "merged", "llama", tokenizer=tok, steps=0)
    with pytest.raises(GGUFExportError, match="cannot be written as an Ollama Modelfile TEMPLATE.*--no-modelfile"):
        export_gguf(merged, "f16", out_dir=tmp_path / "gguf")
    assert not (tmp_path / "gguf").exists()  # refused before any conversion


def test_unsupported_architecture_is_one_clear_error(tmp_path):
    merged = save_merged(tmp_path / "merged", "llama", steps=0)
    config = json.loads((merged / "config.json").read_text())
    (merged / "config.json").write_text(json.dumps({**config, "architectures": ["TinyNovelForCausalLM"]}))
    with pytest.raises(GGUFExportError, match="cannot convert architecture TinyNovelForCausalLM.*Qwen3.*Gemma 3"):
        export_gguf(merged, "f16", out_dir=tmp_path / "gguf")


def test_cli_export_gguf_errors_and_exit_codes(tmp_path, capsys):
    from llmtune.commands.cli import main

    merged = save_merged(tmp_path / "merged", "llama", steps=0)
    assert main(["export", str(merged), "--gguf", "q9_x"]) == 1
    assert "error: unknown GGUF type(s) q9_x" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), "--gguf", "f16"]) == 1
    assert "holds no merged model" in capsys.readouterr().err


def test_pipeline_export_step_writes_and_then_skips_gguf(tmp_path):
    """pipeline.export.gguf: the merged model in <dir>/merged -> <dir>/gguf, verified; a rerun skips it."""
    import yaml
    from rich.console import Console

    from llmtune.pipeline.run import _run_gguf
    from llmtune.pipeline.spec import load_pipeline

    spec = {"pipeline": {"dir": str(tmp_path / "p"), "stages": [{"name": "c", "stage": "sft"}],
                         "export": {"gguf": ["f16"]}}}
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(spec))
    pipe = load_pipeline(tmp_path / "p.yaml", base_dir=tmp_path)
    save_merged(pipe.dir / "merged", "llama", steps=0)
    row = _run_gguf(pipe, Console(quiet=True), {"name": "export"})
    assert row["gguf"] == ["f16"] and (pipe.dir / "gguf" / "model-f16.gguf").is_file()
    assert (pipe.dir / "gguf" / "Modelfile").is_file()
    mtime = (pipe.dir / "gguf" / "verification.json").stat().st_mtime
    assert _run_gguf(pipe, Console(quiet=True), {"name": "export"})["gguf"] == ["f16"]
    assert (pipe.dir / "gguf" / "verification.json").stat().st_mtime == mtime  # skipped


def test_sentencepiece_gemma3_converts_from_the_base_tokenizer_model(tmp_path):
    """A SentencePiece vocabulary (Gemma 3's kind): transformers 5 saves tokenizer.json only, llama.cpp converts such a
    vocabulary from tokenizer.model; export takes the base's (lineage.json) and tells llama.cpp which added tokens are
    special. Without it the export is refused, naming tokenizer.model."""
    from gguf_families import make_tiny_spm_tokenizer
    from test_modelfile import GEMMA3

    tok = make_tiny_spm_tokenizer(tmp_path / "base", GEMMA3)
    run = tmp_path / "run"
    merged = save_merged(run / "merged", "gemma3", tokenizer=tok, steps=100)
    assert not (merged / "tokenizer.model").exists()
    with pytest.raises(GGUFExportError, match="tokenizer.model"):
        export_gguf(run, "f16", out_dir=tmp_path / "refused", modelfile=False)
    (run / "lineage.json").write_text(json.dumps({"base_model": {"path": str(tmp_path / "base")}}))
    later = (run / "lineage.json").stat().st_mtime + 10  # the merged model is newer than the run: no re-export
    os.utime(merged / "verification.json", (later, later))
    report = export_gguf(run, "f16", out_dir=tmp_path / "gguf")
    assert report["sentencepiece_model"] == str(tmp_path / "base" / "tokenizer.model")
    entry = report["types"]["f16"]
    assert entry["tokenizer"]["stop_tokens_end_generation"] == {"</s>": True, "<end_of_turn>": True}
    _assert_float_entry(entry)
    assert report["passed"] and report["modelfile"]["passed"]
    assert not (tmp_path / "gguf" / ".convert-source").exists()
