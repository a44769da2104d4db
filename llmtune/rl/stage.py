"""The stage hooks online-RL stages share: prompt data, reward-source preflight, how a prompt row is shown."""

from __future__ import annotations

import json
from pathlib import Path

from llmtune.core.stage import Stage, StageData


class OnlineRLStage(Stage):
    """Base of PPO and GRPO: prompt-only data (``llmtune.data.prompts``); completions are sampled in training."""

    data_kind = "prompt"

    def build_data(self, tokenizer, base_dir: str) -> StageData:
        from llmtune.data.prompts import PromptCollator, build_prompt_data

        data = build_prompt_data(self.recipe.data, tokenizer, base_dir=base_dir)
        return StageData(data.train, data.eval, data.report, PromptCollator(tokenizer), data.report.sources_lineage())

    def preflight(self, base_dir: str) -> list[tuple[str, str]]:
        """Every reward source exists before anything is loaded (an RM run that finished, importable functions with
        a reward function's signature, found in the working directory or next to the recipe), and the rollout engine
        asked for can run here (:meth:`engine_problems`)."""
        reward = self.recipe.reward
        problems: list[tuple[str, str]] = super().preflight(base_dir) + self.engine_problems()
        if reward.from_run:
            lineage_path = Path(reward.from_run) / "lineage.json"
            if not lineage_path.is_file():
                state = "does not exist" if not Path(reward.from_run).exists() else "is not a finished run"
                problems.append(("reward.from_run", f"{reward.from_run} {state} (no lineage.json); train the reward "
                                 "model first with `llmtune rm ...`, or fix the path (relative to the working "
                                 "directory)"))
            else:
                lineage = json.loads(lineage_path.read_text())
                if lineage.get("model_head") != "score":
                    problems.append(("reward.from_run", f"{reward.from_run} is a {lineage.get('stage')} run, not a "
                                     "reward model; point it to an `llmtune rm` run"))
        from llmtune.rewards.functions import RewardFunctionError, load_reward_function

        specs = ([("reward.function", reward.function)] if reward.function else []) + [
            (f"reward.functions.{i}.function", f.function) for i, f in enumerate(reward.functions)]
        for key, spec in specs:
            try:
                load_reward_function(spec, recipe_dir=self.recipe_dir)
            except RewardFunctionError as exc:
                problems.append((key, str(exc).removeprefix("reward.function: ")))
        return problems

    def engine_problems(self) -> list[tuple[str, str]]:
        """``rollout.engine: vllm`` in colocate mode needs vLLM installed here (a server elsewhere does not); the
        recipe rules (adapter, quantization, server url) are checked with the recipe
        (:func:`llmtune.config.validate.rollout_problems`). No GPU is needed: vLLM's CPU build runs the engine."""
        rollout = self.recipe.rollout
        if rollout.engine != "vllm" or rollout.vllm.mode != "colocate":
            return []
        from llmtune.rl.engines import vllm_installed

        if vllm_installed():
            return []
        return [("rollout.engine", "vllm (rollout.vllm.mode: colocate) but vLLM is not installed here: `bash "
                 "scripts/setup.sh` sets it up in its own environment (.venv-vllm; or point LLMTUNE_VLLM_PYTHON at a "
                 "python that has vllm), or run a rollout server elsewhere (rollout.vllm.mode: server with "
                 "rollout.vllm.url; `llmtune rollout-server RECIPE`), or use rollout.engine: hf")]

    def render_example(self, row: dict, tokenizer) -> str:
        prompt = tokenizer.decode(row["input_ids"])
        reference = row.get("reference")
        return (f"{prompt}«the policy's response is sampled here during training»"
                + (f"\n(reference answer, for reward functions: {reference!r})" if reference else ""))
