"""Issue 32 §2: QLoRA SFT, then DPO / RM / PPO / GRPO on top of it, each QLoRA on the same 4-bit base, through the
CLI on a tiny Llama (bitsandbytes' CPU backend runs the 4-bit layers for real: nothing is stubbed).

The SFT adapter is stacked frozen under each new adapter (llmtune.models.adapters.stack_frozen_adapters), so every
stage starts from the SFT model and its reference IS the SFT model: DPO's held-out loss before training is exactly
log 2, PPO's and GRPO's first KL exactly 0. Export merges base + SFT + DPO into the dequantized base; the merged model
(plain transformers) and the exported adapter (plain peft on the base quantized with the BitsAndBytesConfig its card
shows) give the log-probs the trained model logged. `llmtune validate` reports what training refuses."""

import hashlib
import json
import math

import pytest
import torch
import yaml

from llmtune.commands.cli import main
from llmtune.models.tiny import save_tiny_model
from llmtune.utils import read_jsonl

pytestmark = pytest.mark.slow
pytest.importorskip("bitsandbytes")

Q4 = {"load_in_4bit": True, "bnb_4bit_compute_dtype": "fp32"}  # fp32 arithmetic: comparisons at fp32 tolerance
COMMON = {"adapter": {"lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0}}
QA = [("What is 2 + 3?", "It is 5. #### 5", "It is 7."), ("Say hello.", "Hello! How are you today?", "No."),
      ("What is 12 * 7?", "12 * 7 = 84. #### 84", "12 * 7 = 74."), ("Name a color.", "The sea is blue.", "Dog.")]
TRAIN = {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2}


def write_recipe(root, name, stage, **sections):
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"stage": stage, **sections}))
    return path


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("qlora_chain")
    model_dir = save_tiny_model(root / "model", hidden_size=64)
    pairs = [{"prompt": f"{q} ({i})", "chosen": c, "rejected": r} for i in range(5) for q, c, r in QA]
    (root / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    chats = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": c}]}
             for _ in range(4) for q, c, _ in QA]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chats))
    prompts = [{"prompt": f"What is {a} + {b}?", "completion": f"#### {a + b}"} for a in range(3) for b in range(4)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    pair_data = {"datasets": [{"path": str(root / "pairs.jsonl")}], "max_length": 64, "val_size": 4}
    chained = {"from_run": str(root / "sft"), **Q4}
    rl = {"datasets": [{"path": str(root / "prompts.jsonl")}], "max_length": 64}
    recipes = {
        "sft": write_recipe(root, "sft", "sft", model={"name_or_path": str(model_dir), **Q4},
                            data={"datasets": [{"path": str(root / "sft.jsonl")}], "max_length": 64},
                            train=TRAIN, output={"dir": str(root / "sft")}, **COMMON),
        "dpo": write_recipe(root, "dpo", "dpo", model=chained, data=pair_data, dpo={"beta": 0.1},
                            train={**TRAIN, "eval_steps": 1}, output={"dir": str(root / "dpo")}, **COMMON),
        "rm": write_recipe(root, "rm", "rm", model=chained, data=pair_data, train=TRAIN,
                           output={"dir": str(root / "rm")}, **COMMON),
        "ppo": write_recipe(root, "ppo", "ppo", model=chained, data=rl, reward={"function":
                            "llmtune.rewards:gsm8k_reward"}, ppo={"rollout_batch_size": 4, "ppo_epochs": 1},
                            rollout={"max_new_tokens": 6}, train={**TRAIN, "max_steps": 2},
                            output={"dir": str(root / "ppo")}, **COMMON),
        "grpo": write_recipe(root, "grpo", "grpo", model=chained, data=rl, reward={"function":
                             "llmtune.rewards:format_reward"}, grpo={"num_generations": 2, "rollout_batch_size": 4,
                                                                     "beta": 0.1},
                             rollout={"max_new_tokens": 6}, train={**TRAIN, "max_steps": 2},
                             output={"dir": str(root / "grpo")}, **COMMON),
    }
    assert main(["sft", str(recipes["sft"])]) == 0
    sft_adapter = digest(root / "sft" / "adapter" / "adapter_model.safetensors")
    for stage in ("dpo", "rm", "ppo", "grpo"):
        assert main([stage, str(recipes[stage])]) == 0, stage
    assert digest(root / "sft" / "adapter" / "adapter_model.safetensors") == sft_adapter
    return {"root": root, "recipes": recipes, "model": model_dir}


@pytest.mark.parametrize("stage", ["dpo", "rm", "ppo", "grpo"])
def test_each_stage_trains_on_the_stacked_sft_adapter_and_saves_only_its_own(ws, stage):
    run = ws["root"] / stage
    lineage = json.loads((run / "lineage.json").read_text())
    assert [e["stage"] for e in lineage["previous_adapters"]] == ["sft"] and lineage["summary"]["steps"] == 2
    assert lineage["base_model"]["quantization"]["config"]["load_in_4bit"] is True
    saved = {p.relative_to(run / "adapter").parts[0] for p in (run / "adapter").rglob("*")}
    assert not any("llmtune_chain" in name for name in saved)  # the SFT adapter is the SFT run's
    assert ("value" in saved) == (stage == "ppo")
    card = (run / "adapter" / "README.md").read_text()
    assert "unmerged on the quantized base" in card and "BitsAndBytesConfig(load_in_4bit=True" in card


def test_the_reference_is_the_sft_model(ws):
    """At the start the policy is base + SFT + a zero LoRA, and the reference base + SFT: the same model. Were the
    reference the bare 4-bit base (peft's disable_adapter), DPO's loss would not be log 2 and the KL not 0."""
    dpo = [r for r in read_jsonl(ws["root"] / "dpo" / "metrics.jsonl") if "eval_loss" in r]
    assert dpo[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6) and dpo[0]["eval_rewards/margins"] == 0.0
    assert dpo[-1]["eval_rewards/margins"] != 0.0  # and it trained
    for stage in ("ppo", "grpo"):
        rollouts = [r for r in read_jsonl(ws["root"] / stage / "metrics.jsonl") if "kl" in r]
        assert rollouts and rollouts[0]["kl"] == 0.0, stage


def test_rm_export_merges_the_chain_and_the_head(ws):
    assert main(["export", str(ws["root"] / "rm")]) == 0
    report = json.loads((ws["root"] / "rm" / "merged" / "verification.json").read_text())
    assert report["passed"] and report["newly_initialized"] == []
    assert report["merged_adapters"][0].endswith("sft/adapter")


def eval_logps(ws, model) -> tuple[float, float]:
    """Mean summed log-probs of the chosen and rejected completions of DPO's held-out pairs under ``model``,
    computed with plain torch (llmtune only tokenizes the pairs, exactly as the DPO run did)."""
    from transformers import AutoTokenizer

    from llmtune.config import load_recipe
    from llmtune.data import build_preference_data

    recipe = load_recipe(ws["recipes"]["dpo"], stage="dpo")
    tokenizer = AutoTokenizer.from_pretrained(ws["root"] / "dpo" / "adapter")
    rows = build_preference_data(recipe.data, tokenizer).eval
    sums = {"chosen": [], "rejected": []}
    with torch.no_grad():
        for row in rows:
            for side in sums:
                ids = torch.tensor([row[f"{side}_input_ids"]])
                labels = torch.tensor(row[f"{side}_labels"][1:])
                logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                keep = labels != -100
                sums[side].append(float(logp[keep].gather(-1, labels[keep, None]).sum()))
    return sum(sums["chosen"]) / len(rows), sum(sums["rejected"]) / len(rows)


def test_exported_model_and_adapter_reproduce_the_trained_dpo_model_outside_llmtune(ws):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    run = ws["root"] / "dpo"
    assert main(["export", str(run)]) == 0
    assert main(["export", str(run), "--adapter"]) == 0
    merged_report = json.loads((run / "merged" / "verification.json").read_text())
    adapter_report = json.loads((run / "exported_adapter" / "verification.json").read_text())
    assert merged_report["passed"] and merged_report["generation_agreement"] == 1.0
    assert adapter_report["passed"] and adapter_report["rank"] == 8  # SFT r 4 + DPO r 4
    last = [r for r in read_jsonl(run / "metrics.jsonl") if "eval_logps/chosen" in r][-1]  # the trained model
    trained = (last["eval_logps/chosen"], last["eval_logps/rejected"])

    merged = AutoModelForCausalLM.from_pretrained(run / "merged", dtype=torch.float32).eval()
    assert merged.config.to_dict().get("quantization_config") is None  # full precision, no bitsandbytes needed
    assert eval_logps(ws, merged) == pytest.approx(trained, abs=1e-3)

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)  # as the adapter's card says
    assert "bnb_4bit_quant_type='nf4', bnb_4bit_use_double_quant=True" in (run / "exported_adapter" /
                                                                           "README.md").read_text()
    card = (run / "exported_adapter" / "README.md").read_text()
    assert "module.support_avx512bf16_for_cpu = False" in card  # the card's fp32 route on AVX-512 BF16 CPUs

    def plain_base():  # as the card loads it: without the card's loop, bitsandbytes computes these layers in bf16
        base = AutoModelForCausalLM.from_pretrained(ws["model"], quantization_config=bnb, dtype=torch.float32)
        for module in base.modules():  # on a CPU with AVX-512 BF16 (1.5e-3 off the trained log-probs measured)
            if hasattr(module, "support_avx512bf16_for_cpu"):
                module.support_avx512bf16_for_cpu = False
        return base

    plain = PeftModel.from_pretrained(plain_base(), run / "exported_adapter").eval()
    assert eval_logps(ws, plain) == pytest.approx(trained, abs=1e-3)
    without_sft = PeftModel.from_pretrained(plain_base(), run / "adapter").eval()  # the DPO adapter alone misses
    # the SFT adapter under it: another model
    assert abs(eval_logps(ws, without_sft)[0] - trained[0]) > 1e-2


def test_validate_reports_the_chain_refusal_that_training_makes(ws, capsys):
    """DPO on the QLoRA SFT run with another load dtype: the SFT adapter is relative to other 4-bit weights."""
    recipe = str(ws["recipes"]["dpo"])
    override = ["model.dtype=bf16", f"output.dir={ws['root'] / 'dpo_bf16'}"]
    assert main(["validate", recipe, *override]) == 1
    validate_err = capsys.readouterr().err
    assert main(["dpo", recipe, *override]) == 1
    train_err = capsys.readouterr().err
    for err in (validate_err, train_err):
        assert "model.dtype: this recipe quantizes the base as 4-bit nf4" in err and "set model.dtype: fp32" in err


def test_an_interrupted_stacked_run_resumes_to_the_same_adapter(ws, tmp_path):
    """Resume loads the DPO adapter from the checkpoint and keeps the stacked SFT adapter (not saved in it) as is."""
    import shutil

    from safetensors.torch import load_file

    copy = tmp_path / "dpo"
    shutil.copytree(ws["root"] / "dpo", copy)
    for name in ("adapter", "lineage.json", "checkpoints/checkpoint-2", "merged", "exported_adapter"):
        path = copy / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    assert main(["dpo", str(ws["recipes"]["dpo"]), f"output.dir={copy}"]) == 0
    done = load_file(ws["root"] / "dpo" / "adapter" / "adapter_model.safetensors")
    resumed = load_file(copy / "adapter" / "adapter_model.safetensors")
    assert done.keys() == resumed.keys() and all(torch.equal(done[k], resumed[k]) for k in done)
