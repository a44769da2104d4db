"""Every model family of docs/models.md on a tiny model of transformers' own config class (llmtune.models.tiny):
the attention kernel chosen per model, what ``all-linear`` adapts (MoE experts and routers included), a merge that
really merges them, and the shared machinery that must not assume a Llama: padding-free batches, shared prompts,
the masked LM head, the memory estimate. The whole SFT -> DPO -> GRPO -> export chain of each family runs in
tests/integration/test_families_cli.py."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel

from llmtune.config import ModelConfig, PrecisionConfig, load_recipe
from llmtune.config.schema import AdapterConfig
from llmtune.core import memory
from llmtune.core.lm_head import masked_logits, masked_token_logps, pair_logps
from llmtune.models import ModelLoadError, load_model
from llmtune.models.adapters import attach_adapter
from llmtune.models.checks import model_fit_problems
from llmtune.models.tiny import FAMILIES, make_tiny_model, make_tiny_tokenizer, save_tiny_model
from llmtune.rl.forward import response_token_logps
from llmtune.rl.model import PolicyModel
from llmtune.rl.types import join
from llmtune.stages import SFTStage

MOE = {"qwen3_moe": ("mlp.experts", "mlp.gate"), "gpt_oss": ("mlp.experts", "mlp.router"),
       "granitemoe": ("block_sparse_moe.experts", "block_sparse_moe.router"), "mixtral": ("mlp.experts", "mlp.gate")}
WINDOWED = {"gpt_oss", "mistral", "gemma3_text"}  # sliding windows of 8 tokens in their tiny configs


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer(pad_equals_eos=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a saved tiny model directory (made on first use)."""
    root, dirs = tmp_path_factory.mktemp("families"), {}

    def get(family):
        if family not in dirs:
            dirs[family] = save_tiny_model(root / family, family=family)
        return dirs[family]
    return get


def lora(family, tok, dropout=0.0, **adapter):
    """The family's tiny model with llmtune's all-linear adapter, random B (the adapter changes the outputs)."""
    model = attach_adapter(make_tiny_model(family, tok), AdapterConfig(lora_r=4, lora_alpha=8, lora_dropout=dropout,
                                                                        **adapter),
                           gradient_checkpointing=False, quantized=False)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return model.eval()


def adapted_weights(model) -> set[str]:
    """Base parameter names an adapter changes: lora.Linear base weights and ParamWrapper parameters."""
    from peft.tuners.lora.layer import Linear, ParamWrapper

    out = set()
    for name, module in model.base_model.model.named_modules():
        plain = name.replace(".base_layer", "")
        if isinstance(module, ParamWrapper):
            out.add(f"{plain}.{module.parameter_name}")
        elif isinstance(module, Linear):
            out.add(f"{plain}.weight")
    return out


# ---- attention ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_auto_attention_is_what_the_model_supports(saved, family):
    model = load_model(ModelConfig(name_or_path=str(saved(family))), PrecisionConfig())
    assert ModelConfig().attn_implementation == "auto"
    assert model.config._attn_implementation == ("eager" if family == "gpt_oss" else "sdpa")


def test_an_attention_kernel_the_model_cannot_run_is_one_error_naming_what_it_can(saved, tmp_path, capsys):
    with pytest.raises(ModelLoadError) as err:
        load_model(ModelConfig(name_or_path=str(saved("gpt_oss")), attn_implementation="sdpa"), PrecisionConfig())
    message = str(err.value)
    assert message.startswith("model.attn_implementation: 'sdpa' is not an attention kernel GptOssForCausalLM")
    assert "it supports eager, flash_attention_2, flash_attention_3, flex_attention" in message
    assert "\n" not in message and "Traceback" not in message
    recipe = load_recipe(raw={"stage": "sft", "model": {"name_or_path": str(saved("gpt_oss")),
                                                        "attn_implementation": "sdpa"}})
    problems = dict(model_fit_problems(recipe, None))
    assert "supports eager" in problems["model.attn_implementation"]
    ok = load_recipe(raw={"stage": "sft", "model": {"name_or_path": str(saved("gpt_oss")),
                                                    "attn_implementation": "eager"}})
    assert "model.attn_implementation" not in dict(model_fit_problems(ok, None))


# ---- what all-linear adapts -----------------------------------------------------------------------------------

@pytest.mark.parametrize("family", FAMILIES)
def test_all_linear_adapts_every_linear_map(tok, family):
    """Every weight matrix of the decoder (attention, MLP, MoE experts stored as 3-D parameters, MoE routers) is
    adapted; embeddings, the LM head, norms and biases are not. Each adapted matrix gets a gradient."""
    model = lora(family, tok)
    base = model.base_model.model
    expected = {n.replace(".base_layer", "") for n, p in base.named_parameters()
                if p.dim() >= 2 and "lora_" not in n and "embed" not in n and "lm_head" not in n
                and not n.endswith("bias")}  # gpt-oss's expert biases (experts, out) are 2-D
    assert adapted_weights(model) == expected
    if family in MOE:
        experts, router = MOE[family]
        assert {f"model.layers.0.{experts}.gate_up_proj", f"model.layers.0.{experts}.down_proj",
                f"model.layers.0.{router}.weight"} <= expected
    model.train()
    ids = torch.randint(5, 300, (2, 10))
    model(input_ids=ids, labels=ids).loss.backward()
    starved = [n for n, p in model.named_parameters() if p.requires_grad and "lora_B" in n
               and (p.grad is None or p.grad.abs().sum() == 0)]
    assert not starved


@pytest.mark.parametrize("family", sorted(MOE))
def test_the_router_can_be_left_out(tok, family):
    experts, router = MOE[family]
    model = lora(family, tok, exclude_modules=[router.rsplit(".", 1)[-1]])
    adapted = adapted_weights(model)
    assert f"model.layers.0.{experts}.down_proj" in adapted
    assert not any(router in name for name in adapted)


@pytest.mark.parametrize("family", sorted(MOE))
def test_dropout_stays_on_the_linear_layers_of_a_moe_adapter(tok, family):
    """peft cannot drop out a parameter's input: the experts take none, the linear layers keep lora_dropout."""
    from peft.tuners.lora.layer import Linear, ParamWrapper

    model = lora(family, tok, dropout=0.1)
    layers = [m for m in model.modules() if isinstance(m, (Linear, ParamWrapper))]
    assert {type(m.lora_dropout["default"]).__name__ for m in layers if isinstance(m, Linear)} == {"Dropout"}
    assert {type(m.lora_dropout["default"]).__name__ for m in layers if isinstance(m, ParamWrapper)} == {"Identity"}
    assert model.peft_config["default"].lora_dropout == 0.0  # the saved config loads in plain peft


@pytest.mark.parametrize("family", sorted(MOE))
def test_checkpointing_gives_the_expert_adapters_the_same_gradients(tok, family):
    """The expert and router adapters are applied inside the layer's forward (a parametrization of the stacked
    weight): llmtune's non-reentrant checkpointing recomputes them with the same result."""
    def gradients(checkpointing):
        model = make_tiny_model(family, tok)
        model = attach_adapter(model, AdapterConfig(lora_r=4, lora_alpha=8, lora_dropout=0.0),
                               gradient_checkpointing=checkpointing, quantized=False)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        model.train()
        ids = torch.randint(5, 300, (2, 10), generator=torch.Generator().manual_seed(0))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys() and any(".experts." in n for n in plain)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_adapter_loads_in_plain_peft_and_merges_into_the_weights(tok, family, tmp_path):
    model = lora(family, tok)
    ids = torch.randint(5, 300, (2, 12))
    with torch.no_grad():
        want = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    plain = PeftModel.from_pretrained(make_tiny_model(family, tok), tmp_path).eval()
    base = {n: p.clone() for n, p in make_tiny_model(family, tok).named_parameters()}
    merged = plain.merge_and_unload()
    with torch.no_grad():
        got = merged(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    changed = {n for n, p in merged.named_parameters() if not torch.equal(p, base[n])}
    assert changed == adapted_weights(model)  # the expert stacks and the router merged too, not only attention


# ---- the shared machinery on each family ----------------------------------------------------------------------

def padded_batch(gen, B=3, T=30):
    ids = torch.randint(5, 300, (B, T), generator=gen)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, 22:], mask[2, 15:] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :4] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_free_sft_batches_give_the_padded_log_probs(tok, family):
    """Rows of 15-30 tokens, longer than the 8-token windows of Mistral, Gemma 3 and gpt-oss: the padding-free batch
    keeps each row's window (SDPA families) or falls back to padding (gpt-oss, whose masks ignore position ids)."""
    batch = padded_batch(torch.Generator().manual_seed(0))
    model = lora(family, tok)
    with torch.no_grad():
        want, _ = masked_token_logps(model, batch, batch["labels"])
    stage = SFTStage(load_recipe(raw={"stage": "sft"}))
    from llmtune.core.padding_free import PaddingFreeCollator

    stage._collator = PaddingFreeCollator()
    stage.prepare_model(model.get_base_model(), tok)
    rows = [{"input_ids": batch["input_ids"][i, :k], "labels": batch["labels"][i, :k]}
            for i, k in enumerate(batch["attention_mask"].sum(-1).tolist())]
    collated = stage._collator(rows)
    assert ("position_ids" in collated) == (family != "gpt_oss")
    with torch.no_grad():
        got, _ = masked_token_logps(model, collated, collated["labels"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family, kernel", [("llama", "eager"), ("gemma3_text", "eager"), ("gpt_oss", "eager")])
def test_packing_is_refused_only_where_packed_rows_would_attend_to_each_other(tok, family, kernel):
    """transformers keeps packed rows apart from their position ids for eager attention too; gpt-oss's model code
    builds its masks without them: packing is an error there (found by asking the model), accepted elsewhere."""
    from llmtune.config import RecipeError

    stage = SFTStage(load_recipe(raw={"stage": "sft", "data": {"packing": True},
                                      "model": {"attn_implementation": kernel}}))
    model = make_tiny_model(family, tok)
    model.config._attn_implementation = kernel
    if family == "gpt_oss":
        with pytest.raises(RecipeError, match="data.packing: GptOssForCausalLM with eager attention lets packed rows"):
            stage.prepare_model(model, tok)
    else:
        stage.prepare_model(model, tok)


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prompt_pairs_and_groups_give_the_log_probs_of_separate_rows(tok, family):
    gen = torch.Generator().manual_seed(3)
    model = lora(family, tok)
    T = 30
    ids = torch.randint(5, 300, (4, T), generator=gen)
    ids[2, :12], ids[3, :12] = ids[0, :12], ids[1, :12]
    mask = torch.ones(4, T, dtype=torch.long)
    mask[1, 25:], mask[3, 20:] = 0, 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :12] = -100
    pairs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    with torch.no_grad():
        shared, plain = pair_logps(model, pairs, share_prompt=True), pair_logps(model, pairs, share_prompt=False)
    for a, b in zip(shared, plain):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    policy = PolicyModel(model)
    prompts = torch.randint(5, 300, (2, 14), generator=gen).repeat_interleave(2, 0)
    responses = torch.randint(5, 300, (4, 16), generator=gen)
    rmask = (torch.arange(16)[None] < torch.tensor([16, 12, 9, 16])[:, None]).long()
    inputs = join(prompts, torch.ones_like(prompts), responses, rmask)
    with torch.no_grad():
        full = response_token_logps(policy.policy_logits(**inputs, response_width=16), responses, 1.0) * rmask
        got = policy.response_logps(**inputs, responses=responses, response_mask=rmask).logps
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_masked_head_gives_the_full_logits(tok, family):
    """Gemma 3's final-logit softcapping (0.5 in the tiny config) and Granite's logit scaling stay in the model's own
    forward, which the masked head goes through; a tied Gemma 3 head too. Equal up to float32 rounding (atol 1e-6):
    the head's matmul over the kept rows only may block its sums differently from the full one (9e-8 apart with 2
    threads on an AMD EPYC); a lost softcap or logit scale moves the logits by far more."""
    model = make_tiny_model(family, tok).eval()
    ids = torch.randint(5, 300, (2, 12))
    keep = torch.rand(2, 12, generator=torch.Generator().manual_seed(0)) > 0.5
    with torch.no_grad():
        want = model(input_ids=ids).logits[keep]
        got = masked_logits(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, keep)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", FAMILIES)
def test_memory_estimate_counts_moe_experts_and_extra_norms(tok, family):
    """The activation estimate against the tensors autograd really keeps (tests/unit/core/test_memory.py's meter):
    MoE experts (top-k tokens per expert, and the merged expert stack an adapter on them materialises per layer)
    and Gemma 3's four norms per layer included; within 25 % (gpt-oss's clamped activation keeps a few more)."""
    from llmtune.core.fused import fuse_swiglu, recompute_norm_outputs
    from tests.unit.core import test_memory as meter

    model = make_tiny_model(family, tok, hidden_size=64)
    fuse_swiglu(model)
    recompute_norm_outputs(model)
    model = attach_adapter(model, AdapterConfig(lora_r=meter.R, lora_alpha=16, lora_dropout=0.0),
                           gradient_checkpointing=False, quantized=False)
    measured = sum(meter.saved_activation_bytes(model, checkpointing=False).values())
    est = memory.estimate_training_memory(model, meter.recipe(), "sft")
    assert est.activations + est.head == pytest.approx(measured, rel=0.25)


# ---- recipes the model cannot run, found before training ------------------------------------------------------

def test_dora_and_vllm_on_moe_experts_are_refused_up_front(saved):
    path = str(saved("qwen3_moe"))
    dora = load_recipe(raw={"stage": "sft", "model": {"name_or_path": path}, "adapter": {"use_dora": True}})
    assert "DoRA cannot adapt weights stored as parameters" in dict(model_fit_problems(dora, None))["adapter.use_dora"]
    rl = {"stage": "grpo", "rollout": {"engine": "vllm"}, "reward": {"function": "llmtune.rewards:format_reward"},
          "train": {"max_steps": 2}}
    vllm = load_recipe(raw={**rl, "model": {"name_or_path": path}})
    problems = [m for k, m in model_fit_problems(vllm, None, stage="grpo") if k == "rollout.engine"]
    assert any("adapter.exclude_modules: [mlp.experts, mlp.gate]" in m for m in problems)
    excluded = vllm.model_copy(update={"adapter": vllm.adapter.model_copy(
        update={"exclude_modules": ["mlp.experts", "mlp.gate"], "use_dora": False})})
    rest = [m for k, m in model_fit_problems(excluded, None, stage="grpo") if k == "rollout.engine"]
    assert not any("all-linear adapts" in m for m in rest)
    assert all("CPU build" in m for m in rest)  # a MoE model on vLLM's CPU build: refused whatever the adapter
    dense = load_recipe(raw={**rl, "model": {"name_or_path": str(saved("qwen3"))}})
    assert not [k for k, _ in model_fit_problems(dense, None, stage="grpo") if k == "rollout.engine"]
    typo = load_recipe(raw={"stage": "sft", "model": {"name_or_path": path}, "adapter": {"exclude_modules": ["rooter"]}})
    assert "matches no module" in dict(model_fit_problems(typo, None))["adapter.exclude_modules.0"]


@pytest.mark.parametrize("family", ["granite", "granitemoe", "qwen3"])
def test_a_reward_model_on_a_family_without_a_score_class_is_refused_up_front(saved, family):
    recipe = load_recipe(raw={"stage": "rm", "model": {"name_or_path": str(saved(family))}})
    problems = dict(model_fit_problems(recipe, None, head="score", stage="rm"))
    if family == "qwen3":
        assert "model.name_or_path" not in problems
    else:
        assert "no sequence-classification class" in problems["model.name_or_path"]
