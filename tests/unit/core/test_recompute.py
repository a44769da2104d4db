"""Cheap activations kept as recipes (llmtune.core.recompute): the SwiGLU product is not stored, the gradients are
bit-identical."""

import pytest
import torch

from llmtune.core import recompute
from llmtune.core.lm_head import masked_token_logps
from tests.unit.core.test_memory import B, T, batch, lora_model


def run(model, with_recipes: bool):
    """(loss, LoRA gradients, bytes of the distinct non-parameter storages saved for the backward)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    sizes: dict[int, int] = {}
    original = recompute._pack

    def measuring_pack(t):
        packed = original(t) if with_recipes else t
        if isinstance(packed, torch.Tensor) and packed.untyped_storage().data_ptr() not in params:
            sizes[packed.untyped_storage().data_ptr()] = packed.untyped_storage().nbytes()
        return packed

    inputs, labels = batch()
    model.train()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recompute, "_pack", measuring_pack)
        with recompute.recompute_cheap_activations():
            logps, _ = masked_token_logps(model, inputs, labels)
    loss = -logps.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads, sum(sizes.values())


def test_swiglu_product_and_norm_outputs_are_recomputed_with_identical_gradients():
    loss_a, grads_a, saved_a = run(lora_model(), with_recipes=False)
    loss_b, grads_b, saved_b = run(lora_model(), with_recipes=True)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys() and all(torch.equal(grads_a[k], grads_b[k]) for k in grads_a)
    hidden, intermediate, layers = 64, 128, 2  # tiny Llama
    # per layer one fp32 (tokens, intermediate) product and two (tokens, hidden) norm outputs
    assert saved_a - saved_b == layers * B * T * (intermediate + 2 * hidden) * 4


def test_unfused_mlps_and_checkpointed_layers_are_unchanged():
    _, grads_plain, saved_plain = run(lora_model(fused=False), with_recipes=False)
    _, grads, saved = run(lora_model(fused=False), with_recipes=True)
    assert saved == saved_plain and all(torch.equal(grads[k], grads_plain[k]) for k in grads)
    _, grads_ckpt, _ = run(lora_model(checkpointing=True), with_recipes=True)
    _, grads_ref, _ = run(lora_model(), with_recipes=False)
    torch.testing.assert_close(grads_ckpt, grads_ref)


def test_register_outside_the_context_keeps_nothing():
    x = torch.ones(3, requires_grad=True)
    recompute.register(x, lambda: x)
    assert recompute._registry is None
