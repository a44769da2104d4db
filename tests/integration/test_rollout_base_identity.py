"""The rollout base's identity (``base_identity``): what a vLLM rollout server states and a trainer checks in server
mode. Content-based: the same files elsewhere (another node's copy) have the same identity; another base or another
SFT adapter below the policy has another."""

import shutil

import pytest
import yaml

from llmtune.config import load_recipe
from llmtune.rl.engines.vllm_base import RolloutEngineError, base_identity, check_base
from tests.integration.rl_workspace import COMMON, rl_workspace, write_recipe


def _grpo(root, name, model):
    return load_recipe(write_recipe(root, name, "grpo", model=model, output={"dir": str(root / name)},
                                    data={"datasets": [{"path": str(root / "prompts.jsonl")}]},
                                    reward={"functions": [{"function": str(root / "my_rewards.py") + ":length_reward"}]},
                                    train={"max_steps": 2}, **COMMON))


def test_identity_follows_content_not_paths(tmp_path, monkeypatch):
    root = rl_workspace(tmp_path / "a")
    from_sft = base_identity(_grpo(root, "g1", {"from_run": str(root / "sft")}))
    plain = base_identity(_grpo(root, "g2", {"name_or_path": str(root / "model")}))
    assert from_sft != plain  # the SFT adapter below the policy is part of the base
    assert base_identity(_grpo(root, "g3", {"from_run": str(root / "sft")})) == from_sft

    # the same model and run copied elsewhere (new paths and mtimes, as on another node): the same identity
    copy = tmp_path / "b"
    shutil.copytree(root / "model", copy / "model")
    shutil.copytree(root / "sft", copy / "sft")
    lineage = copy / "sft" / "lineage.json"
    lineage.write_text(lineage.read_text().replace(str(root), str(copy)))
    shutil.copy(root / "prompts.jsonl", copy / "prompts.jsonl")
    shutil.copy(root / "my_rewards.py", copy / "my_rewards.py")
    assert base_identity(_grpo(copy, "g1", {"from_run": str(copy / "sft")})) == from_sft
    assert base_identity(_grpo(copy, "g2", {"name_or_path": str(copy / "model")})) == plain

    # another SFT adapter (one byte of its weights changed): another identity
    weights = copy / "sft" / "adapter" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert base_identity(_grpo(copy, "g1", {"from_run": str(copy / "sft")})) != from_sft


def test_check_base_refuses_another_base_and_names_the_fix():
    check_base({"base_id": "abc"}, "abc", "http://h:1")  # same base: nothing to say
    check_base({"base_id": None}, "abc", "http://h:1")  # a server started by hand without --base-id: a warning
    with pytest.raises(RolloutEngineError, match="http://h:1 serves another base model") as err:
        check_base({"base_id": "def"}, "abc", "http://h:1")
    assert "llmtune rollout-server RECIPE" in str(err.value) and err.value.exit_code == 69
