"""Memory estimate (llmtune.core.memory) against what a tiny LoRA Llama really holds, and the `auto` checkpointing
choice made from it."""

import functools

import pytest
import torch
from peft import LoraConfig, get_peft_model

from llmtune.config import load_recipe
from llmtune.core import memory, recompute
from llmtune.core.fused import fuse_swiglu, recompute_norm_outputs
from llmtune.core.lm_head import masked_token_logps
from llmtune.models.adapters import adapter_recompute_context
from llmtune.models.tiny import make_tiny_llama, make_tiny_tokenizer

B, T, R = 2, 40, 8


def lora_model(fused: bool = True, checkpointing: bool = False):
    """The tiny LoRA Llama as SFT/DPO train it (fused: SwiGLU + recomputed norm outputs, llmtune.core.fused)."""
    model = make_tiny_llama(make_tiny_tokenizer(), seed=0, hidden_size=64)
    if fused:
        fuse_swiglu(model)
        assert recompute_norm_outputs(model) == 5  # 2 per layer + the final norm
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={
            "use_reentrant": False, "context_fn": adapter_recompute_context})
    return get_peft_model(model, LoraConfig(r=R, lora_alpha=16, target_modules="all-linear"))


def recipe(precision=None, **train):
    return load_recipe(raw={"stage": "sft", "data": {"max_length": T}, "precision": precision or {},
                            "train": {"micro_batch_size": B, "global_batch_size": B, **train}})


def batch():
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 300, (B, T), generator=gen)
    labels = ids.clone()
    labels[:, :10] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels


def saved_activation_bytes(model, checkpointing: bool) -> dict[str, int]:
    """Bytes of the distinct non-parameter storages autograd keeps for the backward of one SFT loss (in the core's
    training forward, llmtune.core.recompute), per decoder layer and outside them. Under (non-reentrant)
    checkpointing a layer keeps only its input, which the layer's forward pre-hook records."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}  # (autocast's weight copies count)
    seen: dict[int, tuple[str, int]] = {}
    where = ["outside"]

    def keep(name, t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), (name, storage.nbytes()))

    def pack(t):
        keep(where[0], t)
        return t

    def enter(i, module, args, kwargs):
        where[0] = f"layer{i}"
        if checkpointing:
            keep(f"layer{i}", args[0] if args else kwargs["hidden_states"])

    layers = model.base_model.model.model.layers
    handles = [layer.register_forward_pre_hook(functools.partial(enter, i), with_kwargs=True)
               for i, layer in enumerate(layers)]
    handles += [layer.register_forward_hook(lambda *_: where.__setitem__(0, "outside")) for layer in layers]
    inputs, labels = batch()
    model.train()
    original = recompute._pack  # the training forward's hooks (CoreTrainer.compute_loss): what they keep

    def measuring_pack(t):
        packed = original(t)
        return pack(packed) if isinstance(packed, torch.Tensor) else packed

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(recompute, "_pack", measuring_pack)
        with recompute.recompute_cheap_activations():
            logps, _ = masked_token_logps(model, inputs, labels)
    logps.sum().backward()  # the graph is whole
    for h in handles:
        h.remove()
    out: dict[str, int] = {}
    for name, nbytes in seen.values():
        out[name] = out.get(name, 0) + nbytes
    return out


def test_weights_gradients_and_adamw_states_are_exact():
    model = lora_model()
    est = memory.estimate_training_memory(model, recipe(), "sft")
    assert est.weights == sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers())
    inputs, labels = batch()
    masked_token_logps(model, inputs, labels)[0].sum().backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    opt.step()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in trainable)
    states = sum(v.numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step")
    assert est.trainable == grads + states  # measured: the tensors torch really allocated
    assert memory.estimate_training_memory(model, recipe(optim="adamw_8bit"), "sft").trainable == grads + 2 * sum(
        p.numel() for p in trainable)


@pytest.mark.parametrize("fused", [True, False])
def test_activation_estimate_matches_saved_tensors(fused):
    measured = saved_activation_bytes(lora_model(fused), checkpointing=False)
    est = memory.estimate_training_memory(lora_model(fused), recipe(), "sft")
    layers = [v for k, v in measured.items() if k.startswith("layer")]
    assert len(layers) == 2
    per_layer, _ = memory.activation_elements_per_token(lora_model(fused), T)
    for got in layers:  # one decoder layer: the Korthikanti-style count, within 10 %
        assert per_layer * B * T * 4 == pytest.approx(got, rel=0.1)
    assert est.activations + est.head == pytest.approx(sum(measured.values()), rel=0.1)


def test_checkpointing_estimate_matches_what_checkpointing_keeps():
    plain = saved_activation_bytes(lora_model(), checkpointing=False)
    ckpt = saved_activation_bytes(lora_model(checkpointing=True), checkpointing=True)
    est = memory.estimate_training_memory(lora_model(), recipe(), "sft")
    one_layer = plain["layer1"]  # the backward recomputes one layer at a time
    kept = sum(v for k, v in ckpt.items() if k.startswith("layer"))
    assert kept == 2 * B * T * 64 * 4  # each layer keeps its (B, T, h) fp32 input and nothing else
    assert est.activations_checkpointed == pytest.approx(kept + one_layer, rel=0.1)
    assert est.total(True) < est.total(False)
    assert est.activations_checkpointed < est.activations


def test_auto_turns_checkpointing_off_when_memory_is_ample_and_on_when_short(monkeypatch):
    est = memory.MemoryEstimate(weights=10 * memory.GB, trainable=1 * memory.GB, activations=20 * memory.GB,
                                activations_checkpointed=2 * memory.GB, head=1 * memory.GB, tokens=8192)
    assert est.total(False) == 32 * memory.GB and est.total(True) == 14 * memory.GB
    on, why = memory.choose_checkpointing("auto", est, 139 * memory.GB)  # an H200
    assert on is False and "fits" in why
    on, why = memory.choose_checkpointing("auto", est, 24 * memory.GB)  # 32 > 0.85 x 24
    assert on is True and "exceeds" in why
    assert memory.choose_checkpointing("auto", est, int(32 / 0.85 * memory.GB) + 1)[0] is False  # the margin edge
    assert memory.choose_checkpointing("auto", est, int(32 / 0.85 * memory.GB) - memory.GB)[0] is True
    assert memory.choose_checkpointing(False, est, 8 * memory.GB)[0] is False  # the recipe's own value wins
    assert memory.choose_checkpointing(True, est, 139 * memory.GB)[0] is True


def test_cpu_device_memory_is_shared_by_the_local_ranks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    one = memory.device_memory_bytes()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert memory.device_memory_bytes() == pytest.approx(one / 2, rel=0.1)
    assert one > 0


def test_pairwise_and_prompt_stages_count_their_sequences():
    r = load_recipe(raw={"stage": "dpo", "data": {"max_length": 100},
                         "train": {"micro_batch_size": 3, "global_batch_size": 3}})
    assert memory.max_sequence_tokens(r, "pairwise") == (6, 100)
    r = load_recipe(raw={"stage": "grpo", "data": {"max_length": 100, "max_prompt_length": 60},
                         "train": {"micro_batch_size": 2, "global_batch_size": 8, "max_steps": 2},
                         "reward": {"function": "llmtune.rewards:gsm8k_reward"},
                         "grpo": {"rollout_batch_size": 8, "num_generations": 4}, "rollout": {"max_new_tokens": 30}})
    assert memory.max_sequence_tokens(r, "prompt") == (2, 90)


class _SFT:
    data_kind = "sft"


def lora_grads(model):
    inputs, labels = batch()
    model.train()
    masked_token_logps(model, inputs, labels)[0].sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("device_gb, expected", [(1e-6, True), (1e6, False)])
def test_runner_switches_checkpointing_from_the_estimate(monkeypatch, caplog, device_gb, expected):
    from llmtune.core.runner import plan_checkpointing
    from llmtune.models.adapters import checkpointing_enabled

    monkeypatch.setattr(memory, "device_memory_bytes", lambda: int(device_gb * memory.GB))
    model = lora_model()
    plan = plan_checkpointing(model, recipe(), _SFT(), world_size=1)
    assert checkpointing_enabled(model) is expected
    est = memory.estimate_training_memory(model, recipe(), "sft")
    assert plan["gradient_checkpointing"] is expected
    assert plan["memory_estimate_gb"] == round(est.total(expected) / memory.GB, 3)
    torch.testing.assert_close(lora_grads(model), lora_grads(lora_model()))  # recomputation changes no gradient


def test_recipe_value_is_kept(monkeypatch):
    from llmtune.core.runner import plan_checkpointing
    from llmtune.models.adapters import checkpointing_enabled

    monkeypatch.setattr(memory, "device_memory_bytes", lambda: 1)  # short, but the recipe says false
    model = lora_model()
    assert plan_checkpointing(model, recipe(gradient_checkpointing=False), _SFT(), 1)["gradient_checkpointing"] is False
    assert not checkpointing_enabled(model)


def bf16_lora_model(shared: bool = True):
    from llmtune.models.adapters import share_lora_inputs_under_autocast

    model = make_tiny_llama(make_tiny_tokenizer(), seed=0, hidden_size=64).to(torch.bfloat16)
    fuse_swiglu(model)
    recompute_norm_outputs(model)
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=16, target_modules="all-linear"))
    if shared:
        assert share_lora_inputs_under_autocast(model) == 14  # 7 linear layers x 2 decoder layers
    return model


def test_bf16_autocast_estimate_matches_saved_tensors():
    """bf16 weights, fp32 LoRA factors, autocast (precision.bf16): fp32 norm inputs and shared LoRA inputs are what
    autocast really keeps."""
    model = bf16_lora_model()
    assert next(p for p in model.parameters() if p.requires_grad).dtype == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        measured = saved_activation_bytes(model, checkpointing=False)
    est = memory.estimate_training_memory(model, recipe(precision={"bf16": True}), "sft")
    fp32 = memory.estimate_training_memory(model, recipe(), "sft")
    layers = measured["layer0"] + measured["layer1"]
    assert est.activations == pytest.approx(layers, rel=0.1)
    assert est.activations > fp32.activations / 2  # not simply half of the fp32 count: the copies are counted


def test_lora_layers_share_their_input_under_autocast_with_identical_gradients():
    results = []
    for shared in (False, True):
        model = bf16_lora_model(shared)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            saved = saved_activation_bytes(model, checkpointing=False)  # runs forward + backward
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((sum(saved.values()), grads))
    (peft_saved, peft_grads), (saved, grads) = results
    assert all(torch.equal(peft_grads[k], grads[k]) for k in grads)  # the same bf16 operands
    h, i, layers = 64, 128, 2
    # q, k, v share the norm output, o its input, gate and up theirs (norm outputs recomputed), down's input is
    # recomputed: 6 h + i fewer
    assert peft_saved - saved == layers * B * T * (6 * h + i) * 2
    model = bf16_lora_model()
    masked_token_logps(model, *batch())[0].sum().backward()  # no autocast: peft's cast is left on (fp32 factors)
    assert all(m.cast_input_dtype_enabled for m in model.modules() if hasattr(m, "cast_input_dtype_enabled"))


def test_ppo_keeps_two_passes_of_activations():
    one = memory.estimate_training_memory(lora_model(), recipe(), "sft")
    two = memory.estimate_training_memory(lora_model(), recipe(), "sft", passes=2)
    assert two.activations == 2 * one.activations
    assert two.activations_checkpointed - one.activations_checkpointed == B * T * 2 * 64 * 4  # layer inputs
    from llmtune.stages import STAGES

    assert STAGES["ppo"].trainer_class.value_forward and not getattr(STAGES["grpo"].trainer_class, "value_forward")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU peak (resident set)")
def test_reset_peak_memory_starts_a_new_cpu_peak():
    """peak_memory_gb covers a freed 1 GiB block until reset_peak_memory, and no longer after it."""
    block = torch.ones(memory.GB // 8, dtype=torch.float64)  # every page touched
    with_block = memory.peak_memory_gb()
    del block
    assert memory.peak_memory_gb() > with_block - 0.05  # a peak: freeing the block does not lower it
    memory.reset_peak_memory()
    assert memory.peak_memory_gb() < with_block - 0.75
