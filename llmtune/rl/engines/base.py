"""The rollout engine contract, as declared types: what online RL calls to sample completions.

:class:`RolloutEngine` samples token ids from the policy version it was last synced to; :class:`BackgroundEngine` is
one in another process (vLLM) that can also sample while the trainer trains (asynchronous rollouts,
``rollout.max_staleness`` > 0): ``sync`` split into ``snapshot`` (in the training thread, where the adapter is not
being updated) and ``push`` (anywhere). The rollout side (:mod:`llmtune.rl.rollouts`) asks ``isinstance(engine,
BackgroundEngine)``, never whether a method happens to exist.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from typing import Iterator

from llmtune.rl.types import AdapterSnapshot, Completion, SamplingParams


class RolloutEngine(ABC):
    """What online RL calls to sample completions (token ids in, token ids out).

    Attributes:
        seeds_per_prompt: ``generate`` takes ``seeds``, one per prompt, and samples each prompt from its own seed
            only, so that a prompt's completion does not depend on what else shares its batch (up to the float
            rounding of a batched forward).
    """

    seeds_per_prompt: bool = False

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams, budgets: list[int] | None = None,
                 keys: list[int] | None = None, version: int | None = None,
                 seeds: list[int | None] | None = None) -> list[Completion]:
        """One completion per prompt (token ids, no padding), sampled (or greedy) from the policy version the
        engine was last synced to; ``budgets``: each prompt's own token limit (a multi-turn rollout's remaining
        completion budget), else ``sampling.max_new_tokens`` for all; ``keys``: prompts of one key are served by
        one server (an engine over several); ``version``: the version to sample with (default the trainer's
        current one; a rollout sampled in the background names the version pushed for it); ``seeds``: one per
        prompt, for an engine with :attr:`seeds_per_prompt` (a None entry: seeded as without ``seeds``); without
        them the engine seeds the batch from ``sampling.seed``, else from torch's global RNG."""

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """A stretch of many ``generate`` calls (a multi-turn rollout batch, whose turns are sampled as their tools
        return): an engine that frees the device between rollout batches (a colocated vLLM engine's sleep mode)
        stays awake inside and frees it once, at the end. Nothing by default."""
        yield

    @abstractmethod
    def sync(self, version: int) -> None:
        """Make the engine sample from the policy as it is now; ``version`` = optimizer steps applied."""

    @abstractmethod
    def close(self) -> None:
        """Free the engine (processes, memory)."""


class BackgroundEngine(RolloutEngine):
    """An engine in another process that can sample while the trainer trains (:mod:`llmtune.rl.prefetch`).

    Attributes:
        background: set by the background sampler: rollouts are sampled while the trainer trains (a colocated engine
            then never sleeps between rollout batches).
    """

    background: bool = False

    @abstractmethod
    def snapshot(self, version: int) -> AdapterSnapshot:
        """The policy adapter as it is now, as version ``version`` (called in the training thread)."""

    @abstractmethod
    def push(self, snapshot: AdapterSnapshot) -> None:
        """Load ``snapshot`` into the engine (any thread); ``generate(..., version=snapshot.version)`` then samples
        with it."""
