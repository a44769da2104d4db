"""SwiGLU autograd function: the same outputs and gradients as autograd's silu(gate) * up, with fewer saved tensors."""

import torch
from peft import LoraConfig, get_peft_model

from llmtune.core.fused import SwiGLU, fuse_swiglu
from llmtune.core.lm_head import masked_token_logps
from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer
from tests.unit.core.test_lm_head import grads, padded_batch


def test_swiglu_values_and_gradients():
    gate = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    up = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(SwiGLU.apply, (gate, up))
    torch.testing.assert_close(SwiGLU.apply(gate, up), torch.nn.functional.silu(gate) * up)


def saved_bytes(fn):
    sizes = {}

    def pack(t):
        sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(sizes.values())


def test_fused_model_matches_and_saves_less():
    batch, results = padded_batch(), []
    for fused in (False, True):
        model = make_tiny_llama(make_tiny_tokenizer(), seed=0)
        if fused:
            assert fuse_swiglu(model) == 2  # both layers' MLPs
        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
        for name, p in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.constant_(p, 0.05)
        logps, _ = masked_token_logps(model, batch, batch["labels"])
        (-logps.sum()).backward()
        results.append((logps.detach(), grads(model), saved_bytes(lambda: masked_token_logps(model, batch,
                                                                                             batch["labels"]))))
    (plain, plain_grads, plain_saved), (fused, fused_grads, fused_saved) = results
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-6)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    # one (tokens, intermediate) fp32 tensor less per layer: 2 layers x 3 x 14 x 64 x 4 bytes
    assert plain_saved - fused_saved >= 2 * 3 * 14 * 64 * 4
