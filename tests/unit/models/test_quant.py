"""4-bit weights stay in bitsandbytes' standard layout: an eval forward (which bitsandbytes' CPU backend uses to
repack the weights on AVX-512 CPUs) changes neither the dequantized weights nor the training loss, and a weight that
was packed anyway is read back as the one the packed kernel computed with."""

import copy

import pytest
import torch

from llmtune.config import load_recipe
from llmtune.models import attach_adapter, load_model
from llmtune.models.quant import compute_dtype_4bit, dequantize_to_fp32, keep_standard_4bit_layout
from llmtune.models.tiny import save_tiny_model

bnbf = pytest.importorskip("bitsandbytes.functional")


@pytest.fixture(scope="module")
def h64(tmp_path_factory):
    """hidden 64: every 4-bit weight has whole 64-value blocks per row, as the CPU packed layout needs."""
    return save_tiny_model(tmp_path_factory.mktemp("h64") / "h64", hidden_size=64)


def quantized(tiny_dir, **model):
    recipe = load_recipe(raw={"model": {"name_or_path": str(tiny_dir), "load_in_4bit": True,
                                        "bnb_4bit_compute_dtype": "fp32", **model}}, stage="sft")
    return load_model(recipe.model, recipe.precision), recipe


def dequantized(weight) -> torch.Tensor:
    """The standard-layout reading of a Params4bit, in fp32 (what transformers' model.dequantize() computes)."""
    state = copy.copy(weight.quant_state)
    state.dtype = torch.float32
    return bnbf.dequantize_4bit(weight.data, state)


def four_bit_weights(model) -> dict[str, torch.Tensor]:
    return {n: dequantized(m.weight) for n, m in model.named_modules() if type(m).__name__ == "Linear4bit"}


@pytest.mark.parametrize("double_quant", [True, False])
def test_an_eval_forward_leaves_the_dequantized_4bit_weights_unchanged(h64, batch, double_quant):
    model, _ = quantized(h64, bnb_4bit_use_double_quant=double_quant)
    before = four_bit_weights(model)
    model.eval()
    with torch.no_grad():  # the forward bitsandbytes' CPU backend repacks at (AVX-512 BF16 CPUs)
        first = model(input_ids=batch["input_ids"]).logits
        again = model(input_ids=batch["input_ids"]).logits
    after = four_bit_weights(model)
    assert before.keys() == after.keys() and len(before) == 14
    for name in before:  # old code on AVX-512: q_proj off by ~0.1 after the forward
        assert torch.equal(after[name], before[name]), name
    torch.testing.assert_close(again, first, atol=0, rtol=0)
    assert compute_dtype_4bit(model) == torch.float32


def test_an_evaluation_pass_does_not_change_the_qlora_training_loss_or_gradients(h64, batch):
    model, recipe = quantized(h64)
    model = attach_adapter(model, recipe.adapter, gradient_checkpointing=False, quantized=True)

    def train_step():
        model.train()
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return loss.item(), grads

    torch.manual_seed(0)
    loss0, grads0 = train_step()
    model.eval()
    with torch.no_grad():  # what Trainer.evaluate does between training steps
        model(**batch)
    torch.manual_seed(0)  # same LoRA dropout mask
    loss1, grads1 = train_step()
    assert loss1 == loss0  # old code on AVX-512: the loss moves (bf16 kernel) and lower layers lose gradient
    for name, grad in grads0.items():
        torch.testing.assert_close(grads1[name], grad, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("double_quant", [True, False])
def test_a_packed_cpu_weight_is_dequantized_as_the_packed_kernel_computes_it(h64, double_quant):
    """Pack the weights the way bitsandbytes' CPU backend does (runs on any CPU), then read them: the codes are
    the original ones and the absmax is the bf16 value the kernel multiplies with."""
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    model, _ = quantized(h64, bnb_4bit_use_double_quant=double_quant)
    expected = {}
    for name, module in model.named_modules():
        if type(module).__name__ != "Linear4bit":
            continue
        weight = module.weight
        state = copy.deepcopy(weight.quant_state)  # the kernel's weights: codes * bf16(absmax)
        if state.nested:
            state.absmax = bnbf.dequantize_blockwise(state.absmax, state.state2) + state.offset
            state.nested, state.state2 = False, None
        state.absmax = state.absmax.float().to(torch.bfloat16).float()
        state.dtype = torch.float32
        expected[name] = bnbf.dequantize_4bit(weight.data, state)
        module.support_avx512bf16_for_cpu = True  # as bitsandbytes sets it on an AVX-512 BF16 CPU
        weight.data, weight.quant_state = _convert_weight_packed_for_cpu(weight.data, weight.quant_state)
        assert weight.quant_state.packing_format_for_cpu and weight.shape != (weight.numel(), 1)
    assert compute_dtype_4bit(model) == torch.bfloat16  # the packed kernel computes in bf16
    plain = dequantize_to_fp32(model)  # old code: read the packed codes as the standard layout
    for name, want in expected.items():
        got = plain.get_submodule(name).weight
        assert type(plain.get_submodule(name)).__name__ == "Linear"
        torch.testing.assert_close(got, want, atol=0, rtol=0, msg=name)


def test_keep_standard_layout_turns_off_the_repack_and_leaves_unpacked_weights_alone(h64):
    model, _ = quantized(h64)
    layers = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    assert layers and all(m.support_avx512bf16_for_cpu is False for m in layers)  # done by load_model
    before = four_bit_weights(model)
    for m in layers:
        m.support_avx512bf16_for_cpu = True
    assert keep_standard_4bit_layout(model) == 0
    assert all(m.support_avx512bf16_for_cpu is False for m in layers)
    assert all(torch.equal(before[n], w) for n, w in four_bit_weights(model).items())
