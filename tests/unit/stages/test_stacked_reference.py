"""The reference of each stage on a QLoRA ``model.from_run`` chain (4-bit base + SFT adapter stacked frozen): the SFT
model, never the bare 4-bit base (DPO, KTO, PPO, GRPO), and PPO's value model on top of the same chain."""

import pytest
import torch

from llmtune.core.lm_head import sequence_logps
from llmtune.models import attach_adapter
from llmtune.models.adapters import adapter_scope
from llmtune.models.lineage import load_stacked_base
from llmtune.stages import DPOStage, KTOStage
from tests.unit.models.qlora_run import chain_of, qlora_recipe, qlora_run

pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    run, peft = qlora_run(tmp_path_factory.mktemp("qlora"))
    return {"run": run, "peft": peft, "model_dir": run.parent / "model"}


def chained(sft, stage, **sections):
    recipe = qlora_recipe(sft["model_dir"], stage, **sections)
    base = load_stacked_base(recipe.model, recipe.precision, chain_of(sft["run"]))
    model = attach_adapter(base, recipe.adapter, gradient_checkpointing=False, quantized=True,
                           frozen_chain=chain_of(sft["run"]))
    with torch.no_grad():  # as after some training: the policy has moved away from the SFT model
        for name, param in model.named_parameters():
            if ".default." in name and "lora_B" in name:
                param.add_(0.05)
    return recipe, model


def test_dpo_reference_is_the_sft_model(sft, pairs, collate):
    recipe, model = chained(sft, "dpo")
    stage, batch = DPOStage(recipe), collate(pairs(4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    ref_chosen, ref_rejected = stage.reference_logps(model, batch)
    sft_chosen, sft_rejected = stage.logps(sft["peft"], batch)  # the SFT run's own model: 4-bit base + its adapter
    torch.testing.assert_close(ref_chosen, sft_chosen, atol=1e-5, rtol=0)
    torch.testing.assert_close(ref_rejected, sft_rejected, atol=1e-5, rtol=0)
    policy_chosen, _ = stage.logps(model, batch)
    assert (policy_chosen - sft_chosen).abs().max() > 1e-2  # the policy moved; the reference did not
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable  # the chain stays frozen


def test_kto_reference_is_the_sft_model(sft, pairs, collate):
    recipe, model = chained(sft, "kto")
    batch = collate(pairs(3))
    ref = KTOStage(recipe).sequence_ref_logps(model, batch)
    torch.testing.assert_close(ref, sequence_logps(sft["peft"], batch, batch["labels"]), atol=1e-5, rtol=0)


def test_online_rl_reference_and_value_model_keep_the_chain(sft, pairs, collate):
    """PPO/GRPO switch adapters with adapter_scope (llmtune.rl.model): None is the reference, ``value`` the value
    model; both run on the chain. Adding the value adapter (peft's add_adapter resets every layer's active adapters)
    keeps the chain applied to the policy."""
    from llmtune.stages.ppo.trainer import add_value_model

    recipe, model = chained(sft, "ppo", reward={"function": "llmtune.rewards:gsm8k_reward"},
                            train={"max_steps": 2, "global_batch_size": 8},
                            ppo={"rollout_batch_size": 8, "ppo_epochs": 2})
    ids = collate(pairs(2))["input_ids"]
    with torch.no_grad():
        policy = model(input_ids=ids).logits
    add_value_model(model, recipe, None)
    with torch.no_grad():
        sft_logits = sft["peft"](input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, policy, atol=0, rtol=0)
        with adapter_scope(model, None):
            torch.testing.assert_close(model(input_ids=ids).logits, sft_logits, atol=1e-5, rtol=0)
        with adapter_scope(model, "value"):  # a fresh value adapter (B = 0): the SFT model's body
            torch.testing.assert_close(model(input_ids=ids).logits, sft_logits, atol=1e-5, rtol=0)
    assert not any("llmtune_chain" in n and p.requires_grad for n, p in model.named_parameters())
