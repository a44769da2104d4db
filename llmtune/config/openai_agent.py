"""``agent.openai``: an agent program of your own behind the OpenAI-compatible endpoint (a section of
:class:`llmtune.config.schema.AgentConfig`; its own module to keep the schema file short)."""

from __future__ import annotations

from pydantic import Field

from llmtune.config.section import Section


class OpenAIAgentConfig(Section):
    """An agent program of your own, trained as it is: run once per rollout against an OpenAI-compatible endpoint
    in front of the rollout engine (its own base URL and key), its requests recorded as token ids, joined by ids or
    split into segments (docs/agents-openai.md). Set function or command; agent.tools/environment stay empty."""

    function: str | None = Field(
        None, description="module:function or file.py:function (found in the working directory, then next to the "
        "recipe), called once per rollout as fn(base_url, api_key, row, seed) in a thread of its own; returns the "
        "rollout's reward (a number) or None (the reward: section then scores the final conversation).")
    command: list[str] | None = Field(
        None, description="An external program run once per rollout (argv list, e.g. [python, my_agent.py], run in "
        "the working directory) with OPENAI_BASE_URL, OPENAI_API_KEY, LLMTUNE_ROW (the dataset row as JSON) and "
        "LLMTUNE_SEED in its environment; the last line of its stdout is the reward, or empty for none (a non-zero "
        "exit is an infrastructure failure).")
    concurrency: int = Field(8, ge=1, description="Rollouts whose agents run at once (requests sampled in batches).")
    timeout_s: float = Field(600.0, gt=0, description="Seconds one rollout's agent may run; past it the rollout is an "
                             "infrastructure failure (it abstains, counted), a command is killed.")
    host: str = Field("127.0.0.1", description="Address the endpoint listens on. Loopback by default; any other "
                      "address exposes it beyond this host (every request still needs its rollout's key).")
    port: int = Field(0, ge=0, le=65535, description="Port of the endpoint (0 = a free one).")
    reward_weight: float = Field(1.0, description="Weight of the reward the agent returns (reward source `agent`) "
                                 "in the total; None from the agent abstains.")

    @property
    def enabled(self) -> bool:
        """An agent program is named (``function`` or ``command``): rollouts go through the endpoint."""
        return bool(self.function or self.command)
