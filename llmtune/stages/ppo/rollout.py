"""Moved to :mod:`llmtune.rl.rollout` (shared by PPO and GRPO); re-exported here for existing imports."""

from llmtune.rl.rollout import decode_responses, join, response_token_logps, split_generation, trim

__all__ = ["decode_responses", "join", "response_token_logps", "split_generation", "trim"]
