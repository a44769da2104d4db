"""Issue 30's recipe-level bug kinds, through the CLI on a tiny model: a reward module next to the recipe is found by
every command (not only the pipeline's pairs step); a reward-model run is refused as a policy; the vLLM context length,
`rollout.top_k: 1` under GRPO and a reward function with the wrong signature are recipe errors that `llmtune validate`
reports before any weights load; a GRPO run whose reward functions abstain on everything stops with an error, and one
whose groups never carry a signal warns; `reward.functions` takes TRL's list of strings."""

import json
import logging

import pytest
import yaml

from llmtune.commands.cli import main
from tests.integration.rl_workspace import COMMON, rl_workspace, write_recipe

NEXT_TO_RECIPE = """def near(prompts, completions, references):
    return [float(len(c) % 5) for c in completions]
"""


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = rl_workspace(tmp_path_factory.mktemp("rlkinds"))
    pairs = [{"prompt": f"What is {a} + 1?", "chosen": f"#### {a + 1}", "rejected": f"#### {a}"} for a in range(8)]
    (root / "pairs.jsonl").write_text("\n".join(json.dumps(p) for p in pairs) + "\n")
    rm = write_recipe(root, "rm", "rm", model={"name_or_path": str(root / "model")},
                      data={"datasets": [{"path": str(root / "pairs.jsonl"), "format": "preference"}], "max_length": 64},
                      train={"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 1},
                      output={"dir": str(root / "rm")}, **COMMON)
    assert main(["rm", str(rm)]) == 0
    return root


def grpo_doc(root, name, reward, **extra):
    return {"stage": "grpo", "model": {"from_run": str(root / "sft")},
            "data": {"datasets": [{"path": str(root / "prompts.jsonl")}], "max_length": 64},
            "grpo": {"num_generations": 2, "rollout_batch_size": 8, **extra.pop("grpo", {})},
            "rollout": {"max_new_tokens": 8, **extra.pop("rollout", {})}, "reward": reward,
            "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 2, "learning_rate": 1e-2,
                      **extra.pop("train", {})},
            "output": {"dir": str(root / name), "plot": False}, **COMMON, **extra}


def write(path, doc):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("spec", ["near_rewards:near", "near_rewards.py:near"])
def test_a_reward_module_next_to_the_recipe_is_found_by_validate_and_the_stage_command(workspace, tmp_path,
                                                                                      monkeypatch, capsys, spec):
    """The docs promise `rw:fn` / `rw.py:fn` next to the recipe is found; the stage commands resolved it against the
    working directory only. The recipe lives in its own folder, the command runs from another one."""
    folder = workspace / f"recipes_{spec.split(':')[0].replace('.', '_')}"
    folder.mkdir()
    (folder / "near_rewards.py").write_text(NEXT_TO_RECIPE)
    recipe = write(folder / "grpo.yaml", grpo_doc(workspace, f"near_{folder.name}", {"function": spec}))
    monkeypatch.chdir(tmp_path)  # neither the recipe's folder nor the workspace
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err
    assert main(["grpo", str(recipe)]) == 0, capsys.readouterr().err
    assert (workspace / f"near_{folder.name}" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_reward_module_found_nowhere_names_the_directories_searched(workspace, tmp_path, monkeypatch, capsys):
    recipe = write(workspace / "lost" / "grpo.yaml", grpo_doc(workspace, "lost", {"function": "nowhere_rw:fn"}))
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert "cannot import module 'nowhere_rw'" in err and str(tmp_path.resolve()) in err
    assert str((workspace / "lost").resolve()) in err


def test_a_reward_model_run_is_refused_as_the_policy(workspace, capsys):
    pairs = {"datasets": [{"path": str(workspace / "pairs.jsonl"), "format": "preference"}], "max_length": 64}
    recipe = write(workspace / "dpo_from_rm.yaml", {
        "stage": "dpo", "model": {"from_run": str(workspace / "rm")}, "data": pairs,
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 1},
        "output": {"dir": str(workspace / "dpo_from_rm")}, **COMMON})
    expected = "is an `llmtune rm` run: a reward model (a score head, no language-model head), which cannot be the " \
               "policy of `llmtune dpo`"
    assert main(["validate", str(recipe)]) == 1
    assert expected in capsys.readouterr().err
    assert main(["dpo", str(recipe)]) == 1
    assert expected in capsys.readouterr().err
    assert not (workspace / "dpo_from_rm" / "adapter").exists()
    # GRPO too (any causal-LM stage); an RM started from the SFT run is the usual chain and fits
    grpo = write(workspace / "grpo_from_rm.yaml", {**grpo_doc(workspace, "grpo_from_rm", {"function": str(
        workspace / "my_rewards.py") + ":length_reward"}), "model": {"from_run": str(workspace / "rm")}})
    assert main(["validate", str(grpo)]) == 1 and expected.replace("dpo", "grpo") in capsys.readouterr().err
    rm_from_sft = write(workspace / "rm_from_sft.yaml", {
        "stage": "rm", "model": {"from_run": str(workspace / "sft")}, "data": pairs,
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": 1},
        "output": {"dir": str(workspace / "rm_from_sft")}, **COMMON})
    assert main(["validate", str(rm_from_sft)]) == 0, capsys.readouterr().err


def test_recipe_time_refusals_are_reported_by_validate_without_weights(workspace, capsys, monkeypatch):
    """The vLLM context below prompt + completion and top_k 1 under GRPO are recipe errors (reported together, before
    the tokenizer); a TRL-style reward signature is reported by validate's preflight, before any weights load."""
    (workspace / "trl_style.py").write_text("def fn(completions, **kwargs):\n    return [0.0 for _ in completions]\n")
    reward = {"functions": [str(workspace / "trl_style.py") + ":fn"]}
    doc = grpo_doc(workspace, "refused", reward, rollout={"max_new_tokens": 8, "eval_max_new_tokens": 32, "top_k": 1,
                                                          "engine": "vllm", "vllm": {"max_model_len": 80}})
    recipe = write(workspace / "refused.yaml", doc)
    assert main(["validate", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert "rollout.vllm.max_model_len: 80 tokens is below the longest sequence this run asks the engine for: " \
           "data.max_length 64 + rollout.eval_max_new_tokens 32 = 96 tokens" in err
    assert "rollout.top_k: 1 samples the most likely token every time" in err
    recipe = write(workspace / "refused.yaml", grpo_doc(workspace, "refused", reward))
    assert main(["validate", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert "reward.functions.0.function:" in err and "has the signature fn(completions, **kwargs)" in err
    assert "def reward(prompts, completions, **kwargs): return trl_fn(completions, **kwargs)" in err
    assert main(["grpo", str(recipe)]) == 1 and "has the signature fn(completions, **kwargs)" in capsys.readouterr().err
    assert not (workspace / "refused").exists()


def test_reward_functions_take_trls_list_of_strings(workspace, capsys):
    doc = grpo_doc(workspace, "strings", {"functions": [str(workspace / "my_rewards.py") + ":length_reward",
                                                        "llmtune.rewards:format_reward"]})
    recipe = write(workspace / "strings.yaml", doc)
    assert main(["validate", str(recipe)]) == 0, capsys.readouterr().err


def test_grpo_stops_when_every_reward_function_abstains_on_everything(workspace, capsys):
    (workspace / "never.py").write_text("def fn(prompts, completions):\n    return [None for _ in completions]\n")
    recipe = write(workspace / "never.yaml", grpo_doc(workspace, "never", {"function": str(workspace / "never.py")
                                                                         + ":fn"}))
    assert main(["grpo", str(recipe)]) == 1
    err = capsys.readouterr().err
    assert "error: iteration 0 (step 0): every reward source (fn) abstained (returned None) on all 8 completions, so " \
           "nothing can train" in err
    assert not (workspace / "never" / "adapter").exists()


def test_grpo_warns_when_no_group_carries_a_signal(workspace, caplog):
    (workspace / "constant.py").write_text("def fn(prompts, completions):\n    return [1.0 for _ in completions]\n")
    recipe = write(workspace / "constant.yaml", grpo_doc(workspace, "constant", {"function": str(
        workspace / "constant.py") + ":fn"}, train={"max_steps": 4}))
    with caplog.at_level(logging.WARNING):
        assert main(["grpo", str(recipe)]) == 0
    warnings = [r.getMessage() for r in caplog.records if "trained nothing" in r.getMessage()]
    assert len(warnings) == 1 and "in the last 2 iterations (up to step 2): every advantage was 0" in warnings[0]
    rows = [json.loads(x) for x in (workspace / "constant" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["all_equal_group_fraction"] == 1.0 for r in rows if "all_equal_group_fraction" in r)
