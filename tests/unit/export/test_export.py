"""llmtune export on fabricated run directories (written the way the runner writes them) around tiny Llamas:
fp32 chain merge with one cast, QLoRA dequantize-then-merge, tied/resized embeddings and modules_to_save, PPO's
extra value adapter, model card, greedy generations, shards, failing verification."""

import json

import pytest
import torch
import yaml
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmtune.commands.cli import main
from llmtune.config import dump_recipe, load_recipe
from llmtune.export.merge import (
    TOLERANCE,
    ExportError,
    compare_generations,
    dequantize_to_fp32,
    export_run,
    refuse_quantized_merge,
    template_eos_ids,
    untie_diverged_embeddings,
)
from llmtune.models import ModelLoadError, load_model
from llmtune.models.tiny import make_tiny_tokenizer, save_tiny_model

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 1]])


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    return {"untied": save_tiny_model(root / "untied"),
            "tied": save_tiny_model(root / "tied", tie_word_embeddings=True),
            "h64": save_tiny_model(root / "h64", hidden_size=64)}


def write_run(root, base_dir, peft_model, tokenizer, *, stage="sft", head="causal_lm", previous=(), model_extra=None,
              recipe_extra=None, data=None, summary=None, save_embedding_layers="auto"):
    """adapter/ + tokenizer, recipe.resolved.yaml and lineage.json as llmtune.core.runner writes them."""
    peft_model.save_pretrained(root / "adapter", save_embedding_layers=save_embedding_layers)
    tokenizer.save_pretrained(root / "adapter")
    raw = {"stage": stage, "model": {"name_or_path": str(base_dir), **(model_extra or {})},
           "output": {"dir": str(root)}, **(recipe_extra or {})}
    dump_recipe(load_recipe(raw=raw, stage=stage), root / "recipe.resolved.yaml")
    lineage = {"stage": stage, "base_model": {"name_or_path": str(base_dir), "kind": "local", "path": str(base_dir)},
               "from_run": previous[-1]["run_dir"] if previous else None, "previous_adapters": list(previous),
               "model_head": head, "adapter": "adapter", "adapter_type": "lora", "data": data or [],
               "summary": summary or {}}
    (root / "lineage.json").write_text(json.dumps(lineage))
    return root


def lora(model, targets, seed, *, scale_b=1.0, **kwargs):
    """A LoRA with random (non-zero) A and B, B scaled so the update is visible after rounding."""
    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False,
                                            task_type="CAUSAL_LM", **kwargs))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(scale_b)
    return peft.eval()


def delta(peft, name, adapter="default"):
    """``scale * B @ A`` (fp32) of the LoRA on module ``name`` (e.g. ``model.layers.0.self_attn.q_proj``)."""
    layer = peft.base_model.model.get_submodule(name)
    return (layer.lora_B[adapter].weight @ layer.lora_A[adapter].weight) * layer.scaling[adapter]


@pytest.fixture(scope="module")
def chain(bases, tmp_path_factory):
    """SFT run (LoRA on q/v) then a DPO-like run (LoRA on q/o/down) trained on the SFT-merged model."""
    root = tmp_path_factory.mktemp("chain")
    base_dir, tok = bases["untied"], AutoTokenizer.from_pretrained(bases["untied"])
    sft = lora(AutoModelForCausalLM.from_pretrained(base_dir), ["q_proj", "v_proj"], seed=1, scale_b=30)
    data = [{"path": "sft.jsonl", "location": "/d/sft.jsonl", "format": "messages", "rows_read": 24,
             "sha256": "ab" * 32}]
    summary = {"steps": 2, "train_loss": 2.5,
               "eval_before": {"eval_loss": 6.0, "eval_runtime": 0.1, "eval_model_preparation_time": 0.03},
               "eval_after": {"eval_loss": 5.25, "eval_samples_per_second": 9.0}}
    sft_run = write_run(root / "sft", base_dir, sft, tok, data=data, summary=summary)
    first = {"stage": "sft", "run_dir": str(sft_run), "path": str(sft_run / "adapter"), "adapter_type": "lora"}
    merged_sft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), sft_run / "adapter")
    merged_sft = merged_sft.merge_and_unload()
    dpo = lora(merged_sft, ["q_proj", "o_proj", "down_proj"], seed=2, scale_b=30)
    dpo_data = [{"path": "pairs.jsonl", "location": "/d/pairs.jsonl", "format": "preference", "rows_read": 12,
                 "sha256": "cd" * 32}]
    dpo_run = write_run(root / "dpo", base_dir, dpo, tok, stage="dpo", previous=[first], data=dpo_data,
                        summary={"steps": 2, "train_loss": 0.69,
                                 "eval_after": {"eval_loss": 0.6, "eval_rewards/accuracies": 0.75}})
    return {"base": base_dir, "sft": sft, "dpo": dpo, "run": dpo_run}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_chain_merge_is_fp32_sum_rounded_once_and_differs_from_a_naive_merge(chain, tmp_path, dtype):
    out = tmp_path / dtype
    report = export_run(chain["run"], dtype=dtype, out_dir=out)
    assert report["passed"] and len(report["merged_adapters"]) == 2
    saved = load_file(str(out / "model.safetensors"))
    base = load_file(str(chain["base"] / "model.safetensors"))
    assert saved.keys() == base.keys()
    target = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    adapted = 0
    for key, weight in saved.items():
        module = key.removesuffix(".weight")
        expected = base[key]
        for peft in (chain["sft"], chain["dpo"]):  # in chain order, fp32
            if hasattr(peft.base_model.model.get_submodule(module), "lora_A"):
                expected = expected + delta(peft, module).detach()
                adapted += 1
        assert weight.dtype == target and torch.equal(weight, expected.to(target)), key
    assert adapted == 2 * 2 + 2 * 3  # q,v of the SFT and q,o,down of the DPO link, in both layers

    # a naive merge in the output dtype (each link merged into already-rounded weights) lands elsewhere
    naive = AutoModelForCausalLM.from_pretrained(chain["base"], dtype=target)
    for run in (chain["run"].parent / "sft", chain["run"]):
        naive = PeftModel.from_pretrained(naive, run / "adapter").merge_and_unload()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(naive.state_dict()[q], saved[q])
    assert int((naive.state_dict()[q] != saved[q]).sum()) > 10


def test_fp32_export_matches_logits_and_greedy_generations_and_writes_the_model_card(chain, tmp_path):
    out = tmp_path / "fp32"
    assert main(["export", str(chain["run"]), "--dtype", "fp32", "--out", str(out)]) == 0
    report = json.loads((out / "verification.json").read_text())
    assert report["passed"] and report["max_abs_diff"] <= 1e-4
    assert report["base"]["weights"] == "fp32 base with 1 earlier adapter(s) merged in fp32"
    assert len(report["generations"]) == 3 and report["generation_agreement"] == 1.0
    assert all(g["match"] and g["adapter_text"] == g["merged_text"] for g in report["generations"])
    merged = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():  # the trained model: SFT merged, DPO adapter on top
        torch.testing.assert_close(merged(input_ids=IDS).logits, chain["dpo"](input_ids=IDS).logits, atol=1e-5, rtol=0)

    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["library_name"] == "transformers" and front["base_model"] == str(chain["base"])
    assert front["tags"][:3] == ["llmtune", "sft", "dpo"]
    body = card.split("---", 2)[2]
    sft_at, dpo_at = body.index("### 1. sft"), body.index("### 2. dpo")
    assert sft_at < dpo_at and str(chain["run"].parent / "sft") in body[sft_at:dpo_at]
    assert "ab" * 32 in body[sft_at:dpo_at] and "cd" * 32 in body[dpo_at:]
    assert "eval_before: eval_loss 6" in body and "eval_after: eval_loss 5.25" in body
    assert "runtime" not in body and "preparation" not in body
    assert "eval_rewards/accuracies 0.75" in body and "**fp32**" in body and "PASSED" in body


def test_sharded_output_reloads(bases, tmp_path):
    base_dir, tok = bases["h64"], AutoTokenizer.from_pretrained(bases["h64"])
    peft = lora(AutoModelForCausalLM.from_pretrained(base_dir), ["q_proj", "v_proj"], seed=3)
    run = write_run(tmp_path / "run", base_dir, peft, tok)
    assert main(["export", str(run), "--max-shard-size", "100KB"]) == 0
    shards = sorted((run / "merged").glob("model-*.safetensors"))
    index = json.loads((run / "merged" / "model.safetensors.index.json").read_text())
    assert len(shards) >= 3 and set(index["weight_map"].values()) == {s.name for s in shards}
    merged = AutoModelForCausalLM.from_pretrained(run / "merged")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=IDS).logits, peft(input_ids=IDS).logits, atol=1e-5, rtol=0)


# ---- QLoRA ---------------------------------------------------------------------------------------------------

QLORA = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_compute_dtype": "fp32"}


@pytest.fixture(scope="module")
def qlora(bases, tmp_path_factory):
    """A run trained on the 4-bit base: LoRA attached to the quantized model exactly as the runner builds it."""
    root = tmp_path_factory.mktemp("qlora")
    base_dir, tok = bases["h64"], AutoTokenizer.from_pretrained(bases["h64"])
    recipe = load_recipe(raw={"model": {"name_or_path": str(base_dir), **QLORA}}, stage="sft")
    quantized = load_model(recipe.model, recipe.precision)
    peft = lora(quantized, ["q_proj", "v_proj"], seed=4)
    run = write_run(root / "run", base_dir, peft, tok, model_extra=QLORA)
    return {"run": run, "base": base_dir, "peft": peft, "recipe": recipe}


def test_qlora_export_merges_into_the_dequantized_base_and_matches_the_quantized_adapter_model(qlora, tmp_path):
    # few generated tokens: bitsandbytes' CPU 4-bit matmuls make every decoding step of the reference slow
    report = export_run(qlora["run"], dtype="fp32", out_dir=tmp_path / "fp32", max_new_tokens=4)
    assert report["passed"] and "4-bit nf4" in report["base"]["weights"] and "dequantized" in report["base"]["weights"]
    assert report["generation_agreement"] == 1.0
    saved = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    layer = qlora["peft"].base_model.model.model.layers[1].self_attn.q_proj
    import bitsandbytes.functional as bnbf
    import copy

    state = copy.copy(layer.base_layer.weight.quant_state)
    state.dtype = torch.float32
    dequantized = bnbf.dequantize_4bit(layer.base_layer.weight.data, state)
    expected = dequantized + delta(qlora["peft"], "model.layers.1.self_attn.q_proj").detach()
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(saved[q], expected)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32")
    naive = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(qlora["base"]), qlora["run"] / "adapter")
    naive = naive.merge_and_unload()  # into the original weights, which the adapter never saw
    with torch.no_grad():  # the model the adapter was trained on: 4-bit base + adapter
        trained = qlora["peft"](input_ids=IDS).logits
        assert float((merged(input_ids=IDS).logits - trained).abs().max()) <= 1e-5
        assert float((naive(input_ids=IDS).logits - trained).abs().max()) > 1e-3

    report = export_run(qlora["run"], dtype="bf16", out_dir=tmp_path / "bf16", max_new_tokens=1)
    assert report["passed"] and report["base"]["compute_dtype"] == "fp32"
    assert torch.equal(load_file(str(tmp_path / "bf16" / "model.safetensors"))[q], expected.to(torch.bfloat16))


def test_a_bf16_compute_qlora_export_is_checked_at_fp32_tolerance_against_the_model_in_fp32(bases, tmp_path):
    """The trained model's 4-bit layers compute in bf16; the merged fp32 model holds the same weights dequantized in
    fp32. Compared with the trained model's own function computed in fp32 (fp32_compute_4bit) the merge is held to
    the fp32 tolerance (old code compared with the bf16 computation at bf16's tolerance, 5e-2 + 4e-2 x max |logit|,
    which a wrong merge can pass); the bf16 difference is reported as trained_compute."""
    base_dir, tok = bases["h64"], AutoTokenizer.from_pretrained(bases["h64"])
    bf16 = {**QLORA, "bnb_4bit_compute_dtype": "bf16"}
    recipe = load_recipe(raw={"model": {"name_or_path": str(base_dir), **bf16}}, stage="sft")
    run = write_run(tmp_path / "run", base_dir, lora(load_model(recipe.model, recipe.precision), ["q_proj", "v_proj"],
                                                     seed=5), tok, model_extra=bf16)
    report = export_run(run, dtype="fp32", out_dir=tmp_path / "fp32", max_new_tokens=2)
    fp32_atol, fp32_rtol = TOLERANCE["fp32"]
    assert report["passed"] and report["base"]["compute_dtype"] == "bf16"
    assert report["tolerance"] == pytest.approx(fp32_atol + fp32_rtol * report["max_abs_logit"])
    assert report["max_abs_diff"] < 1e-4 < report["trained_compute"]["max_abs_diff"]


def test_a_chain_starting_with_a_qlora_run_merges_it_into_its_dequantized_base_like_export(qlora, tmp_path):
    """model.from_run of a QLoRA run (a DPO/RM/PPO stage after QLoRA SFT, the PPO reward model of a QLoRA RM run)
    continues the model that run trained and export wrote, not the adapter added to the original weights."""
    from llmtune.config import PrecisionConfig
    from llmtune.models import adapter_chain, load_model_with_chain

    run = qlora["run"]
    export_run(run, dtype="fp32", out_dir=tmp_path / "merged", max_new_tokens=1)
    exported = load_file(str(tmp_path / "merged" / "model.safetensors"))
    cfg = load_recipe(raw={"model": {"name_or_path": str(qlora["base"])}}, stage="dpo").model
    chained = load_model_with_chain(cfg, PrecisionConfig(), adapter_chain(run, json.loads(
        (run / "lineage.json").read_text())), dtype=torch.float32)
    state = chained.state_dict()
    assert exported.keys() <= state.keys()
    for name, weight in exported.items():  # old code: every adapted weight off by the 4-bit rounding of W
        assert torch.equal(state[name], weight), name


def test_8bit_run_merges_into_its_dequantized_int8_base(bases, tmp_path):
    import bitsandbytes.functional as bnbf

    base_dir, tok = bases["h64"], AutoTokenizer.from_pretrained(bases["h64"])
    recipe = load_recipe(raw={"model": {"name_or_path": str(base_dir), "load_in_8bit": True}}, stage="sft")
    peft = lora(load_model(recipe.model, recipe.precision), ["q_proj", "v_proj"], seed=9)
    run = write_run(tmp_path / "run", base_dir, peft, tok, model_extra={"load_in_8bit": True})
    report = export_run(run, dtype="fp32", max_new_tokens=4)
    assert report["passed"] and report["base"]["compute_dtype"] == "int8" and "8-bit" in report["base"]["weights"]
    q = "model.layers.0.self_attn.v_proj"
    weight = peft.base_model.model.get_submodule(q).base_layer.weight
    expected = bnbf.int8_vectorwise_dequant(weight.data, weight.SCB) + delta(peft, q).detach()
    assert torch.equal(load_file(str(run / "merged" / "model.safetensors"))[f"{q}.weight"], expected)


def test_merging_into_a_quantized_model_is_refused(qlora):
    with pytest.raises(ExportError, match="peft #2321"):
        refuse_quantized_merge(qlora["peft"])
    fresh = load_model(qlora["recipe"].model, qlora["recipe"].precision)
    plain = dequantize_to_fp32(fresh)
    refuse_quantized_merge(plain)  # dequantized: allowed
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    assert type(plain.model.layers[0].self_attn.q_proj).__name__ == "Linear"


# ---- embeddings: tied, resized, modules_to_save --------------------------------------------------------------

@pytest.mark.parametrize("base_kind,save,added", [("tied", ["embed_tokens", "lm_head"], 2), ("tied", ["lm_head"], 0),
                                                  ("untied", ["embed_tokens", "lm_head"], 2)])
def test_trained_embeddings_and_head_survive_the_reload(bases, tmp_path, base_kind, save, added):
    base_dir = bases[base_kind]
    tok = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    if added:
        tok.add_tokens(["<tool>", "<call>"])
        model.resize_token_embeddings(len(tok))
    peft = lora(model, ["q_proj", "v_proj"], seed=5, modules_to_save=save)
    with torch.no_grad():  # "training" changes the full copies
        for name, p in peft.named_parameters():
            if "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.5)
    run = write_run(tmp_path / "run", base_dir, peft, tok)
    assert main(["export", str(run)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(run / "merged")
    # the config must not claim tied weights: a loader honouring it (vLLM, transformers 4) would use the embedding
    # as the head and lose the trained head (peft #2777); both tensors are saved
    assert json.loads((run / "merged" / "config.json").read_text())["tie_word_embeddings"] is False
    saved = load_file(str(run / "merged" / "model.safetensors"))
    assert not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    assert merged.lm_head.weight.shape[0] == len(tok) and merged.lm_head.weight is not merged.model.embed_tokens.weight
    ids = torch.cat([IDS, torch.tensor([[len(tok) - 1]])], dim=1)  # an added token, if any
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, peft(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_untie_diverged_embeddings_only_unties_different_tensors(bases):
    model = AutoModelForCausalLM.from_pretrained(bases["tied"])
    assert untie_diverged_embeddings(model).config.tie_word_embeddings is True  # still one tensor
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() + 0.1)
    assert untie_diverged_embeddings(model).config.tie_word_embeddings is False


def test_resized_vocab_without_the_trained_head_is_a_clear_error(bases, tmp_path):
    tok = AutoTokenizer.from_pretrained(bases["untied"])
    tok.add_tokens(["<tool>"])
    model = AutoModelForCausalLM.from_pretrained(bases["untied"])
    model.resize_token_embeddings(len(tok))
    peft = lora(model, ["q_proj"], seed=6, modules_to_save=["embed_tokens"])
    # peft's default save_embedding_layers="auto" would save the resized head too; without it the head is lost
    run = write_run(tmp_path / "run", bases["untied"], peft, tok, save_embedding_layers=False)
    with pytest.raises(ModelLoadError, match="does not hold the output head lm_head"):
        export_run(run)


# ---- PPO: the policy adapter only ----------------------------------------------------------------------------

def test_ppo_run_merges_only_the_policy_adapter(bases, tmp_path):
    base_dir, tok = bases["untied"], AutoTokenizer.from_pretrained(bases["untied"])
    peft = lora(AutoModelForCausalLM.from_pretrained(base_dir), ["q_proj", "v_proj"], seed=7, scale_b=10)
    torch.manual_seed(8)
    peft.add_adapter("value", LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                         init_lora_weights=False))
    ppo = {"reward": {"function": "llmtune.rewards:gsm8k_reward"}, "train": {"max_steps": 4}}
    run = write_run(tmp_path / "run", base_dir, peft, tok, stage="ppo", recipe_extra=ppo)
    assert (run / "adapter" / "value" / "adapter_model.safetensors").is_file()  # as peft saves a second adapter
    report = export_run(run, dtype="fp32")
    assert report["passed"]
    q = "model.layers.0.self_attn.q_proj"
    saved = load_file(str(run / "merged" / "model.safetensors"))[f"{q}.weight"]
    base = load_file(str(base_dir / "model.safetensors"))[f"{q}.weight"]
    assert torch.equal(saved, base + delta(peft, q).detach())
    assert float((delta(peft, q, "value")).abs().max()) > 1e-3  # the value adapter would have changed it


# ---- verification fails when the merge is wrong --------------------------------------------------------------

def test_wrong_merge_fails_verification_and_the_command_exits_1(chain, tmp_path, monkeypatch):
    import llmtune.export.merge as export

    monkeypatch.setattr(export, "merge_in_fp32", lambda model, adapter_dir, frozen=(): model.unload())  # adapter dropped
    assert main(["export", str(chain["run"]), "--out", str(tmp_path / "bad")]) == 1
    report = json.loads((tmp_path / "bad" / "verification.json").read_text())
    assert not report["passed"] and report["max_abs_diff"] > report["tolerance"]
    assert "FAILED" in (tmp_path / "bad" / "README.md").read_text()


def test_compare_generations_separates_near_ties_from_real_differences():
    tok = make_tiny_tokenizer()
    logits = torch.zeros(3, len(tok))
    logits[1, 20], logits[1, 30] = 1.0, 1.0 - 5e-5  # the merged model took 30 where the adapter model took 20
    ref = [([10, 20, 11], logits), ([10, 20, 11], logits), ([10, 20, 11], logits)]
    got = [([10, 20, 11], None), ([10, 30, 12], None), ([10, 30, 12], None)]
    rows = compare_generations(ref, got, tok, tolerance=1e-4)
    assert rows[0]["match"] and "first_divergence" not in rows[0]
    assert not rows[1]["match"] and rows[1]["first_divergence"] == 1
    assert rows[1]["margin"] == pytest.approx(5e-5, rel=1e-3) and rows[1]["near_tie"]
    assert not compare_generations(ref[1:2], got[1:2], tok, tolerance=1e-5)[0]["near_tie"]


def test_template_eos_includes_the_turn_end_of_the_template():
    tok = make_tiny_tokenizer(template="llama2")  # EOS </s>
    from llmtune.models.tiny import CHATML_TEMPLATE

    tok.chat_template = CHATML_TEMPLATE  # turns end with <|im_end|>, which is not the tokenizer's EOS
    assert template_eos_ids(tok) == sorted({tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")})
    assert template_eos_ids(make_tiny_tokenizer(template="llama2")) == [tok.eos_token_id]
