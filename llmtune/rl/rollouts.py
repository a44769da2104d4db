"""The rollout side of online RL: which prompts an iteration samples, the engine that samples them (one turn, or
several with tools: :mod:`llmtune.rl.agent`), the background sampler of asynchronous rollouts
(:mod:`llmtune.rl.prefetch`) and the staleness bound, and what sampling logs. Nothing here trains or scores: a
:class:`Rollouts` gives the iteration (:mod:`llmtune.rl.iteration`) a :class:`~llmtune.rl.types.RolloutBatch`.

Reproducibility: the prompts of iteration i are the next rows of a concatenation of per-epoch permutations seeded by
(seed, epoch) (:func:`prompt_indices`); sampling is seeded by (seed, iteration, rank) (:func:`iteration_seed`), so a
resumed run draws exactly what the uninterrupted run drew, and a batch sampled in the background (which must not
touch torch's global RNG, the training thread's) carries its seed in its sampling settings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import torch

from llmtune.rl.engines.base import BackgroundEngine, RolloutEngine
from llmtune.rl.types import RolloutBatch, SamplingParams, Trajectory
from llmtune.utils import get_logger

log = get_logger("rl")


@dataclass
class Ranks:
    """This process among the run's ranks: who it is and how numbers cross ranks.

    Attributes:
        rank, world: this process's index and the number of processes. seed: ``train.seed``. device: the training
            device. reduce: a tensor summed over ranks. gather: tensors concatenated over ranks (dim 0). Both are the
            identity with one process.
    """

    rank: int = 0
    world: int = 1
    seed: int = 0
    device: torch.device | str = "cpu"
    reduce: Callable[[torch.Tensor], torch.Tensor] = lambda x: x
    gather: Callable[[torch.Tensor], torch.Tensor] = lambda x: x


def prompt_indices(n: int, seed: int, iteration: int, size: int, rank: int = 0, world: int = 1) -> list[int]:
    """This rank's rows of ``n`` prompts for iteration ``iteration``: the global order is a concatenation of per-epoch
    permutations seeded by (seed, epoch); iteration i takes the next ``size`` rows of it (prompts over all ranks),
    dealt to ranks round-robin."""
    start = iteration * size
    order: list[int] = []
    epoch = start // n
    while len(order) < (start % n) + size:
        gen = torch.Generator().manual_seed(seed + epoch)
        order += torch.randperm(n, generator=gen).tolist()
        epoch += 1
    batch = order[start % n: start % n + size]
    return batch[rank::world]


def iteration_seed(seed: int, iteration: int, rank: int = 0, salt: int = 0) -> int:
    """The seed of iteration ``iteration`` on rank ``rank``: ``seed`` (``rollout.seed``, else ``train.seed``) +
    iteration and rank terms, modulo numpy's seed range (seed + 1_000_003 x iteration passes 2**32 after ~4,300
    iterations)."""
    return (seed + 1_000_003 * iteration + 7919 * rank + salt) % 2**32


def conversation_fields(trajectory: Trajectory) -> dict:
    """What ``samples.jsonl`` shows of a multi-turn rollout beside its completion: the whole conversation, its turns,
    finish reason, tool calls and errors, per-turn rewards (nothing for a single-turn rollout)."""
    o = trajectory.outcome
    if o.messages is None:
        return {}
    return {"messages": o.messages, "turns": trajectory.turns, "finish_reason": trajectory.finish_reason,
            "tool_calls": o.tool_calls, "tool_errors": o.tool_errors,
            **({"turn_rewards": o.turn_rewards} if o.turn_rewards else {}),
            **({"infrastructure_error": o.infrastructure_error} if o.failed else {})}


class Rollouts:
    """Rollout batches of the policy (see the module docstring).

    Args:
        engine: the rollout engine (:mod:`llmtune.rl.engines`), built from the policy, never from the trainer.
        agent: the multi-turn loop (:class:`llmtune.rl.agent.AgentLoop`) on that engine, or None (one turn).
        sampling, eval_sampling: the rollouts' and the greedy evaluation's settings.
        rows_of: ``fn(iteration) -> (rows, group ids)``, this rank's prompt rows of an iteration (the stage's).
        seed: ``rollout.seed``, else ``train.seed``. pad_id: the pad id of the batches. ranks: this process.
        max_staleness: ``rollout.max_staleness`` (0 = sample synchronously). lookahead, iterations: the background
            sampler's iterations ahead and the run's iterations (with max_staleness > 0).
        log_metrics: adds metrics to the next training log. flops_model: the model whose FLOPs a sampled token costs.

    Raises:
        RecipeError: ``max_staleness`` > 0 with an engine that samples on the training model (hf).
    """

    def __init__(self, engine: RolloutEngine, agent, sampling: SamplingParams, eval_sampling: SamplingParams,
                 rows_of: Callable[[int], tuple[list[dict], list[int]]], seed: int, pad_id: int, ranks: Ranks,
                 log_metrics: Callable[[dict], None], flops_model=None, max_staleness: int = 0, lookahead: int = 0,
                 iterations: int = 0):
        self.engine, self.agent = engine, agent
        self.sampling, self.eval_sampling = sampling, eval_sampling
        self.rows_of, self.seed, self.pad_id, self.ranks = rows_of, seed, pad_id, ranks
        self.log_metrics, self.flops_model = log_metrics, flops_model
        self.max_staleness = max_staleness
        self.generation_s = 0.0  # seconds the trainer spent sampling (or waiting for samples) since the last log
        self.prefetch = None
        if max_staleness:
            from llmtune.config import RecipeError
            from llmtune.rl.prefetch import RolloutPrefetcher

            if not isinstance(engine, BackgroundEngine):
                raise RecipeError([("rollout.max_staleness", f"{max_staleness} samples the next rollout batches while "
                                    "the trainer trains, which needs an engine in another process: the hf engine "
                                    "samples on the training model itself. Use rollout.engine: vllm (colocate or "
                                    "server), or max_staleness: 0")])
            self.prefetch = RolloutPrefetcher(engine, self.trajectories, lookahead, iterations)

    # ---- one iteration ---------------------------------------------------------------------------------------
    def start(self, iteration: int, step: int) -> None:
        """Before iteration ``iteration`` (the trainer at optimizer step ``step``): the engine samples from the policy
        of this step (``sync``), or the background sampler is topped up with batches sampled from a snapshot of it."""
        if self.prefetch is None:
            self.engine.sync(step)
        else:
            self.prefetch.schedule(iteration, self.plan, lambda: self.engine.snapshot(step))

    def plan(self, iteration: int) -> tuple[list[dict], list[int], SamplingParams]:
        """What the background sampler samples for ``iteration``: its rows, groups, and the sampling settings with
        the iteration's own seed (never torch's global RNG, which the training thread uses)."""
        rows, groups = self.rows_of(iteration)
        return rows, groups, replace(self.sampling, seed=iteration_seed(self.seed, iteration, self.ranks.rank,
                                                                        salt=17))

    def batch(self, iteration: int, step: int) -> RolloutBatch:
        """The rollouts of iteration ``iteration``: sampled now from the policy of this step, or (``max_staleness``
        > 0) taken from the background sampler, sampled from an earlier version (``rollout/staleness_*``)."""
        if self.prefetch is None:
            return self.sample(*self.rows_of(iteration))
        got, waited = self.prefetch.take(iteration)
        self.generation_s += waited  # the time the trainer did not train
        batch = self._batch(got.trajectories, got.seconds)
        staleness = (step - batch.versions).float()
        stale = self.too_stale(batch, step)
        self.log_metrics({"rollout/staleness_mean": float(staleness.mean()),
                          "rollout/staleness_max": float(staleness.max()),
                          "rollout/stale_dropped_fraction": float(stale.float().mean()),
                          "rollout/wait_s": waited, "rollout/engine_idle_s": got.engine_idle_s})
        if stale.any():
            log.warning("%d of %d rollouts of iteration %d are more than rollout.max_staleness = %d optimizer steps "
                        "stale: not trained on", int(stale.sum()), len(stale), iteration, self.max_staleness)
        return batch

    def too_stale(self, batch: RolloutBatch, step: int) -> torch.Tensor:
        """(B,) bool: rollouts sampled more than ``rollout.max_staleness`` optimizer steps before ``step`` (or by an
        unknown version) when rollouts are sampled ahead; never trained on. All False when they are not (every
        rollout is sampled from the current policy)."""
        if self.prefetch is None:
            return torch.zeros(len(batch.trajectories), dtype=torch.bool, device=batch.versions.device)
        return (batch.versions < 0) | (step - batch.versions > self.max_staleness)

    # ---- sampling ----------------------------------------------------------------------------------------------
    def sample(self, rows: list[dict], groups: list[int] | None = None, greedy: bool = False) -> RolloutBatch:
        """Sample one trajectory per prompt row through the engine now: prompt ids in, completion ids (and the
        engine's log-probs) out, padded into a :class:`~llmtune.rl.types.RolloutBatch` on the training device.

        Args:
            rows: B prompt rows (``input_ids`` and the row's columns). groups: (B,) group ids (default 0..B-1).
            greedy: the evaluation's decoding (``rollout.eval_max_new_tokens``; no metrics logged).

        Sampling logs ``generation_tokens_per_s`` (real completion tokens per second of sampling, this rank),
        ``generation_tflops_per_s`` (their model FLOPs, a KV-cached forward per token, :mod:`llmtune.core.flops`),
        ``generation_mfu`` (that over this device's peak, where known) and ``rollout/sample_s`` (seconds the engine
        sampled the batch; with ``max_staleness`` > 0 while the trainer trained).
        """
        sampling = self.eval_sampling if greedy else self.sampling
        groups = list(range(len(rows))) if groups is None else groups
        start = time.perf_counter()
        trajectories = self.trajectories(rows, groups, sampling)
        return self._batch(trajectories, time.perf_counter() - start, greedy)

    def trajectories(self, rows: list[dict], groups: list[int], sampling: SamplingParams, version: int | None = None
                     ) -> list[Trajectory]:
        """One trajectory per row through the engine (or the agent loop), nothing else: no metrics, no collectives,
        no device tensors (the background sampler runs it in its own thread). ``version``: the policy version to
        sample with (default the current one)."""
        if self.agent is not None:  # several turns with tools (token-in/token-out, llmtune.rl.agent)
            return self.agent.run(rows, sampling, groups, version=version)
        prompts = [[int(i) for i in row["input_ids"]] for row in rows]
        extra = {} if version is None else {"version": version}
        completions = self.engine.generate(prompts, sampling, keys=groups, **extra)
        return [Trajectory.single_turn(row, p, c, g) for row, p, c, g in zip(rows, prompts, completions, groups)]

    def _batch(self, trajectories: list[Trajectory], seconds: float, greedy: bool = False) -> RolloutBatch:
        """Trajectories padded into a batch on the training device, with the sampling metrics (see :meth:`sample`;
        ``seconds``: the sampling time)."""
        from llmtune.core.flops import forward_flops_per_token, peak_tflops

        batch = RolloutBatch.from_trajectories(trajectories, self.pad_id, self.ranks.device)
        if greedy:
            return batch
        if self.agent is not None:
            self.log_metrics(self.agent_metrics(trajectories))
        if self.prefetch is None:  # sampled in the background: the trainer's share is the time it waited
            self.generation_s += seconds
        self.log_metrics({"rollout/sample_s": seconds})
        tokens = batch.loss_mask  # the tokens the policy sampled (multi-turn: not the tool results)
        tokens_per_s = float(tokens.sum()) / max(seconds, 1e-9)
        # a generated token attends to its prompt and the completion so far: on average prompt + half of it
        context = float(batch.prompt_mask.sum(1).float().mean()) + float(tokens.sum(1).float().mean() + 1) / 2
        tflops = forward_flops_per_token(self.flops_model, context) * tokens_per_s / 1e12
        peak = peak_tflops()
        self.log_metrics({"generation_tokens_per_s": tokens_per_s, "generation_tflops_per_s": tflops,
                          **({"generation_mfu": tflops / peak} if peak else {})})
        return batch

    def agent_metrics(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """:func:`llmtune.rl.agent.agent_metrics` over all ranks' rollouts of this batch, and
        ``agent/abandoned_tool_threads``: tool threads that timed out and are still running, summed over the ranks'
        processes (:func:`llmtune.rl.toolbox.abandoned_tool_threads`; a number that grows means a tool hangs)."""
        from llmtune.rl.agent import agent_metrics
        from llmtune.rl.toolbox import abandoned_tool_threads

        metrics = agent_metrics(trajectories)
        abandoned = float(abandoned_tool_threads())
        if self.ranks.world > 1:
            keys = sorted(metrics)
            values = torch.tensor([metrics[k] * len(trajectories) for k in keys] + [abandoned, len(trajectories)],
                                  device=self.ranks.device, dtype=torch.float64)
            values = self.ranks.reduce(values)
            metrics = {k: float(v) / max(float(values[-1]), 1.0) for k, v in zip(keys, values[:-2])}
            abandoned = float(values[-2])
        return {**metrics, "agent/abandoned_tool_threads": abandoned}

    # ---- checkpoints and the end ---------------------------------------------------------------------------------
    def drain(self) -> None:
        """Wait until the background sampler is idle (before the trainer uses the engine itself: an evaluation)."""
        if self.prefetch is not None:
            self.prefetch.drain()

    def close(self) -> None:
        """Free the background sampler, the agent loop's threads and the engine (never hiding the error that ended
        the run)."""
        if self.prefetch is not None:
            self.prefetch.close()
        if self.agent is not None:
            self.agent.close()
        try:
            self.engine.close()
        except Exception as exc:  # noqa: BLE001 - never hide the error that ended the run behind a failed close
            log.warning("closing the rollout engine failed: %s", exc)


def build_agent_loop(recipe, engine: RolloutEngine, tokenizer, tools, stop_ids: list[int]):
    """The multi-turn loop of ``agent:`` (:class:`llmtune.rl.agent.AgentLoop`) on ``engine``, with the template's ids
    between turns computed for the run's stop set.

    Args:
        tools: the run's :class:`llmtune.rl.stage.AgentTools` (functions, environment, schemas).
    """
    from llmtune.data.prompts import prompt_ids
    from llmtune.rl.agent import AgentLoop, AgentSettings
    from llmtune.rl.chat import ToolTurns
    from llmtune.rl.tool_calls import resolve_tool_parser

    cfg = recipe.agent
    parser, response_template = resolve_tool_parser(cfg.tool_parser, tokenizer)
    settings = AgentSettings(cfg.max_turns, cfg.max_tool_result_tokens, cfg.tool_timeout_s, parser, response_template,
                             cfg.max_tool_calls, tuple(cfg.infrastructure_timeouts), cfg.tool_threads, cfg.lockstep)
    turns = ToolTurns(tokenizer, tools.schemas, stop_ids)
    return AgentLoop(engine, tokenizer, turns, tools.functions, tools.environment, settings,
                     lambda messages: prompt_ids(tokenizer, messages, tools=tools.schemas),
                     recipe.data.max_prompt_length or recipe.data.max_length)
