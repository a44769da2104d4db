"""The `rollout:` section (issue 22): defaults, moved keys, what the vLLM engine refuses, engine selection."""

import pytest

from llmtune.commands.cli import options_help
from llmtune.config import RecipeError, load_recipe
from llmtune.config.schema import Recipe
from llmtune.rl import engines as generation
from llmtune.rl.engines import select_engine

GRPO = {"stage": "grpo", "reward": {"function": "llmtune.rewards:gsm8k_reward"},
        "train": {"global_batch_size": 8, "max_steps": 2}}
PPO = {"stage": "ppo", "reward": {"function": "llmtune.rewards:gsm8k_reward"},
       "train": {"global_batch_size": 8, "max_steps": 4}}


def _problems(raw: dict, overrides=()) -> list[tuple[str, str]]:
    with pytest.raises(RecipeError) as info:
        load_recipe(raw=raw, overrides=list(overrides))
    return info.value.problems


def test_defaults_and_stage_max_new_tokens():
    grpo, ppo = load_recipe(raw=GRPO).rollout, load_recipe(raw=PPO).rollout
    assert (grpo.engine, grpo.temperature, grpo.top_p, grpo.top_k, grpo.seed) == ("auto", 1.0, 1.0, 0, None)
    assert grpo.max_new_tokens == 128 and ppo.max_new_tokens == 64  # null = the stage's own default
    assert grpo.eval_max_new_tokens is None and Recipe().rollout.max_new_tokens is None  # no stage: left null
    assert load_recipe(raw={**GRPO, "rollout": {"max_new_tokens": 7}}).rollout.max_new_tokens == 7
    v = grpo.vllm
    assert (v.mode, v.url, v.gpu_memory_utilization, v.enable_sleep_mode, v.max_model_len, v.max_lora_rank,
            v.dtype) == ("colocate", None, None, True, None, None, "auto")  # null: 0.3 colocated, 0.9 server
    assert (v.importance_sampling_correction, v.importance_sampling_cap) == (True, 2.0)
    assert (v.startup_timeout_s, v.request_timeout_s) == (600.0, 600.0)


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
@pytest.mark.parametrize("key,value", [("temperature", 0.7), ("top_p", 0.9), ("top_k", 5), ("max_new_tokens", 32),
                                       ("eval_max_new_tokens", 40)])
def test_old_sampling_keys_name_the_new_key(stage, key, value):
    raw = {**(GRPO if stage == "grpo" else PPO), stage: {key: value}}
    assert _problems(raw) == [(f"{stage}.{key}", f"{stage}.{key} moved to rollout.{key} (PPO and GRPO share one "
                               f"`rollout:` section for sampling); write `rollout: {{{key}: {value!r}}}` or the "
                               f"override rollout.{key}=...")]
    # the same through an override
    base = GRPO if stage == "grpo" else PPO
    assert [p for p, _ in _problems(base, [f"{stage}.{key}={value}"])] == [f"{stage}.{key}"]


@pytest.mark.parametrize("section,path", [
    ({"temperature": 0}, "rollout.temperature"), ({"top_p": 1.5}, "rollout.top_p"),
    ({"vllm": {"gpu_memory_utilization": 0}}, "rollout.vllm.gpu_memory_utilization"),
    ({"vllm": {"importance_sampling_cap": 0.5}}, "rollout.vllm.importance_sampling_cap"),
    ({"vllm": {"url": "localhost:8000"}}, "rollout.vllm.url"),
    ({"engine": "sglang"}, "rollout.engine"), ({"vllm": {"dtype": "fp32"}}, "rollout.vllm.dtype"),
])
def test_field_ranges(section, path):
    assert path in [p for p, _ in _problems({**GRPO, "rollout": section})]


@pytest.mark.parametrize("overrides,key,needle", [
    (["adapter.type=none"], "rollout.engine", "full fine-tuning"),
    (["model.load_in_4bit=true"], "rollout.engine", "4-bit (QLoRA)"),
    (["model.load_in_8bit=true"], "rollout.engine", "8-bit"),
    (["adapter.use_dora=true"], "rollout.engine", "DoRA"),
    (["adapter.modules_to_save=[lm_head]"], "rollout.engine", "modules_to_save"),
    (["distributed.zero_stage=3"], "rollout.engine", "ZeRO-3"),
    (["rollout.vllm.max_lora_rank=8"], "rollout.vllm.max_lora_rank", "below the trained adapter's rank"),
    (["rollout.vllm.mode=server"], "rollout.vllm.url", "needs the address of a running rollout server"),
    (["rollout.vllm.tensor_parallel_size=2"], "rollout.vllm.tensor_parallel_size", "needs a rollout server"),
])
def test_vllm_refuses_with_reason_and_alternative(overrides, key, needle):
    problems = _problems(GRPO, ["rollout.engine=vllm", *overrides])
    match = [m for p, m in problems if p == key and needle in m]
    assert match, problems
    if key == "rollout.engine":
        assert "rollout.engine: hf" in match[0]  # the alternative is named
    try:  # the hf engine samples on the training model itself: none of these concern it
        load_recipe(raw=GRPO, overrides=["rollout.engine=hf", *overrides])
    except RecipeError as exc:
        assert not [p for p, _ in exc.problems if p.startswith("rollout")], exc.problems


def test_server_mode_needs_url_unless_hf():
    assert [p for p, _ in _problems(GRPO, ["rollout.vllm.mode=server"])] == ["rollout.vllm.url"]  # auto too
    load_recipe(raw=GRPO, overrides=["rollout.engine=hf", "rollout.vllm.mode=server"])
    ok = load_recipe(raw=GRPO, overrides=["rollout.engine=vllm", "rollout.vllm.mode=server",
                                           "rollout.vllm.url=http://10.0.0.7:8000"])
    assert ok.rollout.vllm.url == "http://10.0.0.7:8000"
    load_recipe(raw={**GRPO, "stage": "sft", "rollout": {"engine": "vllm"}, "adapter": {"type": "none"}})  # unused


def test_auto_selection(monkeypatch):
    recipe = load_recipe(raw=GRPO)
    monkeypatch.setattr(generation.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(generation, "vllm_installed", lambda: True)
    assert select_engine(recipe)[0] == "hf"  # no CUDA: hf, even with vLLM installed
    monkeypatch.setattr(generation.torch.cuda, "is_available", lambda: True)
    assert select_engine(recipe)[0] == "vllm"
    monkeypatch.setattr(generation, "vllm_installed", lambda: False)
    engine, reason = select_engine(recipe)
    assert engine == "hf" and "not installed" in reason
    server = load_recipe(raw=GRPO, overrides=["rollout.vllm.mode=server", "rollout.vllm.url=http://h:1"])
    assert select_engine(server)[0] == "vllm"  # a server elsewhere needs no vLLM here
    monkeypatch.setattr(generation, "vllm_installed", lambda: True)
    full = load_recipe(raw=GRPO)  # GRPO refuses full fine-tuning at load; auto must not pick vLLM for it either
    full.adapter.type = "none"
    engine, reason = select_engine(full)
    assert engine == "hf" and "full fine-tuning" in reason  # auto never picks an engine that would refuse
    for explicit in ("hf", "vllm"):
        assert select_engine(load_recipe(raw=GRPO, overrides=[f"rollout.engine={explicit}"]))[0] == explicit


def test_preflight_names_a_missing_vllm(monkeypatch):
    from llmtune.stages import STAGES

    monkeypatch.setattr(generation, "vllm_installed", lambda: False)
    vllm = STAGES["grpo"](load_recipe(raw=GRPO, overrides=["rollout.engine=vllm"]))
    [(key, message)] = vllm.engine_problems()
    assert key == "rollout.engine" and "scripts/setup.sh" in message and "mode: server" in message
    server = load_recipe(raw=GRPO, overrides=["rollout.engine=vllm", "rollout.vllm.mode=server",
                                              "rollout.vllm.url=http://h:1"])
    assert STAGES["grpo"](server).engine_problems() == []
    assert STAGES["ppo"](load_recipe(raw=PPO)).engine_problems() == []  # auto falls back to hf
    monkeypatch.setattr(generation, "vllm_installed", lambda: True)
    assert vllm.engine_problems() == []


def test_help_lists_the_rollout_keys():
    for stage in ("grpo", "ppo"):
        text = options_help(stage)
        for key in ("rollout.engine", "rollout.temperature", "rollout.max_new_tokens", "rollout.vllm.mode",
                    "rollout.vllm.importance_sampling_cap"):
            assert key in text, (stage, key)
    assert "rollout." not in options_help("sft")


def test_server_settings_memory_secret_and_tensor_parallelism(tmp_path, monkeypatch):
    from llmtune.rl.engines.vllm_client import server_command
    from llmtune.rl.engines.vllm_engine import RolloutEngineError, settings_from_recipe

    monkeypatch.delenv("LLMTUNE_ROLLOUT_SECRET", raising=False)
    colocate = settings_from_recipe(load_recipe(raw=GRPO, overrides=["rollout.engine=vllm"]))
    assert colocate.gpu_memory_utilization == 0.3 and colocate.secret is None
    server = ["rollout.engine=vllm", "rollout.vllm.mode=server", "rollout.vllm.url=http://10.0.0.7:8000"]
    s = settings_from_recipe(load_recipe(raw=GRPO, overrides=server))
    assert s.gpu_memory_utilization == 0.9 and s.secret is None  # a server of its own: most of its GPU
    assert settings_from_recipe(load_recipe(raw=GRPO, overrides=[
        *server, "rollout.vllm.gpu_memory_utilization=0.5"])).gpu_memory_utilization == 0.5
    monkeypatch.setenv("LLMTUNE_ROLLOUT_SECRET", "from-env")
    assert settings_from_recipe(load_recipe(raw=GRPO, overrides=server)).secret == "from-env"
    (tmp_path / "secret").write_text("from-file\n")
    s = settings_from_recipe(load_recipe(raw=GRPO, overrides=[*server, f"rollout.vllm.secret_file={tmp_path}/secret"]))
    assert s.secret == "from-file" and "from-file" not in repr(s)  # never in a log line
    (tmp_path / "empty").write_text("")
    for name, needle in (("empty", "is empty"), ("missing", "cannot read")):
        with pytest.raises(RolloutEngineError, match=needle):
            settings_from_recipe(load_recipe(raw=GRPO, overrides=[*server, f"rollout.vllm.secret_file={tmp_path}/{name}"]))
    tp = settings_from_recipe(load_recipe(raw=GRPO, overrides=[*server, "rollout.vllm.tensor_parallel_size=4"]))
    cmd = server_command("python", "base", tp)
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "4" and "from-env" not in " ".join(cmd)


@pytest.mark.parametrize("raw", [PPO, GRPO], ids=["ppo", "grpo"])
def test_online_rl_full_fine_tuning_is_refused_with_the_recipe(raw):
    """The trainer refuses adapter.type: none when it builds the policy (reference = adapter off); the recipe check
    says so first, so `llmtune validate` reports it too (old code: valid, then refused after loading the model)."""
    [(key, message)] = _problems(raw, ["adapter.type=none"])
    assert key == "adapter.type" and "no adapter to switch off" in message and "adapter.type: lora" in message
