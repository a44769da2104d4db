"""model.from_run: inherited values, the adapter chain, and its fp32 merge into the base (causal LM or score head)."""

import json

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from llmtune.config import PrecisionConfig, load_recipe
from llmtune.models import ModelLoadError, inherit_from_run, load_model_with_chain


def finished_run(root, tiny_dir, *, stage="sft", previous=(), chat_template="chatml", seed=0):
    """A run directory as the runner leaves it: adapter/ (random non-zero LoRA), lineage.json, recipe."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False, task_type="CAUSAL_LM"))
    peft.save_pretrained(root / "adapter")
    lineage = {"stage": stage, "base_model": {"name_or_path": str(tiny_dir), "kind": "local", "path": str(tiny_dir)},
               "previous_adapters": list(previous), "adapter": "adapter", "adapter_type": "lora"}
    (root / "lineage.json").write_text(json.dumps(lineage))
    (root / "recipe.resolved.yaml").write_text(yaml.safe_dump(
        {"model": {"name_or_path": str(tiny_dir), "revision": None}, "data": {"chat_template": chat_template}}))
    return root, peft


def test_inherits_base_chat_template_and_chain(tmp_path, tiny_dir, monkeypatch):
    run, _ = finished_run(tmp_path / "sft", tiny_dir)
    monkeypatch.chdir(tmp_path)
    recipe = load_recipe(raw={"model": {"from_run": "sft"}}, stage="dpo")
    inherited, chain = inherit_from_run(recipe, base_dir=".")
    assert inherited.model.name_or_path == str(tiny_dir) and inherited.data.chat_template == "chatml"
    assert inherited.model.from_run == "sft"  # kept in the resolved recipe
    assert chain == [{"stage": "sft", "run_dir": str(run.resolve()), "path": str(run.resolve() / "adapter"),
                      "adapter_type": "lora"}]


def test_chain_of_a_chained_run_keeps_the_earlier_adapters(tmp_path, tiny_dir):
    first = {"stage": "sft", "run_dir": "/x/sft", "path": "/x/sft/adapter", "adapter_type": "lora"}
    run, _ = finished_run(tmp_path / "dpo", tiny_dir, stage="dpo", previous=[first])
    recipe = load_recipe(raw={"model": {"from_run": str(run)}}, stage="rm")
    _, chain = inherit_from_run(recipe)
    assert [e["stage"] for e in chain] == ["sft", "dpo"] and chain[0] == first


def test_explicit_values_override_and_are_logged(tmp_path, tiny_dir, caplog):
    run, _ = finished_run(tmp_path / "sft", tiny_dir)
    recipe = load_recipe(raw={"model": {"from_run": str(run), "name_or_path": "/elsewhere/base"},
                              "data": {"chat_template": "llama2"}}, stage="dpo")
    with caplog.at_level("INFO", logger="llmtune"):
        inherited, _ = inherit_from_run(recipe)
    assert inherited.model.name_or_path == "/elsewhere/base" and inherited.data.chat_template == "llama2"
    assert "set by this recipe; the earlier run used" in caplog.text


def test_unfinished_run_and_quantized_base_are_errors(tmp_path, tiny_dir):
    (tmp_path / "half").mkdir()
    with pytest.raises(ModelLoadError, match="not a finished run"):
        inherit_from_run(load_recipe(raw={"model": {"from_run": str(tmp_path / "half")}}, stage="dpo"))
    run, _ = finished_run(tmp_path / "sft", tiny_dir)
    with pytest.raises(ModelLoadError, match="4/8-bit"):
        inherit_from_run(load_recipe(raw={"model": {"from_run": str(run), "load_in_4bit": True}}, stage="dpo"))


@pytest.mark.parametrize("head", ["causal_lm", "score"])
def test_chain_is_merged_in_fp32_before_the_cast(tmp_path, tiny_dir, head):
    run, peft = finished_run(tmp_path / "sft", tiny_dir)
    recipe, chain = inherit_from_run(load_recipe(raw={"model": {"from_run": str(run), "dtype": "bf16"}}, stage="dpo"))
    model = load_model_with_chain(recipe.model, PrecisionConfig(), chain, head=head)
    q = peft.base_model.model.model.layers[1].self_attn.q_proj
    expected = q.base_layer.weight + q.scaling["default"] * q.lora_B["default"].weight @ q.lora_A["default"].weight
    assert model.dtype == torch.bfloat16
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight, expected.detach().to(torch.bfloat16))
    assert type(model).__name__ == ("LlamaForSequenceClassification" if head == "score" else "LlamaForCausalLM")
