"""attach_adapter: LoRA targets, DoRA/rsLoRA/modules_to_save reach peft, full fine-tuning, QLoRA on CPU, and
gradient checkpointing that leaves every gradient unchanged."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from llmtune.config import AdapterConfig, ModelConfig, PrecisionConfig
from llmtune.models import ModelLoadError, attach_adapter, count_parameters, load_model
from llmtune.models.adapters import checkpointing_enabled, reentrant_checkpointing_modules

LINEAR = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def base(tiny_dir, **kw):
    return load_model(ModelConfig(name_or_path=str(tiny_dir), **kw), PrecisionConfig())


def lora(**kw) -> AdapterConfig:
    return AdapterConfig(**{"lora_r": 4, "lora_alpha": 16, "lora_dropout": 0.0, **kw})


def lora_modules(model) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and "default" in m.lora_A}


def randomize_lora_b(model, seed: int = 3) -> None:
    """peft starts lora_B at 0, which makes every lora_A gradient 0; give B values so both get gradients."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def copy_weights(dst, src) -> None:
    """Make ``dst`` an exact copy of ``src`` (peft draws lora_A from the global RNG at attach time)."""
    dst.load_state_dict(src.state_dict())


def grads_after_backward(model, batch) -> dict[str, torch.Tensor]:
    model.train()
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters() if p.requires_grad}


def count_saved_tensors(model, batch) -> int:
    """Tensors autograd keeps from the forward for backward (checkpointing keeps far fewer)."""
    n = 0

    def pack(t):
        nonlocal n
        n += 1
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**batch)
    return n


# ------------------------------------------------------------------ LoRA configuration reaches peft


def test_all_linear_adapts_every_projection_but_not_lm_head(tiny_dir):
    model = attach_adapter(base(tiny_dir), lora(), gradient_checkpointing=False, quantized=False)
    names = set(lora_modules(model))
    expected = {
        f"base_model.model.model.layers.{i}.{block}.{proj}"
        for i in range(2)
        for block, projs in (
            ("self_attn", ("q_proj", "k_proj", "v_proj", "o_proj")),
            ("mlp", ("gate_proj", "up_proj", "down_proj")),
        )
        for proj in projs
    }
    assert names == expected
    assert not hasattr(model.base_model.model.lm_head, "lora_A")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * len(expected)


def test_explicit_target_modules(tiny_dir):
    adapter = lora(target_modules=["q_proj", "v_proj"])
    model = attach_adapter(base(tiny_dir), adapter, gradient_checkpointing=False, quantized=False)
    assert {n.rsplit(".", 1)[-1] for n in lora_modules(model)} == {"q_proj", "v_proj"}


def test_unknown_target_module_lists_the_real_ones(tiny_dir):
    with pytest.raises(ModelLoadError, match=r"target_modules=\['qkv'\].*q_proj.*(all-linear)"):
        attach_adapter(base(tiny_dir), lora(target_modules=["qkv"]), gradient_checkpointing=False, quantized=False)


@pytest.mark.parametrize(("rslora", "scaling"), [(False, 16 / 4), (True, 16 / math.sqrt(4))])
def test_lora_scaling_plain_and_rslora(tiny_dir, rslora, scaling):
    model = attach_adapter(base(tiny_dir), lora(use_rslora=rslora), gradient_checkpointing=False, quantized=False)
    q = lora_modules(model)["base_model.model.model.layers.0.self_attn.q_proj"]
    assert q.scaling["default"] == pytest.approx(scaling)
    assert model.peft_config["default"].use_rslora is rslora


def test_dora_adds_magnitude_vectors(tiny_dir):
    model = attach_adapter(base(tiny_dir), lora(use_dora=True), gradient_checkpointing=False, quantized=False)
    q = lora_modules(model)["base_model.model.model.layers.0.self_attn.q_proj"]
    assert model.peft_config["default"].use_dora is True
    magnitude = q.lora_magnitude_vector["default"].weight
    assert magnitude.requires_grad and magnitude.shape == (q.out_features,)
    # DoRA initialises the magnitude to the column norms of the base weight
    torch.testing.assert_close(magnitude, q.base_layer.weight.norm(p=2, dim=1))


def test_modules_to_save_trains_a_full_copy(tiny_dir):
    adapter = lora(modules_to_save=["lm_head"])
    model = attach_adapter(base(tiny_dir), adapter, gradient_checkpointing=False, quantized=False)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    head = [n for n in trainable if "lm_head" in n]
    assert head == ["base_model.model.lm_head.modules_to_save.default.weight"]
    assert not any("embed_tokens" in n for n in trainable)
    lm_head = model.base_model.model.lm_head
    n_lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert count_parameters(model)[0] == n_lora + lm_head.modules_to_save["default"].weight.numel()


def test_full_fine_tuning_trains_everything(tiny_dir):
    model = base(tiny_dir)
    for p in model.parameters():
        p.requires_grad_(False)  # even a frozen model comes back fully trainable
    out = attach_adapter(model, AdapterConfig(type="none"), gradient_checkpointing=False, quantized=False)
    assert out is model
    trainable, total = count_parameters(out)
    assert trainable == total == sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------ gradient checkpointing keeps the math


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_checkpointing_gives_the_same_nonzero_gradients(tiny_dir, batch, kind):
    adapter = lora() if kind == "lora" else AdapterConfig(type="none")
    plain = attach_adapter(base(tiny_dir), adapter, gradient_checkpointing=False, quantized=False)
    ckpt = attach_adapter(base(tiny_dir), adapter, gradient_checkpointing=True, quantized=False)
    if kind == "lora":
        randomize_lora_b(plain)
    copy_weights(ckpt, plain)
    assert not checkpointing_enabled(plain) and checkpointing_enabled(ckpt)
    assert ckpt.config.use_cache is False
    assert reentrant_checkpointing_modules(ckpt) == []
    # checkpointing really is active: the forward keeps far fewer tensors for backward
    assert count_saved_tensors(ckpt, batch) < count_saved_tensors(plain, batch) / 2

    g_plain, g_ckpt = grads_after_backward(plain, batch), grads_after_backward(ckpt, batch)
    assert g_plain.keys() == g_ckpt.keys()
    if kind == "lora":
        assert len(g_plain) == 2 * 14  # lora_A + lora_B of 7 projections x 2 layers
    else:
        assert len(g_plain) == len(list(plain.parameters()))
    for name, g in g_ckpt.items():
        assert g is not None and g.abs().sum() > 0, f"{name} got no gradient with checkpointing"
        torch.testing.assert_close(g, g_plain[name], atol=1e-6, rtol=0, msg=f"{name} differs with checkpointing")


def _reentrant(model) -> None:
    """What old transformers (< 4.35 defaults) and some hub code do: reentrant checkpointing, no input-grad hook."""
    model._set_gradient_checkpointing(
        enable=True, gradient_checkpointing_func=functools.partial(checkpoint, use_reentrant=True)
    )


def test_known_failure_reentrant_checkpointing_on_frozen_inputs_trains_nothing(tiny_dir, batch):
    """The failure kind we guard against (peft #137, transformers #23170): with reentrant checkpointing a block
    back-propagates only if one of its tensor INPUTS requires grad. The base is frozen, so the hidden states
    entering the decoder layers do not, and no LoRA weight inside a checkpointed layer gets a gradient. When
    something after the layers is trainable too (here lm_head via modules_to_save) the loss still has a grad_fn,
    backward runs, the head trains, and the LoRA weights silently stay untouched. (With nothing trainable after
    the layers, backward at least fails loudly.) This builds the broken setup by hand, bypassing attach_adapter,
    to show it is real; the tests below show attach_adapter never produces it."""
    from peft import get_peft_model

    from llmtune.models.adapters import build_lora_config

    model = get_peft_model(base(tiny_dir), build_lora_config(lora(modules_to_save=["lm_head"])))
    randomize_lora_b(model)
    _reentrant(model.base_model.model)  # enabled after wrapping: no input-grad hook anywhere
    with pytest.warns(UserWarning, match="None of the inputs have requires_grad"):  # the only signal, easy to miss
        grads = grads_after_backward(model, batch)
    lora_grads = {n: g for n, g in grads.items() if "lora_" in n}
    assert len(lora_grads) == 28 and all(g is None for g in lora_grads.values())  # nothing trained
    assert grads["base_model.model.lm_head.modules_to_save.default.weight"].abs().sum() > 0  # looks alive

    loud = get_peft_model(base(tiny_dir), build_lora_config(lora()))
    _reentrant(loud.base_model.model)
    with pytest.raises(RuntimeError, match="does not require grad"):
        grads_after_backward(loud, batch)


@pytest.mark.parametrize("gradient_checkpointing", [True, False])
def test_attach_adapter_repairs_a_model_with_reentrant_checkpointing(tiny_dir, batch, gradient_checkpointing):
    reference = attach_adapter(base(tiny_dir), lora(), gradient_checkpointing=False, quantized=False)
    user_model = base(tiny_dir)
    _reentrant(user_model)
    assert reentrant_checkpointing_modules(user_model)
    fixed = attach_adapter(user_model, lora(), gradient_checkpointing=gradient_checkpointing, quantized=False)
    assert checkpointing_enabled(fixed) and reentrant_checkpointing_modules(fixed) == []
    assert_same_nonzero_lora_grads(fixed, reference, batch)


def test_model_code_that_stays_reentrant_gets_input_grads(tiny_dir, batch, monkeypatch):
    """Hub code that ignores the checkpointing kwargs keeps checkpointing reentrantly; then the embedding output is
    made to require grad, which is enough for reentrant checkpointing to reach the LoRA weights."""
    from llmtune.models import enable_gradient_checkpointing

    model = base(tiny_dir)
    monkeypatch.setattr(model, "activation_checkpointing_enable", lambda **kw: _reentrant(model), raising=False)
    monkeypatch.setattr(model, "enable_input_require_grads", _counting(model.enable_input_require_grads, calls := []))
    enable_gradient_checkpointing(model)
    assert reentrant_checkpointing_modules(model) and calls == [1]
    assert model.get_input_embeddings()(batch["input_ids"]).requires_grad  # the hook is in place

    reference = attach_adapter(base(tiny_dir), lora(), gradient_checkpointing=False, quantized=False)
    fixed = attach_adapter(model, lora(), gradient_checkpointing=True, quantized=False)
    assert reentrant_checkpointing_modules(fixed)  # still reentrant, yet:
    assert_same_nonzero_lora_grads(fixed, reference, batch)


def _counting(fn, calls):
    def wrapper(*a, **kw):
        calls.append(1)
        return fn(*a, **kw)

    return wrapper


# ------------------------------------------------------------------ QLoRA / 8-bit on CPU


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_qlora_on_cpu_trains_the_lora_weights(tiny_dir, batch, gradient_checkpointing):
    pytest.importorskip("bitsandbytes")
    unquantized_total = count_parameters(base(tiny_dir))[1]
    model = attach_adapter(
        base(tiny_dir, load_in_4bit=True), lora(), gradient_checkpointing=gradient_checkpointing, quantized=True
    )
    q = lora_modules(model)["base_model.model.model.layers.0.self_attn.q_proj"]
    assert type(q.base_layer).__name__ == "Linear4bit"
    assert checkpointing_enabled(model) is gradient_checkpointing
    trainable, total = count_parameters(model)
    n_lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert trainable == n_lora and total == unquantized_total + n_lora  # 4-bit weights counted unpacked
    model.train()
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)
    grads = {n: p.grad for n, p in model.named_parameters() if "lora_" in n}
    assert len(grads) == 28 and all(g is not None for g in grads.values())
    assert all(g.abs().sum() > 0 for n, g in grads.items() if "lora_B" in n)  # step 1 from peft's B=0 init
    assert q.base_layer.weight.grad is None
    randomize_lora_b(model)  # with B != 0, lora_A gets gradients too
    grads = grads_after_backward(model, batch)
    assert all(g is not None and g.abs().sum() > 0 and torch.isfinite(g).all() for g in grads.values())


def test_qlora_full_fine_tuning_is_refused(tiny_dir):
    pytest.importorskip("bitsandbytes")
    with pytest.raises(ModelLoadError, match="full fine-tuning.*quantized"):
        attach_adapter(
            base(tiny_dir, load_in_4bit=True), AdapterConfig(type="none"), gradient_checkpointing=False, quantized=False
        )


def test_8bit_lora_backward_on_cpu(tiny_dir, batch):
    pytest.importorskip("bitsandbytes")
    model = attach_adapter(base(tiny_dir, load_in_8bit=True), lora(), gradient_checkpointing=True, quantized=True)
    randomize_lora_b(model)
    grads = grads_after_backward(model, batch)
    assert len(grads) == 28 and all(g is not None and g.abs().sum() > 0 for g in grads.values())


def assert_same_nonzero_lora_grads(fixed, reference, batch):
    """Same weights (LoRA B randomised so every LoRA weight gets a gradient), then every gradient of ``fixed`` is
    non-zero and equal (atol 1e-6) to the one without checkpointing."""
    randomize_lora_b(reference)
    copy_weights(fixed, reference)
    g_ref, g_fixed = grads_after_backward(reference, batch), grads_after_backward(fixed, batch)
    for name, g in g_fixed.items():
        assert g is not None and g.abs().sum() > 0, name
        torch.testing.assert_close(g, g_ref[name], atol=1e-6, rtol=0)


def test_the_reference_scope_turns_off_trained_modules_to_save_copies_too(tiny_dir, batch):
    """The reference (adapter_scope None: DPO, KTO, PPO, GRPO) is the model before training: a trained full copy of
    lm_head must be off there as the LoRA layers are (old code left the trained copy on in PPO/GRPO's reference)."""
    from llmtune.models.adapters import adapter_scope, reference_scope

    model = attach_adapter(base(tiny_dir), lora(modules_to_save=["lm_head"]), gradient_checkpointing=False,
                           quantized=False).eval()
    with torch.no_grad():
        before = model(input_ids=batch["input_ids"]).logits
        randomize_lora_b(model)
        for name, p in model.named_parameters():
            if "modules_to_save" in name:
                p.add_(0.1)
        trained = model(input_ids=batch["input_ids"]).logits
        for scope in (adapter_scope(model, None), reference_scope(model)):
            with scope:
                torch.testing.assert_close(model(input_ids=batch["input_ids"]).logits, before, atol=0, rtol=0)
        torch.testing.assert_close(model(input_ids=batch["input_ids"]).logits, trained, atol=0, rtol=0)
    assert (trained - before).abs().max() > 1e-2
