"""The stage hooks online-RL stages share: prompt data, reward-source preflight, how a prompt row is shown."""

from __future__ import annotations

import json
from pathlib import Path

from dataclasses import dataclass
from typing import Any, Callable

from llmtune.core.stage import Stage, StageData


@dataclass
class AgentTools:
    """The tools of a multi-turn run (``agent:``), loaded once: the tool functions, the environment class (or None),
    their JSON schemas (what the prompts are rendered with) and, once the tokenizer is known, the template's ids
    between turns (:class:`llmtune.rl.chat.ToolTurns`, checked against full renders)."""

    functions: list[Callable]
    environment: type | None
    schemas: list[dict]
    turns: Any = None


class OnlineRLStage(Stage):
    """Base of PPO and GRPO: prompt-only data (``llmtune.data.prompts``); completions are sampled in training, in one
    turn or, with ``agent:`` tools or an environment, over several turns (:mod:`llmtune.rl.agent`)."""

    data_kind = "prompt"
    _agent: AgentTools | None = None

    def agent_tools(self) -> AgentTools | None:
        """The run's :class:`AgentTools` (None without ``agent:``), loaded on first use.

        Raises:
            ToolSetupError: a tool or the environment cannot be loaded or has no schema (recipe keys named); a name in
                ``agent.infrastructure_timeouts`` that is not one of the run's tools.
        """
        cfg = self.recipe.agent
        if not cfg.enabled:
            return None
        if self._agent is None:
            from llmtune.rl.toolbox import check_tool_names, load_environment, load_tools, tool_schemas

            functions = load_tools(cfg.tools, self.recipe_dir)
            environment = load_environment(cfg.environment, self.recipe_dir) if cfg.environment else None
            schemas = tool_schemas(functions, environment)
            check_tool_names(cfg.infrastructure_timeouts, [s["function"]["name"] for s in schemas],
                             "agent.infrastructure_timeouts")
            self._agent = AgentTools(functions, environment, schemas)
        return self._agent

    def build_data(self, tokenizer, base_dir: str) -> StageData:
        """The prompts (rendered with the tools' schemas for a multi-turn run, whose chat template is checked here:
        :func:`llmtune.rl.chat.check_tool_template`, before any weights load; with an environment that has a ``reset``
        the prompt rows keep the dataset's own columns, which ``reset`` receives, and its parameters are checked
        against them).

        Raises:
            DataError: bad prompt data. RecipeError: the template cannot render tool conversations
                (``data.chat_template``); ``agent.tool_parser: auto`` finds no tool-call format.
            ToolSetupError: see :meth:`agent_tools`; ``reset`` requires a column not every prompt row has.
        """
        from llmtune.data.prompts import PromptCollator, build_prompt_data

        agent = self.agent_tools()
        resets = agent is not None and agent.environment is not None and hasattr(agent.environment, "reset")
        data = build_prompt_data(self.recipe.data, tokenizer, base_dir=base_dir,
                                 tools=agent.schemas if agent else None, keep_columns=resets)
        if agent is not None:
            from llmtune.data.prompts import prompt_ids
            from llmtune.data.templates import stop_token_ids
            from llmtune.rl.chat import check_tool_template
            from llmtune.rl.tool_calls import resolve_tool_parser

            agent.turns = check_tool_template(
                tokenizer, agent.schemas, stop_token_ids(tokenizer),
                lambda messages, tools, generation: prompt_ids(tokenizer, messages, tools=tools,
                                                               generation_prompt=generation))
            resolve_tool_parser(self.recipe.agent.tool_parser, tokenizer)  # auto must find a format
            if resets:
                from llmtune.data.prompts import PROMPT_ROW_FIELDS, shared_raw_columns
                from llmtune.rl.toolbox import check_reset_columns

                every, some = shared_raw_columns(data.train, data.eval)
                check_reset_columns(agent.environment, [*every, *PROMPT_ROW_FIELDS], some_rows=some)
        return StageData(data.train, data.eval, data.report, PromptCollator(tokenizer), data.report.sources_lineage())

    def preflight(self, base_dir: str) -> list[tuple[str, str]]:
        """Every reward source exists before anything is loaded (an RM run that finished, importable functions with
        a reward function's signature, found in the working directory or next to the recipe), the tools and the
        environment of ``agent:`` load and have schemas, and the rollout engine asked for can run here
        (:meth:`engine_problems`)."""
        reward = self.recipe.reward
        problems: list[tuple[str, str]] = super().preflight(base_dir) + self.engine_problems()
        from llmtune.rl.toolbox import ToolSetupError

        try:
            self.agent_tools()
        except ToolSetupError as exc:
            for line in exc.problems:
                key, sep, message = line.partition(": ")
                problems.append((key, message) if sep and key.startswith("agent") else ("agent", line))
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
        from llmtune.rewards.functions import KEYWORDS, MULTI_TURN_KEYWORDS, RewardFunctionError, load_reward_function

        specs = ([("reward.function", reward.function)] if reward.function else []) + [
            (f"reward.functions.{i}.function", f.function) for i, f in enumerate(reward.functions)]
        for key, spec in specs:
            try:
                load_reward_function(spec, recipe_dir=self.recipe_dir,
                                     keywords=MULTI_TURN_KEYWORDS if self.recipe.agent.enabled else KEYWORDS)
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
