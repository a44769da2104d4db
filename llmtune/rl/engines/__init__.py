"""Rollout engines: token ids in; token ids, log-probs and a finish reason out.

An engine samples one :class:`~llmtune.rl.types.Completion` per prompt (a list of token ids, no padding) under
:class:`~llmtune.rl.types.SamplingParams`; it is built from the policy (:class:`Policy`: the peft model, its
adapter, a version getter, how to enter generation) and where it runs (:class:`EngineSite`), never from the
trainer. The contract is a declared type (:mod:`llmtune.rl.engines.base`):
:class:`~llmtune.rl.engines.base.RolloutEngine` (``generate``, ``sync``, ``close``) and, for an engine in another
process that can sample while the trainer trains, :class:`~llmtune.rl.engines.base.BackgroundEngine`
(``snapshot``/``push``, the two halves of ``sync``). Weights reach it only through ``sync`` (or ``push``). Two
engines, one registry (:data:`ENGINES`):

- ``hf`` (:mod:`llmtune.rl.engines.hf`): transformers' ``generate`` on the training model itself;
- ``vllm`` (:mod:`llmtune.rl.engines.vllm_engine`): a vLLM server process (colocated or remote) that receives the adapter
  as a new, versioned LoRA after every optimizer step.

:func:`select_engine` resolves ``rollout.engine: auto``; :func:`build_engine` builds the chosen one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager

import torch

from llmtune.rl.engines.base import RolloutEngine
from llmtune.rl.types import SamplingParams
from llmtune.utils import get_logger

log = get_logger("rollout")


@dataclass
class Policy:
    """What an engine samples from.

    Attributes:
        model: the peft model (unwrapped) whose adapter ``adapter`` is the policy: what is saved (vLLM) or merged
            (hf) for sampling.
        adapter: the trained adapter's name (``default``); None = the model as it is (a merged policy, the
            pipeline's pairs step).
        version: returns the policy version = optimizer steps applied (0 for a frozen policy).
        device: where prompt tensors go.
        generation: enters generation and yields the model to call ``generate`` on (under ZeRO-3 the gathered
            weights, with the trainer's autocast); None = ``model`` as it is.
        can_merge: the adapter may be merged into the weights in place while sampling (not under ZeRO-3/FSDP).
    """

    model: torch.nn.Module
    adapter: str | None
    version: Callable[[], int]
    device: torch.device | str = "cpu"
    generation: Callable[[], ContextManager[torch.nn.Module]] | None = None
    can_merge: bool = True

    def enter(self) -> ContextManager[torch.nn.Module]:
        return self.generation() if self.generation is not None else contextlib.nullcontext(self.model)


@dataclass
class EngineSite:
    """Where an engine runs: the run directory (the vLLM engine's log and rollout base), this process's rank among
    ``world_size`` (a colocated engine per rank; seeds differ per rank) and its device."""

    run_dir: Path
    rank: int = 0
    world_size: int = 1
    device: torch.device | str = "cpu"


def _build_hf(recipe, policy: Policy, site: EngineSite, pad_id: int) -> RolloutEngine:
    from llmtune.rl.engines.hf import HFEngine

    return HFEngine(policy, pad_id)


def _build_vllm(recipe, policy: Policy, site: EngineSite, pad_id: int) -> RolloutEngine:
    from llmtune.rl.engines.vllm_engine import build_vllm_engine

    return build_vllm_engine(recipe, policy, site, pad_id)


# rollout.engine -> builder(recipe, policy, site, pad_id)
ENGINES: dict[str, Callable[..., RolloutEngine]] = {"hf": _build_hf, "vllm": _build_vllm}


def vllm_installed() -> bool:
    """Whether a python with vLLM is available to run the engine (:func:`llmtune.rl.engines.vllm_client.vllm_python`)."""
    from llmtune.rl.engines.vllm_client import vllm_python

    return vllm_python() is not None


def select_engine(recipe, cuda_available: bool | None = None, installed: bool | None = None) -> tuple[str, str]:
    """The engine ``rollout.engine`` asks for, and why.

    ``hf``/``vllm`` are taken as given; ``auto`` is vllm when CUDA is available, the recipe is one vLLM can sample
    for (LoRA on an unquantized base, see :func:`llmtune.rl.engines.vllm_engine.vllm_recipe_problems`; no LoRA on
    MoE experts, :func:`llmtune.models.checks.vllm_model_problems`) and vLLM can be used (server mode: a url
    is set; colocate: vLLM is installed here), else hf (on CPUs hf is the faster engine: issue 22's measurements).

    Args:
        recipe: the typed recipe. cuda_available / installed: overrides of ``torch.cuda.is_available()`` /
            :func:`vllm_installed` (tests).

    Returns:
        ``(engine, reason)`` with engine a key of :data:`ENGINES`.
    """
    rollout = recipe.rollout
    if rollout.engine != "auto":
        return rollout.engine, f"rollout.engine: {rollout.engine}"
    if not (torch.cuda.is_available() if cuda_available is None else cuda_available):
        return "hf", "rollout.engine: auto and no CUDA device (vLLM is for GPUs; on CPUs hf is faster)"
    from llmtune.rl.engines.vllm_engine import vllm_recipe_problems

    problems = vllm_recipe_problems(recipe)
    if not problems:  # the model: LoRA on MoE experts (docs/models.md)
        from llmtune.models.checks import read_model_config, vllm_model_problems

        config = read_model_config(recipe.model)
        problems = vllm_model_problems(recipe, config) if config is not None else []
    if problems:
        return "hf", f"rollout.engine: auto and vLLM cannot sample this recipe ({problems[0][0]}: {problems[0][1]})"
    if rollout.vllm.mode == "server":
        return "vllm", f"rollout.engine: auto, CUDA and a rollout server at {rollout.vllm.url}"
    if not (vllm_installed() if installed is None else installed):
        return "hf", "rollout.engine: auto and vLLM is not installed (bash scripts/setup.sh sets it up)"
    return "vllm", "rollout.engine: auto, CUDA and vLLM installed"


def build_engine(recipe, policy: Policy, site: EngineSite, pad_id: int) -> RolloutEngine:
    """The rollout engine :func:`select_engine` picks for ``recipe`` (the choice is logged).

    Args:
        recipe: the typed recipe (``rollout:`` section). policy, site: what it samples from and where it runs.
        pad_id: the id prompts are padded with (hf).

    Raises:
        RolloutEngineError: vLLM fails to start or cannot be reached (``llmtune.rl.engines.vllm_engine``);
            EngineNotInstalledError: vLLM is not installed.
    """
    engine, reason = select_engine(recipe)
    log.info("rollout engine: %s (%s)", engine, reason)
    return ENGINES[engine](recipe, policy, site, pad_id)


def sampling_from_recipe(recipe, stop_token_ids: list[int], *, greedy: bool = False,
                         max_new_tokens: int | None = None) -> SamplingParams:
    """The :class:`SamplingParams` of the recipe's ``rollout:`` section (``greedy``: the evaluation's, with
    ``eval_max_new_tokens``)."""
    r = recipe.rollout
    if max_new_tokens is None:
        max_new_tokens = (r.eval_max_new_tokens or r.max_new_tokens) if greedy else r.max_new_tokens
    return SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids),
                          temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, greedy=greedy)
