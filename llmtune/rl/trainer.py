"""The online-RL trainer shared by PPO and GRPO: rollouts feed transformers' own training loop.

Everything around the optimizer step is ``transformers.Trainer``'s (optimizer, schedule, clipping, DDP/DeepSpeed
no-sync and accumulation, fp16/bf16, logging, callbacks, checkpoints with optimizer/scheduler state): the trainer's
dataloader only counts optimizer steps (:class:`_StepSlots`), and :meth:`OnlineRLTrainer.get_batch_samples` hands the
loop the micro-batches of the next optimizer step instead of dataloader rows, sampling a new rollout batch (the
stage's :meth:`make_experience`) when the last one is used up. Gradient accumulation is exact as in the other
stages: the loss of a micro-batch is its sum divided by the stage's item count of the whole optimizer step over all
ranks (:meth:`CoreTrainer._get_num_items_in_batch`).

Shared here, in the order data flows: prompt order and seeding; sampling through the rollout engine
(:func:`llmtune.rl.engines.build_engine`: ``hf`` or vLLM, built from the policy (:class:`llmtune.rl.engines.Policy`),
synced to it before every rollout batch and evaluation, the only way weights reach it; closed with :meth:`close`)
into typed trajectories and a :class:`~llmtune.rl.types.RolloutBatch` (:meth:`sample`); rewards
(:mod:`llmtune.rewards.sources`); the rollout forwards (:func:`llmtune.rl.forward.rollout_forward`); the engine/trainer
log-prob mismatch and its truncated importance weights (:meth:`engine_correction`); the stage's experience
(:class:`~llmtune.rl.types.Experience`, made by its :meth:`make_experience`) cut into the micro-batches of each
optimizer step; sample logs, the greedy evaluation, adapter checkpoints, and the time split between generation and
training.

Resume: a checkpoint is only written at the end of an iteration (one rollout batch; save_steps is a multiple of
it), so a resumed run starts with a fresh rollout. Sampling, dropout and minibatch order are seeded from (seed,
iteration, rank), not from the RNG state saved in the checkpoint, so a resumed run draws exactly what the
uninterrupted run drew.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from llmtune.core.rundir import SAMPLES
from llmtune.core.trainer import CoreTrainer
from llmtune.data.prompts import PromptCollator
from llmtune.data.templates import stop_token_ids
from llmtune.rewards.sources import Scored, build_reward_sources, decode_completions  # noqa: F401
from llmtune.rl import ops
from llmtune.rl.engines import EngineSite, Policy, build_engine, sampling_from_recipe
from llmtune.rl.forward import RolloutForward, rollout_forward
from llmtune.rl.model import POLICY
from llmtune.rl.types import Experience, Layout, RolloutBatch, Trajectory
from llmtune.utils import get_logger

log = get_logger("rl")


def _number(x: torch.Tensor) -> float | None:
    """A score for the sample logs: None where every reward function abstained (JSON has no NaN)."""
    value = float(x)
    return None if value != value else value


class _StepSlots(torch.utils.data.Dataset):
    """What the trainer's dataloader iterates over: one item per (optimizer step x sample), nothing else. It only
    gives transformers' loop its length (max_steps x global batch); the rows come from the rollouts."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _slot_collate(items: list[int]) -> dict[str, torch.Tensor]:
    return {"slot": torch.tensor(items)}


class OnlineRLTrainer(CoreTrainer):
    """``CoreTrainer`` whose micro-batches come from rollouts; a stage subclass implements :meth:`build_model`
    and :meth:`make_experience` and sets ``steps_per_iteration`` (optimizer steps per rollout batch) before
    calling this constructor.

    Constructed by the runner like every stage trainer: ``train_dataset``/``eval_dataset`` are prompt rows
    (``llmtune.data.prompts``), ``data_collator`` left-pads them, ``model`` is the peft policy (adapter ``default``).
    ``recipe.rollout`` supplies the sampling settings (``temperature``/``top_p``/``top_k``, ``max_new_tokens``,
    ``eval_max_new_tokens``) and the engine; the stage's section (``recipe.<stage name>``) ``sample_every``.

    Raises:
        ValueError: the tokenizer has no way to end a completion (no EOS, no end-of-turn token).
        ModelLoadError: a reward run cannot be loaded.
        RewardFunctionError: a reward function cannot be imported or returns bad values.
    """

    steps_per_iteration: int = 1
    flops_tokens_key = "train_tokens_per_s"  # model FLOPs / MFU of the optimizer steps over their own time
    score_name, length_name, per_source_eval = "score", "response_length", False  # eval metric names
    kl_per_token = False  # eval_kl in the unit of the stage's training `kl`: per response (PPO) or per token (GRPO)

    def __init__(self, *positional, stage, model, train_dataset, eval_dataset=None, data_collator=None,
                 processing_class=None, **kwargs):
        recipe = stage.recipe
        self.cfg = getattr(recipe, stage.name)
        self.rollout = recipe.rollout  # sampling settings and the rollout engine (shared by PPO and GRPO)
        self.tokenizer = processing_class
        self.prompts, self.eval_prompts = train_dataset, eval_dataset
        # THE stop set (tokenizer EOS, template end of turn, the model's generation-config EOS list): every engine
        # stops on these ids and nothing else
        self.stop_ids = stop_token_ids(processing_class, getattr(model, "generation_config", None))
        if not self.stop_ids:
            raise ValueError("the tokenizer has no EOS token and its chat template ends turns with no special token: "
                             "responses could never end; set the tokenizer's eos_token (or data.chat_template)")
        self.pad_id = PromptCollator(processing_class).pad_token_id  # prompts left-, completions right-padded
        self.sampling = sampling_from_recipe(recipe, self.stop_ids)
        self.eval_sampling = sampling_from_recipe(recipe, self.stop_ids, greedy=True)
        self._buffer: list[list[dict[str, torch.Tensor]]] = []
        self._rollout_s = 0.0  # seconds spent making experience since the last log (not training)
        self._generation_s = 0.0  # of which sampling
        self._iteration_start: float | None = None  # when the current iteration started (its rollout batch)
        self._eval_s = 0.0  # seconds of evaluation since then
        self.agent_tools = stage.agent_tools() if hasattr(stage, "agent_tools") else None  # multi-turn tools, or None
        environment = self.agent_tools.environment if self.agent_tools else None
        self.rewards = build_reward_sources(recipe.reward, processing_class, recipe_dir=stage.recipe_dir,
                                            precision=recipe.precision,
                                            environment_weight=recipe.agent.environment_reward_weight
                                            if environment is not None and hasattr(environment, "reward") else None,
                                            multi_turn=recipe.agent.enabled)
        wrapped = self.build_model(model, recipe)
        args = kwargs.pop("args")
        args.metric_for_best_model = None  # evaluated by generation: there is no eval_loss to track
        slots = _StepSlots((recipe.train.max_steps or 0) * recipe.train.global_batch_size)
        super().__init__(*positional, stage=stage, model=wrapped, args=args, train_dataset=slots,
                         eval_dataset=eval_dataset, data_collator=_slot_collate, processing_class=processing_class,
                         **kwargs)
        self.rewards.to(self.args.device)
        # the rollout engine (hf or vLLM), built from the policy and where it runs; close() frees it
        policy = Policy(self.accelerator.unwrap_model(self.model).policy, POLICY, lambda: self.state.global_step,
                        self.args.device, self._generation_model, can_merge=self._can_merge())
        site = EngineSite(self.run_dir, self.args.process_index, self.args.world_size, self.args.device)
        self.engine = build_engine(recipe, policy, site, self.pad_id)
        self.agent = self._agent_loop(recipe) if self.agent_tools else None
        self.prefetch = self._prefetcher(recipe) if self.rollout.max_staleness else None

    def _prefetcher(self, recipe):
        """The background sampler of ``rollout.max_staleness`` > 0 (:class:`llmtune.rl.prefetch.RolloutPrefetcher`),
        ``max_staleness // steps_per_iteration`` iterations ahead.

        Raises:
            RecipeError: the engine samples on the training model (hf: nothing to overlap), or the bound is below
                one iteration's optimizer steps (no whole rollout batch could be sampled ahead).
        """
        from llmtune.config import RecipeError
        from llmtune.rl.prefetch import RolloutPrefetcher

        bound, spi = self.rollout.max_staleness, self.steps_per_iteration
        if not hasattr(self.engine, "snapshot"):
            self.close()
            raise RecipeError([("rollout.max_staleness", f"{bound} samples the next rollout batches while the trainer "
                                "trains, which needs an engine in another process: the hf engine samples on the "
                                "training model itself. Use rollout.engine: vllm (colocate or server), or "
                                "max_staleness: 0")])
        if bound < spi:
            self.close()
            raise RecipeError([("rollout.max_staleness", f"{bound} optimizer steps is less than one iteration "
                                f"({spi} steps: {self.cfg.__class__.__name__.removesuffix('Config').lower()} "
                                "rollout batch / train.global_batch_size x its passes): a batch sampled one iteration "
                                f"ahead is {spi} steps stale. Set it to 0 or >= {spi} (a multiple of {spi}: "
                                f"{spi} = one iteration ahead)")])
        iterations = -(-(self.args.max_steps or 0) // spi)
        return RolloutPrefetcher(self.engine, self._trajectories, bound // spi, iterations)

    def _agent_loop(self, recipe):
        """The multi-turn loop of ``agent:`` (:class:`llmtune.rl.agent.AgentLoop`) on this run's engine, with the
        template's ids between turns computed for the run's stop set."""
        from llmtune.data.prompts import prompt_ids
        from llmtune.rl.agent import AgentLoop, AgentSettings
        from llmtune.rl.chat import ToolTurns
        from llmtune.rl.tool_calls import resolve_tool_parser

        cfg, tools, tok = recipe.agent, self.agent_tools, self.tokenizer
        parser, response_template = resolve_tool_parser(cfg.tool_parser, tok)
        settings = AgentSettings(cfg.max_turns, cfg.max_tool_result_tokens, cfg.tool_timeout_s, parser,
                                 response_template)
        turns = ToolTurns(tok, tools.schemas, self.stop_ids)
        return AgentLoop(self.engine, tok, turns, tools.functions, tools.environment, settings,
                         lambda messages: prompt_ids(tok, messages, tools=tools.schemas),
                         recipe.data.max_prompt_length or recipe.data.max_length)

    @contextlib.contextmanager
    def _generation_model(self):
        """The peft policy ready to ``generate``: under DeepSpeed ZeRO-3 its gathered weights
        (``trl.models.utils.unwrap_model_for_generation``), in the trainer's autocast."""
        from trl.models.utils import unwrap_model_for_generation

        with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as unwrapped, \
                self.compute_loss_context_manager():
            yield unwrapped.policy

    def _can_merge(self) -> bool:
        """Merging the adapter for sampling swaps parameter tensors in place: not under ZeRO-3 (partitioned,
        gathered only for generation) or FSDP (sharded flat parameters)."""
        if getattr(self, "is_fsdp_enabled", False):
            return False
        if getattr(self, "is_deepspeed_enabled", False):
            plugin = self.accelerator.state.deepspeed_plugin
            return plugin is None or plugin.zero_stage != 3
        return True

    # ---- what a stage supplies ------------------------------------------------------------------
    def build_model(self, policy, recipe) -> torch.nn.Module:
        """The module trained (a :class:`~llmtune.rl.model.PolicyModel` or a subclass) around the peft policy."""
        raise NotImplementedError

    def make_experience(self, iteration: int) -> list[list[dict[str, torch.Tensor]]]:
        """Sample and score rollout batch ``iteration``; return its optimizer steps, each a list of micro-batches
        (:meth:`~llmtune.rl.types.Experience.micro_batch` dicts)."""
        raise NotImplementedError

    @property
    def run_dir(self) -> Path:
        return Path(self.args.output_dir).parent

    # ---- the dataloader only counts steps ---------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def _load_rng_state(self, checkpoint):
        """Not restored: every iteration seeds sampling, dropout and minibatch order from (seed, iteration, rank),
        so a resumed run already draws what the uninterrupted run drew."""
        return

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The micro-batches of the next optimizer step and its item count (all micro-batches, all ranks)."""
        for _ in range(num_batches):  # keep the step-counting dataloader in step with the loop
            try:
                next(epoch_iterator)
            except StopIteration:
                break
        if not self._buffer:
            start = time.perf_counter()
            if self._iteration_start is not None:  # the previous iteration, sampling + training, evaluations excluded
                self.add_metrics({"iteration_s": start - self._iteration_start - self._eval_s})
            self._iteration_start, self._eval_s = start, 0.0
            step = self.state.global_step
            iteration = step // self.steps_per_iteration
            if self.prefetch is None:
                self.engine.sync(step)  # the engine samples from the policy of this step
            else:  # the next batches are sampled in the background, from the policy of this step
                self.prefetch.schedule(iteration, self._plan, lambda: self.engine.snapshot(step))
            self._buffer = self.make_experience(iteration)
            self._rollout_s += time.perf_counter() - start
        micro_batches = self._buffer.pop(0)
        return micro_batches, self._get_num_items_in_batch(micro_batches, device)

    # ---- rollouts ---------------------------------------------------------------------------------
    def prompt_indices(self, iteration: int, size: int) -> list[int]:
        """Rows of this rank's prompts for iteration ``iteration``: the global order is a concatenation of
        per-epoch permutations seeded by (seed, epoch); iteration i takes the next ``size`` rows of it (prompts over
        all ranks), dealt to ranks round-robin."""
        n = len(self.prompts)
        start = iteration * size
        order: list[int] = []
        epoch = start // n
        while len(order) < (start % n) + size:
            gen = torch.Generator().manual_seed(self.args.seed + epoch)
            order += torch.randperm(n, generator=gen).tolist()
            epoch += 1
        batch = order[start % n: start % n + size]
        return batch[self.args.process_index::self.args.world_size]

    def _seed(self, iteration: int, salt: int = 0) -> None:
        from transformers import set_seed

        set_seed(self.iteration_seed(iteration, salt))

    def iteration_seed(self, iteration: int, salt: int = 0) -> int:
        """The seed of iteration ``iteration`` on this rank: (``rollout.seed``, else ``train.seed``) + iteration and
        rank terms, modulo numpy's seed range (seed + 1_000_003 x iteration passes 2**32 after ~4,300 iterations)."""
        seed = self.args.seed if self.rollout.seed is None else self.rollout.seed
        return (seed + 1_000_003 * iteration + 7919 * self.args.process_index + salt) % 2**32

    # ---- what each iteration samples ------------------------------------------------------------------
    def rollout_rows(self, iteration: int) -> tuple[list[dict], list[int]]:
        """This rank's prompt rows of iteration ``iteration`` (one per trajectory) and their group ids."""
        raise NotImplementedError

    def _plan(self, iteration: int):
        """What the background sampler samples for ``iteration``: its rows, groups, and the sampling settings with
        the iteration's own seed (never torch's global RNG, which the training thread uses)."""
        from dataclasses import replace

        rows, groups = self.rollout_rows(iteration)
        return rows, groups, replace(self.sampling, seed=self.iteration_seed(iteration, salt=17))

    def rollout_batch(self, iteration: int) -> RolloutBatch:
        """The rollouts of iteration ``iteration``: sampled now from the policy of this step, or (``max_staleness``
        > 0) taken from the background sampler, sampled from an earlier version (``rollout/staleness_*``)."""
        if self.prefetch is None:
            rows, groups = self.rollout_rows(iteration)
            return self.sample(rows, groups)
        got, waited = self.prefetch.take(iteration)
        self._generation_s += waited  # the time the trainer did not train
        batch = self._batch(got.trajectories, got.seconds)
        staleness = (self.state.global_step - batch.versions).float()
        stale = self.too_stale(batch)
        self.add_metrics({"rollout/staleness_mean": float(staleness.mean()),
                          "rollout/staleness_max": float(staleness.max()),
                          "rollout/stale_dropped_fraction": float(stale.float().mean()),
                          "rollout/wait_s": waited, "rollout/engine_idle_s": got.engine_idle_s})
        if stale.any():
            log.warning("%d of %d rollouts of iteration %d are more than rollout.max_staleness = %d optimizer steps "
                        "stale: not trained on", int(stale.sum()), len(stale), iteration, self.rollout.max_staleness)
        return batch

    def too_stale(self, batch: RolloutBatch) -> torch.Tensor:
        """(B,) bool: rollouts sampled more than ``rollout.max_staleness`` optimizer steps before the current step
        (or by an unknown version) when rollouts are sampled ahead; never trained on. All False when they are not
        (every rollout is sampled from the current policy)."""
        if self.prefetch is None:
            return torch.zeros(len(batch.trajectories), dtype=torch.bool, device=batch.versions.device)
        return (batch.versions < 0) | (self.state.global_step - batch.versions > self.rollout.max_staleness)

    def close(self) -> None:
        """Free the rollout engine and the background sampler (the runner calls this when the stage ends, also on
        errors)."""
        prefetch = getattr(self, "prefetch", None)
        if prefetch is not None:
            prefetch.close()
        engine = getattr(self, "engine", None)
        if engine is None:
            return
        try:
            engine.close()
        except Exception as exc:  # noqa: BLE001 - never hide the error that ended the run behind a failed close
            log.warning("closing the rollout engine failed: %s", exc)

    def sample(self, rows: list[dict], groups: list[int] | None = None, greedy: bool = False) -> RolloutBatch:
        """Sample one trajectory per prompt row through the engine: prompt ids in, completion ids (and the engine's
        log-probs) out, padded into a :class:`~llmtune.rl.types.RolloutBatch` on the training device.

        Args:
            rows: B prompt rows (``input_ids`` and the row's columns). groups: (B,) group ids (default 0..B-1).
            greedy: the evaluation's decoding (``rollout.eval_max_new_tokens``; no metrics logged).

        Sampling logs ``generation_tokens_per_s`` (real completion tokens per second of sampling, this rank),
        ``generation_tflops_per_s`` (their model FLOPs, a KV-cached forward per token, :mod:`llmtune.core.flops`),
        ``generation_mfu`` (that over this device's peak, where known) and ``rollout/sample_s`` (seconds the engine
        sampled the batch; with ``max_staleness`` > 0 while the trainer trained). Every iteration also logs
        ``iteration_s`` (wall seconds of the previous iteration, sampling + training, evaluations excluded).
        """
        sampling = self.eval_sampling if greedy else self.sampling
        groups = list(range(len(rows))) if groups is None else groups
        start = time.perf_counter()
        trajectories = self._trajectories(rows, groups, sampling)
        return self._batch(trajectories, time.perf_counter() - start, greedy)

    def _trajectories(self, rows: list[dict], groups: list[int], sampling, version: int | None = None
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

        batch = RolloutBatch.from_trajectories(trajectories, self.pad_id, self.args.device)
        if greedy:
            return batch
        if self.agent is not None:
            self.add_metrics(self._agent_metrics(trajectories))
        if self.prefetch is None:  # sampled in the background: the trainer's share is the time it waited
            self._generation_s += seconds
        self.add_metrics({"rollout/sample_s": seconds})
        tokens = batch.loss_mask  # the tokens the policy sampled (multi-turn: not the tool results)
        tokens_per_s = float(tokens.sum()) / max(seconds, 1e-9)
        # a generated token attends to its prompt and the completion so far: on average prompt + half of it
        context = float(batch.prompt_mask.sum(1).float().mean()) + float(tokens.sum(1).float().mean() + 1) / 2
        tflops = forward_flops_per_token(self.model, context) * tokens_per_s / 1e12
        peak = peak_tflops()
        self.add_metrics({"generation_tokens_per_s": tokens_per_s, "generation_tflops_per_s": tflops,
                          **({"generation_mfu": tflops / peak} if peak else {})})
        return batch

    def score(self, batch: RolloutBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(total, per_source)`` of the reward sources on a rollout batch
        (:meth:`llmtune.rewards.sources.RewardSources.score`), on the training device. A multi-turn rollout's reward
        functions see its final answer as the completion, and its whole conversation (``messages``) and environment
        instance (``environments``); a rollout whose environment or tool infrastructure failed abstains from every
        source (NaN: left out of its group's statistics, counted), never scores 0."""
        scored = self.scored(batch)
        total, per_source = self.rewards.score(scored, self.args.device)
        failed = torch.tensor([bool(t.info.get("infrastructure_error")) for t in batch.trajectories],
                              device=total.device)
        if failed.any():
            total = total.masked_fill(failed, float("nan"))
            per_source = {n: v.masked_fill(failed.to(v.device), float("nan")) for n, v in per_source.items()}
        return total, per_source

    def scored(self, batch: RolloutBatch) -> Scored:
        """What the reward sources see of a batch (:class:`llmtune.rewards.sources.Scored`)."""
        if self.agent is None:
            return Scored(batch.rows, decode_completions(self.tokenizer, batch), batch)
        conversations = [t.info["messages"] for t in batch.trajectories]
        finals = [next((m.get("content") or "" for m in reversed(c) if m["role"] == "assistant"), "")
                  for c in conversations]
        return Scored(batch.rows, finals, batch, conversations, [t.info.get("environment") for t in
                                                                 batch.trajectories])

    def conversation(self, batch: RolloutBatch, b: int) -> dict:
        """What ``samples.jsonl`` shows of a multi-turn rollout beside its completion: the whole conversation, its
        turns, finish reason, tool calls and errors (nothing for a single-turn run)."""
        if self.agent is None:
            return {}
        t = batch.trajectories[b]
        return {"messages": t.info["messages"], "turns": t.turns, "finish_reason": t.finish_reason,
                "tool_calls": t.info.get("tool_calls", 0), "tool_errors": t.info.get("tool_errors", {}),
                **({"infrastructure_error": t.info["infrastructure_error"]} if t.info.get("infrastructure_error")
                   else {})}

    def _agent_metrics(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """:func:`llmtune.rl.agent.agent_metrics` over all ranks' rollouts of this batch, and
        ``agent/abandoned_tool_threads``: tool threads that timed out and are still running, summed over the ranks'
        processes (:func:`llmtune.rl.toolbox.abandoned_tool_threads`; a number that grows means a tool hangs)."""
        from llmtune.rl.agent import agent_metrics
        from llmtune.rl.toolbox import abandoned_tool_threads

        metrics = agent_metrics(trajectories)
        abandoned = float(abandoned_tool_threads())
        if self.args.world_size > 1:
            keys = sorted(metrics)
            values = torch.tensor([metrics[k] * len(trajectories) for k in keys] + [abandoned, len(trajectories)],
                                  device=self.args.device, dtype=torch.float64)
            values = self.accelerator.reduce(values, reduction="sum")
            metrics = {k: float(v) / max(float(values[-1]), 1.0) for k, v in zip(keys, values[:-2])}
            abandoned = float(values[-2])
        return {**metrics, "agent/abandoned_tool_threads": abandoned}

    def forward(self, batch: RolloutBatch, *, policy: bool = True, reference: bool = False, values: bool = False,
                exact_kl: bool = False, temperature: float | None = None) -> RolloutForward:
        """The rollout forwards of a batch (:func:`llmtune.rl.forward.rollout_forward`) in chunks of the eval batch
        size, at the sampling temperature (evaluation: 1), with the engine's truncated log-probs when the engine
        reported log-probs under a truncated distribution (:attr:`correction_truncation`)."""
        truncation = self.correction_truncation(batch) if policy and not exact_kl else None
        return rollout_forward(self.model, batch.model_inputs(), batch.completion_ids,
                               temperature=self.rollout.temperature if temperature is None else temperature,
                               chunk_rows=self.args.per_device_eval_batch_size, policy=policy, reference=reference,
                               values=values, exact_kl=exact_kl, truncation=truncation,
                               autocast=self.compute_loss_context_manager,
                               score_mask=None if exact_kl else batch.loss_mask)

    def correction_truncation(self, batch: RolloutBatch) -> tuple[int, float] | None:
        """``(top_k, top_p)`` when the batch's engine log-probs are under a truncated distribution (vLLM's
        ``processed_logprobs`` with ``rollout.top_k`` > 0 or ``rollout.top_p`` < 1): the trainer's side of the
        importance ratio must be taken under the same truncation (:func:`llmtune.rl.ops.sampling_logps`). None when
        the engine reported no log-probs (``hf``: nothing to compare) or sampling is not truncated."""
        return self.sampling.truncation if batch.engine_logps is not None else None

    def engine_correction(self, experience: Experience, batch: RolloutBatch, fwd: RolloutForward | None = None
                          ) -> None:
        """Measure the engine/trainer mismatch of a rollout batch and, with
        ``rollout.vllm.importance_sampling_correction``, put the truncated importance weights into the experience
        (``is_weights`` (B, N), TOKEN layout, detached, 0 on padding and on tokens the policy did not sample; the
        policy losses multiply their per-token surrogate by it). Nothing happens when the engine reported no log-probs
        (``hf``).

        Logs, over all ranks' sampled tokens: ``rollout/logprob_diff_mean``/``_max`` (|trainer - engine| log-prob of
        the sampled tokens, nats), ``rollout/is_weight_mean`` and ``rollout/is_clipped_fraction``
        (:func:`llmtune.rl.ops.engine_mismatch_metrics`).

        Args:
            experience: the rollout batch's experience (updated). batch: the rollout batch (its ``engine_logps``
                and ``loss_mask``). fwd: the batch's :meth:`forward` when already computed (its policy log-probs
                are the old log-probs), else the policy is run here.

        Both sides of the ratio are log-probs under the SAME distribution: the engine's are under its sampling
        distribution (temperature, then ``top_k``/``top_p`` truncation, renormalised), so the trainer's are taken
        under the same truncation of its own logits (``sampling_logps``); with the full-vocabulary log-prob the
        on-policy weight would be the kept probability mass, not 1 (issue 30).
        """
        if batch.engine_logps is None:
            return
        truncation = self.correction_truncation(batch)
        if fwd is None or fwd.logps is None:
            fwd = self.forward(batch)
        if truncation is not None and fwd.sampling_logps is None:
            raise RuntimeError("engine_correction: the rollout forward was run without the engine's truncation: a bug")
        trainer_logps = fwd.sampling_logps if truncation is not None else fwd.logps
        sampled = batch.loss_mask.float()  # the tokens the engine sampled (tool / environment tokens are not)
        engine_logps = torch.where(sampled.bool(), batch.engine_logps, torch.zeros_like(batch.engine_logps))
        cap = self.rollout.vllm.importance_sampling_cap
        stats = ops.engine_mismatch_stats(trainer_logps, engine_logps, sampled, cap)[None]  # (1, 6)
        if self.args.world_size > 1:
            stats = self.accelerator.gather(stats)  # (ranks, 6)
        metrics = ops.engine_mismatch_metrics(stats)
        if "rollout/engine_logp_nonfinite_fraction" in metrics:
            log.warning("the rollout engine reported non-finite log-probs for %.2g%% of the sampled tokens (step %d): "
                        "their importance weight is 0 (an engine in bf16/fp16 overflowing? rollout.vllm.dtype)",
                        100 * metrics["rollout/engine_logp_nonfinite_fraction"], self.state.global_step)
        self.add_metrics(metrics)
        if self.rollout.vllm.importance_sampling_correction:
            experience.add("is_weights", ops.truncated_is_weights(trainer_logps, engine_logps, sampled, cap),
                           Layout.TOKEN)

    def add_metrics(self, metrics: dict[str, float]) -> None:
        """Add metrics to the next training log (averaged with the other values logged until then, all ranks)."""
        for key, value in metrics.items():
            self._metric_sums[key] += float(value)
            self._metric_counts[key] += 1

    def write_samples(self, iteration: int, records: list[dict]) -> None:
        """Append a few rollout records (prompt, completion, rewards ...) to ``samples.jsonl`` (main process)."""
        if not self.is_world_process_zero():
            return
        with (self.run_dir / SAMPLES).open("a") as f:
            for record in records:
                f.write(json.dumps({"step": self.state.global_step, "iteration": iteration, **record}) + "\n")

    # ---- logging: generation and training time apart --------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Training logs also carry ``train_tokens_per_s`` (tokens through forward/backward per second of the
        optimizer steps, rollouts excluded; all ranks) and ``generation_share`` (fraction of the wall time since
        the last log spent sampling)."""
        if "loss" in logs:
            elapsed = max(time.perf_counter() - self._last_log_time, 1e-9)
            seen = self.seen_tokens * self.args.world_size
            logs["train_tokens_per_s"] = (seen - self._last_log_tokens) / max(elapsed - self._rollout_s, 1e-9)
            logs["generation_share"] = min(self._generation_s / elapsed, 1.0)
            self._rollout_s = self._generation_s = 0.0
        super().log(logs, start_time)

    # ---- evaluation: greedy responses to held-out prompts ------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Greedy responses to the held-out prompts (sharded over ranks), scored like the rollouts.

        Returns (and logs), with ``<score>``/``<length>`` the stage's names (PPO: ``score``/``response_length``,
        GRPO: ``reward``/``completion_length``): ``eval_<score>`` (mean weighted reward), ``eval_<score>_std``,
        ``eval_rewards/<source>`` (each source's mean, GRPO), ``eval_kl`` (the exact KL(policy || reference) over
        the response tokens of the greedy path, nats, in the unit of the stage's training ``kl``: summed per response
        and averaged over responses for PPO, averaged over all response tokens for GRPO (``kl_per_token``)), ``eval_<length>`` (tokens),
        ``eval_truncated_fraction``, ``eval_prompts``.
        """
        rows_all = eval_dataset if eval_dataset is not None else self.eval_prompts
        if rows_all is None or len(rows_all) == 0:
            return {}
        eval_start = time.perf_counter()
        if self.prefetch is not None:  # the engine is the background sampler's until it is done
            self.prefetch.drain()
        self.engine.sync(self.state.global_step)  # greedy answers of the policy of this step
        indices = list(range(len(rows_all)))[self.args.process_index::self.args.world_size]
        size = self.args.per_device_eval_batch_size
        per_row, samples = [], []
        names = self.rewards.names
        from tqdm.auto import tqdm

        progress = tqdm(total=len(indices), desc="eval: greedy responses", unit="prompt", leave=False,
                        disable=not self.is_world_process_zero() or self.args.disable_tqdm)
        for start in range(0, len(indices), size):
            rows = [rows_all[i] for i in indices[start:start + size]]
            batch = self.sample(rows, greedy=True)
            fwd = self.forward(batch, reference=True, exact_kl=True, temperature=1.0)
            total, per_source = self.score(batch)
            mask = batch.completion_mask
            kl = (fwd.kl_exact * batch.loss_mask).sum(1)  # over the policy's tokens (not a tool result's)
            per_row.append(torch.stack([total.to(kl.device), kl, mask.sum(1).float(), (~batch.ended).float(),
                                        batch.loss_mask.sum(1).float(),
                                        *(per_source[n].to(kl.device) for n in names)], 1))
            progress.update(len(rows))
            if len(samples) < 8:
                texts = self.scored(batch).completions
                for b, (row, text) in enumerate(zip(rows, texts)):
                    samples.append({"prompt": row["prompt"], "response": text, "score": _number(total[b]),
                                    **({"rewards": {n: _number(per_source[n][b]) for n in names}}
                                       if self.per_source_eval else {}), **self.conversation(batch, b)})
        progress.close()
        stats = torch.cat(per_row) if per_row else torch.zeros(0, 5 + len(names), device=self.args.device)
        if self.args.world_size > 1:
            stats = self.accelerator.gather_for_metrics(stats)
        score, kl, length, truncated, sampled = stats[:, :5].T
        p, s = metric_key_prefix, self.score_name
        scored = score[~torch.isnan(score)]  # rows on which every reward function abstained have no score
        # a mean over no rows is left out (and said), never logged as NaN: metrics.jsonl stays valid JSON and a
        # missing number cannot be read as a measured one
        metrics = {}
        if len(scored):
            metrics[f"{p}_{s}"] = float(scored.mean())
            metrics[f"{p}_{s}_std"] = float(scored.std()) if len(scored) > 1 else 0.0
        else:
            log.warning("every reward function abstained on all %d eval prompts: no %s_%s at step %d",
                        len(score), p, s, self.state.global_step)
        if self.per_source_eval:
            for i, n in enumerate(names):
                column = stats[:, 5 + i]
                if (~torch.isnan(column)).any():
                    metrics[f"{p}_rewards/{n}"] = float(column.nanmean())
        metrics.update({
            f"{p}_kl": float(kl.sum() / sampled.sum().clamp(min=1)) if self.kl_per_token else float(kl.mean()),
            f"{p}_{self.length_name}": float(length.mean()),
            f"{p}_truncated_fraction": float(truncated.mean()),
            f"{p}_prompts": float(len(score)),
        })
        if len(scored) < len(score):
            metrics[f"{p}_rewards/abstained"] = 1.0 - len(scored) / len(score)
        if self.is_world_process_zero():
            path = self.run_dir / f"eval_samples_step{self.state.global_step}.jsonl"
            path.write_text("".join(json.dumps(s) + "\n" for s in samples[:8]))
        self._eval_s += time.perf_counter() - eval_start
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ---- checkpoints: the policy adapter (never the frozen base) ------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the policy adapter (peft layout) and the stage's extras (:meth:`save_extra`). ``state_dict``
        (gathered by transformers under ZeRO-3) has the wrapper's ``policy.`` prefix."""
        out = Path(output_dir or self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        policy_sd = None if state_dict is None else {
            k[len("policy."):]: v for k, v in state_dict.items() if k.startswith("policy.")}
        model.policy.save_pretrained(str(out), state_dict=policy_sd, safe_serialization=True)
        self.save_extra(out, model, state_dict)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(str(out))

    def save_extra(self, out: Path, model, state_dict: dict | None) -> None:
        """What a stage saves beside the policy adapter (PPO: its value model); default nothing."""

    def save_extra_state(self, checkpoint: Path) -> None:
        """With rollouts sampled ahead: the adapters of the batches submitted but not yet trained on
        (:func:`llmtune.rl.prefetch.save_snapshots`), so that a run resumed here samples them again identically."""
        if self.prefetch is not None:
            from llmtune.rl.prefetch import save_snapshots

            save_snapshots(checkpoint, self.prefetch.untaken())

    def load_counters(self, checkpoint) -> None:
        super().load_counters(checkpoint)
        if self.prefetch is not None:
            from llmtune.rl.prefetch import load_snapshots

            self.prefetch.restore(load_snapshots(Path(checkpoint)))

    def can_stop_here(self) -> bool:
        """A signal stops online RL only at the end of an iteration (PPO, GRPO): a checkpoint inside one would lose
        the rest of its rollout batch."""
        return self.state.global_step % self.steps_per_iteration == 0

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        set_peft_model_state_dict(self.accelerator.unwrap_model(self.model).policy,
                                  load_file(str(Path(resume_from_checkpoint) / "adapter_model.safetensors")),
                                  adapter_name="default")
