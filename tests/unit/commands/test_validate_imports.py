"""``llmtune validate`` imports only what a dry run needs (recipe, tokenizer, data, the one stage's class), and the
stage registry imports a stage's module only when that stage is looked up."""

import json
import subprocess
import sys

import pytest
import yaml

from llmtune.models.tiny import save_tiny_model

# libraries a dry run never needs: the trainer (transformers.Trainer pulls peft and bitsandbytes), TRL, DeepSpeed,
# the loss plot; and the llmtune modules of training and of the other stages
NOT_NEEDED = ("peft", "bitsandbytes", "trl", "deepspeed", "matplotlib", "transformers.trainer", "llmtune.core.trainer",
              "llmtune.core.runner", "llmtune.rl.trainer", "llmtune.stages.grpo", "llmtune.stages.ppo",
              "llmtune.stages.dpo")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    root = tmp_path_factory.mktemp("validate_imports")
    model = save_tiny_model(root / "model")
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 2?"},
                          {"role": "assistant", "content": f"It is {i + 2}."}]} for i in range(12)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = root / "sft.yaml"
    path.write_text(yaml.safe_dump({
        "stage": "sft", "model": {"name_or_path": str(model)},
        "data": {"datasets": [{"path": str(root / "data.jsonl")}], "max_length": 64, "cache": False},
        "adapter": {"lora_r": 4, "lora_alpha": 8},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2},
        "output": {"dir": str(root / "run")}}))
    return path


def test_validate_imports_neither_the_trainer_nor_other_stages(recipe):
    code = (f"import sys\nfrom llmtune.commands.cli import main\nrc = main(['validate', {str(recipe)!r}])\n"
            f"print(rc, sorted(m for m in {NOT_NEEDED!r} if m in sys.modules))\n"
            "print('llmtune.stages.sft' in sys.modules)")
    out = _run(code)
    lines = out.stdout.strip().splitlines()
    assert lines[-2:] == ["0 []", "True"], out.stdout + out.stderr  # validated, with the SFT stage class only
    assert "valid:" in out.stdout and "training row 0" in out.stdout


def test_a_missing_data_file_is_reported_without_the_trainer(recipe, tmp_path):
    bad = yaml.safe_load(recipe.read_text())
    bad["data"]["datasets"][0]["path"] = str(tmp_path / "missing.jsonl")
    path = tmp_path / "missing.yaml"
    path.write_text(yaml.safe_dump(bad))
    code = (f"import sys\nfrom llmtune.commands.cli import main\nrc = main(['validate', {str(path)!r}])\n"
            f"print(rc, sorted(m for m in {NOT_NEEDED!r} if m in sys.modules), 'torch' in sys.modules,\n"
            "      'transformers' in sys.modules)")
    out = _run(code)
    # found before the tokenizer: neither torch nor transformers is imported for it
    assert out.stdout.strip().splitlines()[-1] == "1 [] False False", out.stdout + out.stderr
    assert f"data.datasets.0.path: file not found: {tmp_path / 'missing.jsonl'}" in out.stderr


def test_the_registry_imports_a_stage_only_when_it_is_looked_up():
    code = ("import sys\nfrom llmtune.stages import STAGES\n"
            "names = list(STAGES); here = 'dpo' in STAGES and 'nope' not in STAGES and STAGES.get('nope') is None\n"
            "print(names, here, sorted(m for m in sys.modules if m.startswith('llmtune.stages.')),\n"
            "      'torch' in sys.modules)\n"
            "cls = STAGES['kto']\n"
            "print(cls.__name__, sorted(m for m in sys.modules if m.startswith('llmtune.stages.')))")
    out = _run(code)
    first, second = out.stdout.strip().splitlines()[-2:]
    assert first == "['sft', 'rm', 'dpo', 'ppo', 'grpo', 'orpo', 'simpo', 'kto'] True [] False", out.stderr
    assert second == "KTOStage ['llmtune.stages.dpo', 'llmtune.stages.kto']"  # KTO builds on DPOStage


def test_every_registered_stage_is_its_command():
    from llmtune.stages import STAGES, SFTStage

    assert {name: STAGES[name].name for name in STAGES} == {name: name for name in STAGES}
    assert STAGES["sft"] is SFTStage
    with pytest.raises(KeyError):
        STAGES["nope"]
