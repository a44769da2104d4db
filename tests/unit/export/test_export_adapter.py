"""llmtune export --adapter on fabricated run chains around a tiny Llama: one adapter equal to the whole chain on the
original base (ranks, alphas, targets, rsLoRA and modules_to_save differing per link), loaded with plain peft, and
the chains that cannot be folded exactly (DoRA, LoRA on a module an earlier link trained in full)."""

import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmtune.commands.cli import main
from llmtune.config import dump_recipe, load_recipe
from llmtune.export.merge import ExportError
from llmtune.export.adapter import concatenate_chain, export_adapter
from llmtune.models.tiny import save_tiny_model

IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 1, 64, 12]])


def write_run(root, base_dir, peft_model, tokenizer, *, stage, previous=()):
    stage = stage.rstrip("0123456789")  # dpo2 = a second DPO run
    """adapter/ + tokenizer, recipe.resolved.yaml and lineage.json as llmtune.core.runner writes them."""
    peft_model.save_pretrained(root / "adapter")
    tokenizer.save_pretrained(root / "adapter")
    raw = {"stage": stage, "model": {"name_or_path": str(base_dir)}, "output": {"dir": str(root)}}
    dump_recipe(load_recipe(raw=raw, stage=stage), root / "recipe.resolved.yaml")
    lineage = {"stage": stage, "base_model": {"name_or_path": str(base_dir), "kind": "local", "path": str(base_dir)},
               "previous_adapters": list(previous), "model_head": "causal_lm", "adapter": "adapter",
               "adapter_type": "lora", "data": [], "summary": {"steps": 1}}
    (root / "lineage.json").write_text(json.dumps(lineage))
    return {"stage": stage, "run_dir": str(root), "path": str(root / "adapter"), "adapter_type": "lora"}


def trained_lora(model, seed, **config):
    """A LoRA with random non-zero A and B (B scaled up so every link visibly changes the logits)."""
    torch.manual_seed(seed)
    peft = get_peft_model(model, LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", **config))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(4)
            if "modules_to_save" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return peft.eval()


def build_chain(root, links):
    """Train-free chain: each link's LoRA is attached to the base with the earlier links merged (as from_run does)."""
    base_dir = save_tiny_model(root / "base")
    tok = AutoTokenizer.from_pretrained(base_dir)
    previous, model = [], AutoModelForCausalLM.from_pretrained(base_dir)
    for i, (stage, config) in enumerate(links):
        peft = trained_lora(model, seed=i + 1, **config)
        previous.append(write_run(root / stage, base_dir, peft, tok, stage=stage, previous=list(previous)))
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), root / links[0][0] / "adapter")
        model = model.merge_and_unload()
        for s, _ in links[1:i + 1]:
            model = PeftModel.from_pretrained(model, root / s / "adapter").merge_and_unload()
    return base_dir, root / links[-1][0]


@torch.no_grad()
def logits_of(model):
    return model(input_ids=IDS).logits.float()


def test_three_link_chain_folds_into_one_adapter_that_plain_peft_loads(tmp_path):
    links = [("sft", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])),
             ("dpo", dict(r=2, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "o_proj", "down_proj"])),
             ("dpo2", dict(r=3, lora_alpha=3, target_modules="all-linear", modules_to_save=["lm_head"]))]
    base_dir, run = build_chain(tmp_path, links)
    assert main(["export", str(run), "--adapter"]) == 0
    out = run / "exported_adapter"
    report = json.loads((out / "verification.json").read_text())
    assert report["passed"] and report["rank"] == 4 + 2 + 3  # q_proj is in every link
    assert report["max_abs_diff"] < 1e-4

    # independent reference: the chain merged link by link in fp32 with peft itself
    expected = AutoModelForCausalLM.from_pretrained(base_dir)
    for stage, _ in links:
        expected = PeftModel.from_pretrained(expected, run.parent / stage / "adapter").merge_and_unload()
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out)
    assert torch.allclose(logits_of(plain), logits_of(expected), atol=1e-4)
    # what the issue saw: the run's own adapter on the plain base is another model
    alone = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), run / "adapter")
    assert (logits_of(alone) - logits_of(expected)).abs().max() > 1e-1
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 9 and not config["use_rslora"]
    assert config["modules_to_save"] == ["lm_head"]
    assert config["base_model_name_or_path"] == str(base_dir.resolve())
    card = (out / "README.md").read_text()
    assert f"base_model: {base_dir.resolve()}" in card and "sft -> dpo -> dpo" in card


def test_full_copy_supersedes_earlier_lora_updates_of_that_module(tmp_path):
    """Link 2 trains v_proj of layer 0 in full starting from link 1's merged weight: link 1's v_proj update of that
    layer must not be added again."""
    links = [("sft", dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])),
             ("dpo", dict(r=2, lora_alpha=4, target_modules=["k_proj"], modules_to_save=["layers.0.self_attn.v_proj"]))]
    base_dir, run = build_chain(tmp_path, links)
    report = export_adapter(run)
    assert report["passed"], report
    expected = AutoModelForCausalLM.from_pretrained(base_dir)
    for stage, _ in links:
        expected = PeftModel.from_pretrained(expected, run.parent / stage / "adapter").merge_and_unload()
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), run / "exported_adapter")
    assert torch.allclose(logits_of(plain), logits_of(expected), atol=1e-4)


def _links(*configs):
    return [({"r": 2, "lora_alpha": 4, "peft_type": "LORA", **c}, {}) for c in configs]


def test_chains_that_are_not_one_lora_are_refused():
    with pytest.raises(ExportError, match="DoRA"):
        concatenate_chain(_links({}, {"use_dora": True}))
    with pytest.raises(ExportError, match="rank_pattern"):
        concatenate_chain(_links({"rank_pattern": {"q_proj": 8}}, {}))
    a, b = torch.ones(2, 4), torch.ones(4, 2)
    first = ({"r": 2, "lora_alpha": 4, "modules_to_save": ["lm_head"]}, {"base_model.model.lm_head.weight": b})
    second = ({"r": 2, "lora_alpha": 4}, {"base_model.model.lm_head.lora_A.weight": a,
                                          "base_model.model.lm_head.lora_B.weight": b})
    with pytest.raises(ExportError, match="after an earlier link trained it in full"):
        concatenate_chain([first, second])


def test_concatenation_is_the_scaled_sum_with_zero_padding():
    """Hand-built: module m in both links (r 2 + 1), module n only in the second (padded with zeros to rank 3)."""
    g = torch.Generator().manual_seed(0)
    a1, b1 = torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    a2, b2 = torch.randn(1, 5, generator=g), torch.randn(6, 1, generator=g)
    an, bn = torch.randn(1, 5, generator=g), torch.randn(6, 1, generator=g)
    p = "base_model.model."
    links = [({"r": 2, "lora_alpha": 8}, {f"{p}m.lora_A.weight": a1, f"{p}m.lora_B.weight": b1}),
             ({"r": 1, "lora_alpha": 3, "use_rslora": True},
              {f"{p}m.lora_A.weight": a2, f"{p}m.lora_B.weight": b2, f"{p}n.lora_A.weight": an,
               f"{p}n.lora_B.weight": bn})]
    config, tensors, _ = concatenate_chain(links)
    assert config["r"] == 3 and config["lora_alpha"] == 3 and config["target_modules"] == ["m", "n"]
    delta_m = tensors[f"{p}m.lora_B.weight"] @ tensors[f"{p}m.lora_A.weight"]
    assert torch.allclose(delta_m, 4.0 * b1 @ a1 + 3.0 * b2 @ a2, atol=1e-6)  # alpha/r = 4, alpha/sqrt(r) = 3
    assert tensors[f"{p}n.lora_A.weight"].shape == (3, 5)
    assert torch.allclose(tensors[f"{p}n.lora_B.weight"] @ tensors[f"{p}n.lora_A.weight"], 3.0 * bn @ an, atol=1e-6)


def test_out_dir_that_holds_something_else_is_refused(tmp_path):
    links = [("sft", dict(r=2, lora_alpha=4, target_modules=["q_proj"])),
             ("dpo", dict(r=2, lora_alpha=4, target_modules=["v_proj"]))]
    _, run = build_chain(tmp_path, links)
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ExportError, match="not an earlier exported adapter"):
        export_adapter(run, out_dir=other)
    assert (other / "notes.txt").read_text() == "keep me"
    assert export_adapter(run)["passed"] and export_adapter(run)["passed"]  # a rerun replaces its own output
