"""llama.cpp as llmtune uses it: its converter (``convert_hf_to_gguf.py``), its quantizer and its Python bindings.

Everything that turns a merged Hugging Face model into GGUF is llama.cpp's own code, of ONE version:

- the library, through llama-cpp-python (``llama_cpp``; ``scripts/setup.sh`` builds it from PyPI's sdist once and
  caches the wheel): quantization (``llama_model_quantize``) and, in :mod:`~llmtune.export.gguf_verify`, loading,
  tokenizing and running the GGUF;
- the converter shipped in the same sdist (``vendor/llama.cpp/convert_hf_to_gguf.py`` with its ``conversion/``
  package and its own ``gguf-py``), unpacked by setup into ``<venv>/share/llama.cpp`` (or ``$LLMTUNE_LLAMA_CPP_DIR``,
  a llama.cpp checkout). The converter runs in a subprocess (:mod:`~llmtune.export.llamacpp_convert`) with its own
  ``gguf-py``: that copy is newer than PyPI's ``gguf`` of the same version number (0.19.0: ~2,000 lines of
  architecture constants more), which stays what transformers reads GGUF inputs with.

Pre-tokenizers: the converter names the pre-tokenizer of a BPE vocabulary by hashing the token ids of a probe text,
so it knows only the exact vocabularies of models it was updated for; a fine-tuned model whose vocabulary differs
(added tokens that occur in the probe text), llmtune's builtin (its tokenizer rebuilt from a GGUF by transformers) or
a tiny test tokenizer are unknown to it. When the hash is unknown, :func:`pretokenizer_by_structure` names the
llama.cpp pre-tokenizer from the ``pre_tokenizer`` of ``tokenizer.json`` (the same splitting rules, whatever the
vocabulary); verification then checks that llama.cpp tokenizes test strings exactly as the HF tokenizer does.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

from llmtune.errors import LlmtuneError
from llmtune.utils import get_logger

log = get_logger("export")

CONVERTER_ENV = "LLMTUNE_LLAMA_CPP_DIR"  # a directory holding convert_hf_to_gguf.py, conversion/ and gguf-py/
VERSION_FILE = "LLAMA_CPP_PYTHON_VERSION"  # written by scripts/setup.sh next to the unpacked converter

# GGUF types llmtune writes: the converter writes the float types, llama.cpp's quantizer the others (from f16).
FLOAT_TYPES = ("f32", "f16", "bf16")
QUANT_TYPES = ("q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")
GGUF_TYPES = FLOAT_TYPES + QUANT_TYPES
_FTYPE_NAMES = {"q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K",
                "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
                "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}

# The families llmtune exports and tests (tests/unit/export/test_gguf_export.py, on tiny configs of transformers' classes).
# llama.cpp's converter knows many more architectures; those convert too and are verified the same way.
TESTED_ARCHITECTURES = {
    "LlamaForCausalLM": "Llama", "Qwen3ForCausalLM": "Qwen3", "MistralForCausalLM": "Mistral",
    "Gemma3ForCausalLM": "Gemma 3", "Qwen3MoeForCausalLM": "Qwen3-MoE", "Olmo2ForCausalLM": "OLMo 2",
}

# Byte-level BPE pre-tokenizers llama.cpp implements, as tokenizer.json writes them (``trim_offsets`` does not
# change the split). Regexes as in the models' own tokenizer.json (Llama 3, Qwen2/Qwen3).
_LLAMA3_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_RE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
             r"\s*[\r\n]+|\s+(?!\S)|\s+")
_BYTELEVEL_REGEX = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
_BYTELEVEL_PLAIN = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}


def _split(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


KNOWN_PRETOKENIZERS = {  # llama.cpp name -> (pre_tokenizer of tokenizer.json, normalizers allowed)
    "gpt-2": (_BYTELEVEL_REGEX, (None,)),
    "smollm": ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                                      _BYTELEVEL_REGEX]}, (None,)),
    "llama-bpe": ({"type": "Sequence", "pretokenizers": [_split(_LLAMA3_RE), _BYTELEVEL_PLAIN]}, (None,)),
    "qwen2": ({"type": "Sequence", "pretokenizers": [_split(_QWEN2_RE), _BYTELEVEL_PLAIN]}, (None, "NFC")),
}


class GGUFExportError(LlmtuneError, RuntimeError):
    """A GGUF cannot be written (llama.cpp missing, unsupported architecture or tokenizer, conversion failed) or it
    failed its verification."""


# ---- finding llama.cpp ---------------------------------------------------------------------------------------

def _setup_hint() -> str:
    return ("run `bash scripts/setup.sh` (it builds llama-cpp-python from PyPI's sdist once, a few minutes on 2 "
            "cores, caches the wheel and unpacks the converter into the venv)")


def llama_cpp_module():
    """The imported ``llama_cpp`` bindings.

    Raises:
        GGUFExportError: llama-cpp-python is not installed (says how to install it).
    """
    try:
        import llama_cpp
    except ImportError as err:
        raise GGUFExportError(f"GGUF export needs llama.cpp's Python bindings (llama-cpp-python), which do not "
                              f"import here ({err}); {_setup_hint()}") from None
    return llama_cpp


def converter_dir() -> Path:
    """The directory of llama.cpp's ``convert_hf_to_gguf.py``: ``$LLMTUNE_LLAMA_CPP_DIR``, else
    ``<venv>/share/llama.cpp`` (unpacked by ``scripts/setup.sh`` from the sdist the bindings were built from).

    Raises:
        GGUFExportError: no converter there (names the directories looked in and how to fix it).
    """
    env = os.environ.get(CONVERTER_ENV)
    where = Path(env) if env else Path(sys.prefix) / "share" / "llama.cpp"
    if not (where / "convert_hf_to_gguf.py").is_file() or not (where / "conversion").is_dir():
        raise GGUFExportError(
            f"llama.cpp's converter (convert_hf_to_gguf.py with its conversion/ package) is not in {where} "
            f"({'from $' + CONVERTER_ENV if env else 'set $' + CONVERTER_ENV + ' to a llama.cpp checkout, or'}) "
            f"{_setup_hint()}")
    return where


def versions() -> dict:
    """Versions of what writes and reads the GGUF: ``llama_cpp_python``, ``converter`` (the sdist version the
    converter was unpacked from, or ``unknown`` for a checkout) and ``converter_dir``."""
    where = converter_dir()
    stamp = where / VERSION_FILE
    return {"llama_cpp_python": getattr(llama_cpp_module(), "__version__", "unknown"),
            "converter": stamp.read_text().strip() if stamp.is_file() else "unknown", "converter_dir": str(where)}


def check_versions(found: dict) -> None:
    """Warn when the converter and the library come from different llama.cpp versions (a newer converter may
    write metadata an older library cannot read)."""
    if found["converter"] not in ("unknown", found["llama_cpp_python"]):
        log.warning("llama.cpp's converter (%s, %s) and the llama-cpp-python library (%s) differ; rerun "
                    "scripts/setup.sh to unpack the matching converter", found["converter"], found["converter_dir"],
                    found["llama_cpp_python"])


# ---- what can be converted -----------------------------------------------------------------------------------

def converter_architectures(where: Path) -> set[str]:
    """The HF architectures llama.cpp's converter has a class for (read from ``conversion/__init__.py``'s
    ``TEXT_MODEL_MAP`` without importing it: the converter imports torch and its own gguf-py)."""
    import ast

    tree = ast.parse((where / "conversion" / "__init__.py").read_text())
    for node in ast.walk(tree):
        target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(
            node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "TEXT_MODEL_MAP" and isinstance(node.value, ast.Dict):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return set()  # an older converter without the map: let it decide


def check_architecture(model_dir: Path, where: Path) -> str:
    """The model's architecture, when llama.cpp can convert it.

    Raises:
        GGUFExportError: an architecture the converter has no class for (names the tested families).
    """
    config = json.loads((model_dir / "config.json").read_text())
    arch = (config.get("architectures") or ["?"])[0]
    known = converter_architectures(where)
    if known and arch not in known:
        tested = ", ".join(f"{name} ({a})" for a, name in TESTED_ARCHITECTURES.items())
        raise GGUFExportError(
            f"{model_dir}: llama.cpp's converter ({where}) cannot convert architecture {arch}; GGUF export supports "
            f"the architectures llama.cpp converts ({len(known)}, among them the families llmtune tests: {tested}). "
            "Use the merged safetensors model with transformers or vLLM instead.")
    return arch


def _canonical(node):
    """A pre-tokenizer JSON without the keys that do not change how text is split."""
    if isinstance(node, dict):
        return {k: _canonical(v) for k, v in node.items() if k not in ("trim_offsets",)}
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    return node


def pretokenizer_by_structure(model_dir: Path) -> str | None:
    """The llama.cpp pre-tokenizer whose splitting rules equal those in ``model_dir/tokenizer.json``
    (:data:`KNOWN_PRETOKENIZERS`), or None: no tokenizer.json, or rules llama.cpp has no pre-tokenizer for."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    spec = json.loads(path.read_text())
    pre = _canonical(spec.get("pre_tokenizer"))
    normalizer = (spec.get("normalizer") or {}).get("type")
    for name, (known, normalizers) in KNOWN_PRETOKENIZERS.items():
        if pre == _canonical(known) and normalizer in normalizers:
            return name
    return None


def describe_pretokenizer(model_dir: Path) -> str:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return "no tokenizer.json"
    spec = json.loads(path.read_text())
    return json.dumps({"pre_tokenizer": spec.get("pre_tokenizer"), "normalizer": spec.get("normalizer")})[:400]


# ---- converting and quantizing -------------------------------------------------------------------------------

def convert(model_dir: Path, out_file: Path, outtype: str, threads: int = 1) -> dict:
    """Run llama.cpp's converter on a merged HF model directory (``llamacpp_convert`` in a subprocess).

    Args:
        model_dir: merged model (safetensors, config.json, tokenizer files with the chat template).
        out_file: the GGUF to write.
        outtype: ``f32``, ``f16`` or ``bf16``.
        threads: torch threads of the converter process.

    Returns:
        ``{"pre_tokenizer": name or None (SentencePiece vocabularies have none), "pre_tokenizer_source": "hash" |
        "structure" | None, "seconds": wall time}``.

    Raises:
        GGUFExportError: an unknown pre-tokenizer (what it is, what llama.cpp knows, how to go on) or a converter
            failure (its last output lines).
    """
    import time

    where = converter_dir()
    fallback = pretokenizer_by_structure(model_dir)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).with_name("llamacpp_convert.py")), "--llama-cpp", str(where),
           "--pre-fallback", fallback or "", "--", str(model_dir), "--outfile", str(out_file), "--outtype", outtype]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use its own gguf-py
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    info = {"pre_tokenizer": None, "pre_tokenizer_source": None}
    for line in res.stdout.splitlines():
        if line.startswith("LLMTUNE_PRE "):
            info = json.loads(line[len("LLMTUNE_PRE "):])
    if res.returncode == 3:  # the wrapper's code for an unknown pre-tokenizer without a structural match
        names = ", ".join(KNOWN_PRETOKENIZERS)
        raise GGUFExportError(
            f"{model_dir}: llama.cpp does not know this tokenizer's pre-tokenizer (the converter's probe hash "
            f"{info.get('pre_tokenizer_hash')} is not in its table, and tokenizer.json's splitting rules {describe_pretokenizer(model_dir)} "
            f"match none of the byte-level BPE pre-tokenizers llmtune can name by structure: {names}). A GGUF with "
            "a guessed pre-tokenizer would split text differently from the model's own tokenizer, so none is "
            "written. A SentencePiece vocabulary (Gemma, Mistral v0.1-0.3, Llama 2: a Metaspace / '▁' tokenizer.json) "
            "converts from its tokenizer.model instead: put the base model's tokenizer.model into the merged "
            "directory (llmtune finds it itself through the run's lineage.json when the base directory has it). If "
            "llama.cpp has a pre-tokenizer with these rules, add it to KNOWN_PRETOKENIZERS in "
            "llmtune/export/llamacpp.py (verification then checks the tokenization); else use the merged "
            "safetensors model with transformers or vLLM.")
    if res.returncode != 0 or not out_file.is_file():
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-15:])
        raise GGUFExportError(f"llama.cpp's converter failed on {model_dir} (exit {res.returncode}):\n{tail}")
    info["seconds"] = round(seconds, 2)
    return info


def quantize(src: Path, dst: Path, qtype: str, threads: int | None = None) -> float:
    """Quantize a GGUF with llama.cpp's own quantizer (``llama_model_quantize``, as ``llama-quantize`` does).

    Args:
        src: the f16 (or f32/bf16) GGUF.
        dst: the GGUF to write.
        qtype: one of :data:`QUANT_TYPES`.
        threads: quantization threads (default: all cores).

    Returns:
        Wall seconds.

    Raises:
        GGUFExportError: an unknown type or llama.cpp's non-zero status.
    """
    import time

    if qtype not in _FTYPE_NAMES:
        raise GGUFExportError(f"cannot quantize to {qtype!r}; quantized types: {', '.join(QUANT_TYPES)}")
    llama_cpp = llama_cpp_module()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, _FTYPE_NAMES[qtype])
    params.nthread = threads or os.cpu_count() or 1
    t0 = time.perf_counter()
    silence_llama()
    status = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if status != 0 or not dst.is_file():
        raise GGUFExportError(f"llama.cpp could not quantize {src} to {qtype} (status {status})")
    return time.perf_counter() - t0


def silence_llama() -> None:
    """Only llama.cpp's errors on stderr from now on (loading and quantizing log hundreds of INFO lines): the level
    of llama-cpp-python's own ``llama-cpp-python`` logger, which its log callback obeys (as ``Llama(verbose=False)``
    sets it)."""
    llama_cpp_module()
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
