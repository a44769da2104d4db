"""A ``model.from_run`` chain on a 4-bit base: the earlier adapters stacked frozen under the new one.

The model a stage starts from must be the earlier run's model exactly (4-bit base + its adapter), its reference must
stay that model while the new adapter trains, the chain must never train, and a stage saves only its own adapter."""

import pytest
import torch

from llmtune.models import attach_adapter
from llmtune.models.adapters import (
    adapter_scope, frozen_adapter_names, reference_scope, stack_frozen_adapters,
)
from llmtune.models.lineage import load_stacked_base
from tests.unit.models.qlora_run import chain_of, qlora_recipe, qlora_run

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora")
    run, peft = qlora_run(root)
    ids = torch.randint(10, 390, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = peft(input_ids=ids).logits
    return {"root": root, "run": run, "ids": ids, "logits": logits, "model_dir": root / "model"}


def stacked(sft, checkpointing=False, **adapter):
    recipe = qlora_recipe(sft["model_dir"], "dpo", adapter={"lora_r": 8, "lora_alpha": 16, **adapter})
    base = load_stacked_base(recipe.model, recipe.precision, chain_of(sft["run"]))
    return attach_adapter(base, recipe.adapter, gradient_checkpointing=checkpointing, quantized=True,
                          frozen_chain=chain_of(sft["run"]))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_new_stage_starts_as_the_earlier_model_and_its_reference_stays_it(sft):
    model = stacked(sft).eval()
    assert frozen_adapter_names(model) == ["llmtune_chain_0"]
    torch.testing.assert_close(logits(model, sft["ids"]), sft["logits"], atol=0, rtol=0)  # B = 0: the SFT model
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".default." in name and "lora_B" in name:
                param.add_(0.05)  # what training does to the new adapter
    moved = logits(model, sft["ids"])
    assert (moved - sft["logits"]).abs().max() > 1e-2
    with reference_scope(model):  # the reference: 4-bit base + SFT adapter, not the bare base
        torch.testing.assert_close(logits(model, sft["ids"]), sft["logits"], atol=0, rtol=0)
    with adapter_scope(model, "default"):  # the policy scope keeps the chain too
        torch.testing.assert_close(logits(model, sft["ids"]), moved, atol=0, rtol=0)
    torch.testing.assert_close(logits(model, sft["ids"]), moved, atol=0, rtol=0)  # scopes restore the state


def test_the_chain_never_trains_and_the_new_adapter_gets_every_gradient(sft):
    model = stacked(sft, checkpointing=True).train()
    frozen = {n for n, p in model.named_parameters() if "llmtune_chain_0" in n}
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert frozen and not frozen & trained
    assert trained == {n for n, _ in model.named_parameters() if ".default." in n and "lora_" in n}
    with reference_scope(model):  # peft's disable_adapter() would have made the chain trainable on exit
        model(input_ids=sft["ids"])
    model(input_ids=sft["ids"], labels=sft["ids"]).loss.backward()
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trained
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters()
               if n in trained and "lora_B" in n)  # checkpointed layers too: the chain's inputs do not block them


def test_a_stage_saves_its_own_adapter_only(sft, tmp_path):
    model = stacked(sft)
    model.save_pretrained(tmp_path / "adapter")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["README.md", "adapter_config.json",
                                                                       "adapter_model.safetensors"]
    model.add_adapter("value", model.peft_config["default"])  # PPO's second trained adapter is saved, in value/
    model.save_pretrained(tmp_path / "ppo")
    assert (tmp_path / "ppo" / "value" / "adapter_model.safetensors").is_file()
    assert not any("llmtune_chain" in p.name for p in (tmp_path / "ppo").rglob("*"))


def test_frozen_adapters_stack_on_a_score_model_without_the_lm_head(sft):
    """An RM on a QLoRA SFT run: the SFT adapter's LoRA goes under the RM's, pieces the score model lacks are left
    out, and peft's score head stays the trained module."""
    recipe = qlora_recipe(sft["model_dir"], "rm")
    base = load_stacked_base(recipe.model, recipe.precision, chain_of(sft["run"]), head="score")
    model = attach_adapter(base, recipe.adapter, gradient_checkpointing=False, quantized=True)
    names = stack_frozen_adapters(model, chain_of(sft["run"]))
    assert names == ["llmtune_chain_0"]
    assert any("score" in n and p.requires_grad for n, p in model.named_parameters())
    assert not any("llmtune_chain_0" in n and p.requires_grad for n, p in model.named_parameters())
