"""model.from_run: inherited values, the adapter chain, and its fp32 merge into the base (causal LM or score head)."""

import json

import pytest
import torch
import yaml
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from llmtune.config import PrecisionConfig, RecipeError, load_recipe
from llmtune.models import ModelLoadError, adapter_chain, inherit_from_run, load_model_with_chain
from llmtune.models.lineage import chain_problems


def finished_run(root, tiny_dir, *, stage="sft", previous=(), chat_template="chatml", seed=0, model=None,
                 modules_to_save=None):
    """A run directory as the runner leaves it: adapter/ (random non-zero LoRA), lineage.json, recipe (``model``:
    more ``model:`` keys of its resolved recipe, e.g. its quantization)."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False, task_type="CAUSAL_LM",
                                           modules_to_save=modules_to_save))
    peft.save_pretrained(root / "adapter")
    lineage = {"stage": stage, "base_model": {"name_or_path": str(tiny_dir), "kind": "local", "path": str(tiny_dir)},
               "previous_adapters": list(previous), "adapter": "adapter", "adapter_type": "lora"}
    (root / "lineage.json").write_text(json.dumps(lineage))
    (root / "recipe.resolved.yaml").write_text(yaml.safe_dump(
        {"model": {"name_or_path": str(tiny_dir), "revision": None, **(model or {})},
         "data": {"chat_template": chat_template}}))
    return root, peft


def entry(run, stage="sft"):
    return {"stage": stage, "run_dir": str(run.resolve()), "path": str(run.resolve() / "adapter"),
            "adapter_type": "lora"}


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


def test_name_or_path_null_takes_the_base_the_run_recorded(tmp_path, tiny_dir, caplog):
    """A recipe written before the SFT run existed must not send the run to another base (issue 38): null = the
    recorded base, without a warning; a recipe without from_run cannot leave the base null."""
    run, _ = finished_run(tmp_path / "sft", tiny_dir)
    recipe = load_recipe(raw={"model": {"from_run": str(run), "name_or_path": None}}, stage="dpo")
    assert recipe.model.name_or_path is None
    with caplog.at_level("INFO", logger="llmtune"):
        inherited, _ = inherit_from_run(recipe)
    assert inherited.model.name_or_path == str(tiny_dir)
    assert "set by this recipe" not in caplog.text
    with pytest.raises(RecipeError, match="model.name_or_path.*null.*model.from_run is not set"):
        load_recipe(raw={"model": {"name_or_path": None}}, stage="sft")


def test_unfinished_run_is_an_error(tmp_path):
    (tmp_path / "half").mkdir()
    with pytest.raises(ModelLoadError, match="not a finished run"):
        inherit_from_run(load_recipe(raw={"model": {"from_run": str(tmp_path / "half")}}, stage="dpo"))


QLORA_SFT = {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": False, "dtype": "fp32"}


def test_a_qlora_stage_takes_a_qlora_chain_and_inherits_its_4bit_settings(tmp_path, tiny_dir):
    """A QLoRA DPO on a QLoRA SFT run (old code: refused, 'merges the earlier adapters ... in fp32'), quantizing the
    base as the SFT run did when the recipe leaves the 4-bit settings at their defaults."""
    run, _ = finished_run(tmp_path / "sft", tiny_dir, model=QLORA_SFT)
    recipe = load_recipe(raw={"model": {"from_run": str(run), "load_in_4bit": True, "dtype": "fp32"}}, stage="dpo")
    inherited, chain = inherit_from_run(recipe)
    assert chain == [entry(run)]
    assert (inherited.model.bnb_4bit_quant_type, inherited.model.bnb_4bit_use_double_quant) == ("fp4", False)


@pytest.mark.parametrize("change, key, fix", [
    ({"dtype": "bf16"}, "model.dtype", "model.dtype: fp32"),
    ({"bnb_4bit_quant_type": "fp4"}, "model.bnb_4bit_quant_type", "model.bnb_4bit_quant_type: nf4"),
    ({"load_in_4bit": False, "load_in_8bit": True}, "model.load_in_4bit", "model.load_in_4bit: true"),
])
def test_a_stage_that_quantizes_the_base_otherwise_than_the_chain_is_refused(tmp_path, tiny_dir, change, key, fix):
    run, _ = finished_run(tmp_path / "sft", tiny_dir, model={"load_in_4bit": True, "dtype": "fp32"})
    model = {"from_run": str(run), "load_in_4bit": True, "dtype": "fp32", **change}
    with pytest.raises(RecipeError) as err:
        inherit_from_run(load_recipe(raw={"model": model}, stage="dpo"))
    assert [p[0] for p in err.value.problems] == [key]
    assert fix in err.value.problems[0][1] and "4-bit nf4 (double quantization, loaded as fp32)" in str(err.value)


def test_two_quantized_runs_of_one_chain_must_agree_and_whole_tensors_cannot_be_stacked(tmp_path, tiny_dir):
    sft, _ = finished_run(tmp_path / "sft", tiny_dir, model=QLORA_SFT)
    dpo, _ = finished_run(tmp_path / "dpo", tiny_dir, stage="dpo", previous=[entry(sft)],
                          model={**QLORA_SFT, "bnb_4bit_quant_type": "nf4"}, modules_to_save=["lm_head"])
    chain = adapter_chain(dpo, json.loads((dpo / "lineage.json").read_text()))
    recipe = load_recipe(raw={"model": {"from_run": str(dpo), **QLORA_SFT}}, stage="dpo")
    problems = chain_problems(recipe, chain, dpo)
    messages = " | ".join(m for _, m in problems)
    assert len(problems) == 2 and "a chain must quantize its base one way" in messages
    assert "holds whole tensors (base_model.model.lm_head.weight" in messages
    # unquantized, the same chain merges: nothing is stacked, so whole tensors are fine
    plain = chain_problems(load_recipe(raw={"model": {"from_run": str(dpo)}}, stage="dpo"), chain)
    assert len(plain) == 1 and "one way" in plain[0][1]


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


def test_a_chain_merges_into_the_dequantized_base_once_one_of_its_runs_was_quantized(tmp_path, tiny_dir):
    """SFT (unquantized) -> DPO (QLoRA) -> an unquantized stage: DPO trained on the 4-bit weights, so the chain merges into
    them dequantized, the model DPO trained and evaluated (old code looked at the first run only: the original
    weights, off by the 4-bit rounding of every weight)."""
    from llmtune.models.quant import dequantize_to_fp32

    sft, sft_peft = finished_run(tmp_path / "sft", tiny_dir, seed=1)
    dpo, dpo_peft = finished_run(tmp_path / "dpo", tiny_dir, stage="dpo", previous=[entry(sft)],
                                 model={"load_in_4bit": True, "dtype": "fp32", "bnb_4bit_compute_dtype": "fp32"})
    recipe, chain = inherit_from_run(load_recipe(raw={"model": {"from_run": str(dpo)}}, stage="rm"))
    merged = load_model_with_chain(recipe.model, PrecisionConfig(), chain)
    four = load_recipe(raw={"model": {"name_or_path": str(tiny_dir), "load_in_4bit": True, "dtype": "fp32",
                                      "bnb_4bit_compute_dtype": "fp32"}}, stage="sft")
    from llmtune.models import load_model

    dequantized = dequantize_to_fp32(load_model(four.model, four.precision))
    name = "model.layers.1.self_attn.q_proj"
    deltas = sum(p.base_model.model.get_submodule(name).get_delta_weight("default") for p in (sft_peft, dpo_peft))
    expected = dequantized.get_submodule(name).weight + deltas.detach()
    original = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).get_submodule(name).weight
    torch.testing.assert_close(merged.get_submodule(name).weight, expected, atol=1e-6, rtol=0)
    assert (merged.get_submodule(name).weight - (original + deltas)).abs().max() > 1e-3  # not the original base
