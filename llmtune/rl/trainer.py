"""The online-RL trainer shared by PPO and GRPO: rollouts feed transformers' own training loop.

Everything around the optimizer step is ``transformers.Trainer``'s (optimizer, schedule, clipping, DDP/DeepSpeed
no-sync and accumulation, fp16/bf16, logging, callbacks, checkpoints with optimizer/scheduler state): the trainer's
dataloader only counts optimizer steps (:class:`_StepSlots`), and :meth:`OnlineRLTrainer.get_batch_samples` hands the
loop the micro-batches of the next optimizer step instead of dataloader rows, sampling a new rollout batch (the
stage's :meth:`make_experience`) when the last one is used up. Gradient accumulation is exact as in the other
stages: the loss of a micro-batch is its sum divided by the stage's item count of the whole optimizer step over all
ranks (:meth:`CoreTrainer._get_num_items_in_batch`).

Shared here: prompt order, seeding, sampling through the rollout engine (:func:`llmtune.rl.generation.build_engine`:
``hf`` or vLLM, synced to the policy before every rollout batch and evaluation, closed with :meth:`close`), the
engine/trainer log-prob mismatch and its truncated importance weights (:meth:`engine_correction`), response
log-probs of the policy and the reference in chunks, reward sources (:mod:`llmtune.rl.scoring`), sample logs,
the greedy evaluation, adapter checkpoints, and the time split between generation and training.

Resume: a checkpoint is only written at the end of an iteration (one rollout batch; save_steps is a multiple of
it), so a resumed run starts with a fresh rollout. Sampling, dropout and minibatch order are seeded from (seed,
iteration, rank), not from the RNG state saved in the checkpoint, so a resumed run draws exactly what the
uninterrupted run drew.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from llmtune.core.rundir import SAMPLES
from llmtune.core.trainer import CoreTrainer
from llmtune.data.templates import stop_token_ids
from llmtune.rl import ops
from llmtune.rl.generation import build_engine
from llmtune.rl.rollout import decode_responses, join, response_token_logps, split_generation
from llmtune.rl.scoring import build_reward_sources
from llmtune.utils import get_logger

log = get_logger("rl")

LOGITS_CHUNK_BYTES = 256 * 2**20  # fp32 logits per forward of forward_chunks (rows cut to fit; at least one row)


def _per_row(fn, *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` applied to each row (a (1, ...) slice) of the tensors, concatenated: (B, N) statistics of (B, N, V)
    logits with (1, N, V) temporaries instead of (B, N, V) ones."""
    return torch.cat([fn(*(t[i:i + 1] for t in tensors)) for i in range(tensors[0].shape[0])])


def _number(x: torch.Tensor) -> float | None:
    """A score for the sample logs: None where every reward function abstained (JSON has no NaN)."""
    value = float(x)
    return None if value != value else value


def _exact_kl(logits: torch.Tensor, ref_logits: torch.Tensor) -> torch.Tensor:
    """(b, N, V) policy and reference logits -> (b, N) KL(policy || reference) per position, fp32."""
    logp = torch.log_softmax(logits.float(), -1)
    return (logp.exp() * (logp - torch.log_softmax(ref_logits.float(), -1))).sum(-1)


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
        self.prompts, self.prompt_collator = train_dataset, data_collator
        self.eval_prompts = eval_dataset
        # THE stop set (tokenizer EOS, template end of turn, the model's generation-config EOS list): every engine
        # stops on these ids and nothing else, and split_generation cuts completions at them
        self.eos_ids = stop_token_ids(processing_class, getattr(model, "generation_config", None))
        if not self.eos_ids:
            raise ValueError("the tokenizer has no EOS token and its chat template ends turns with no special token: "
                             "responses could never end; set the tokenizer's eos_token (or data.chat_template)")
        self.pad_id = processing_class.pad_token_id if processing_class.pad_token_id is not None else self.eos_ids[0]
        self._buffer: list[list[dict[str, torch.Tensor]]] = []
        self._rollout_s = 0.0  # seconds spent making experience since the last log (not training)
        self._generation_s = 0.0  # of which sampling
        self.rewards = build_reward_sources(recipe, processing_class, recipe_dir=stage.recipe_dir)
        wrapped = self.build_model(model, recipe)
        args = kwargs.pop("args")
        args.metric_for_best_model = None  # evaluated by generation: there is no eval_loss to track
        slots = _StepSlots((recipe.train.max_steps or 0) * recipe.train.global_batch_size)
        super().__init__(*positional, stage=stage, model=wrapped, args=args, train_dataset=slots,
                         eval_dataset=eval_dataset, data_collator=_slot_collate, processing_class=processing_class,
                         **kwargs)
        self.rewards.to(self.args.device)
        self.generation = build_engine(self, recipe)  # the rollout engine (hf or vLLM); close() frees it

    # ---- what a stage supplies ------------------------------------------------------------------
    def build_model(self, policy, recipe) -> torch.nn.Module:
        """The module trained (a :class:`~llmtune.rl.model.PolicyModel` or a subclass) around the peft policy."""
        raise NotImplementedError

    def make_experience(self, iteration: int) -> list[list[dict[str, torch.Tensor]]]:
        """Sample and score rollout batch ``iteration``; return its optimizer steps, each a list of micro-batches."""
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
            self.generation.sync(self.state.global_step)  # the engine samples from the policy of this step
            self._buffer = self.make_experience(self.state.global_step // self.steps_per_iteration)
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

        seed = self.args.seed if self.rollout.seed is None else self.rollout.seed
        # modulo numpy's seed range: seed + 1_000_003 x iteration passes 2**32 after ~4,300 iterations
        set_seed((seed + 1_000_003 * iteration + 7919 * self.args.process_index + salt) % 2**32)

    def prompt_batch(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        """(B, P) left-padded ``input_ids``/``attention_mask`` of prompt rows, on the training device."""
        return {k: v.to(self.args.device) for k, v in self.prompt_collator(rows).items()
                if k in ("input_ids", "attention_mask")}

    def generate(self, batch: dict[str, torch.Tensor], greedy: bool, max_new_tokens: int
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(sequences, engine_logps)``: (B, P + N) sequences sampled (or greedy) from the policy adapter for
        left-padded prompts, and the engine's (B, N) log-probs of the sampled tokens (None: not reported)."""
        return self.generation.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=max_new_tokens,
                                        greedy=greedy)

    def close(self) -> None:
        """Free the rollout engine (the runner calls this when the stage ends, also on errors)."""
        engine = getattr(self, "generation", None)
        if engine is None:
            return
        try:
            engine.close()
        except Exception as exc:  # noqa: BLE001 - never hide the error that ended the run behind a failed close
            log.warning("closing the rollout engine failed: %s", exc)

    def sample(self, batch: dict[str, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Sample completions of (B, P) prompts; ``(responses, mask, ended, engine_logps)``: the first three as
        ``rollout.split_generation``, then the engine's (B, N) fp32 log-probs of the sampled tokens (0 on padding)
        or None when the engine does not report them (``hf``).
        Logs ``generation_tokens_per_s`` (real completion tokens per second of sampling, this rank),
        ``generation_tflops_per_s`` (their model FLOPs, a KV-cached forward per token, :mod:`llmtune.core.flops`)
        and ``generation_mfu`` (that over this device's peak, where known)."""
        from llmtune.core.flops import forward_flops_per_token, peak_tflops

        start = time.perf_counter()
        sequences, engine_logps = self.generate(batch, greedy=False, max_new_tokens=self.rollout.max_new_tokens)
        seconds = time.perf_counter() - start
        self._generation_s += seconds
        responses, mask, ended = split_generation(sequences, batch["input_ids"].shape[1], self.eos_ids, self.pad_id)
        if engine_logps is not None:
            if engine_logps.shape != responses.shape:
                raise RuntimeError(f"the rollout engine returned log-probs of shape {tuple(engine_logps.shape)} for "
                                   f"completions of shape {tuple(responses.shape)}")
            engine_logps = torch.where(mask.bool(), engine_logps.to(device=responses.device, dtype=torch.float32), 0.0)
        tokens_per_s = float(mask.sum()) / max(seconds, 1e-9)
        # a generated token attends to its prompt and the completion so far: on average prompt + half of it
        context = float(batch["attention_mask"].sum(1).float().mean()) + float(mask.sum(1).float().mean() + 1) / 2
        tflops = forward_flops_per_token(self.model, context) * tokens_per_s / 1e12
        peak = peak_tflops()
        self.add_metrics({"generation_tokens_per_s": tokens_per_s, "generation_tflops_per_s": tflops,
                          **({"generation_mfu": tflops / peak} if peak else {})})
        return responses, mask, ended, engine_logps

    @property
    def sampling_truncation(self) -> tuple[int, float] | None:
        """``(top_k, top_p)`` when the rollouts are sampled from a truncated distribution (``rollout.top_k`` > 0 or
        ``rollout.top_p`` < 1), else None. The engine's log-probs are under that distribution (vLLM's
        ``processed_logprobs``), so the trainer's side of the importance ratio must be too
        (:func:`llmtune.rl.ops.sampling_logps`)."""
        r = self.rollout
        return (r.top_k, r.top_p) if r.top_k > 0 or r.top_p < 1.0 else None

    def correction_truncation(self, engine_logps: torch.Tensor | None) -> tuple[int, float] | None:
        """The ``truncation`` argument of :meth:`forward_chunks` for a rollout batch whose engine reported
        ``engine_logps`` (None when it did not: nothing to compare)."""
        return self.sampling_truncation if engine_logps is not None else None

    def engine_correction(self, experience: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor],
                          responses: torch.Tensor, mask: torch.Tensor, engine_logps: torch.Tensor | None,
                          fwd: dict[str, torch.Tensor] | None = None) -> None:
        """Measure the engine/trainer mismatch of a rollout batch and, with
        ``rollout.vllm.importance_sampling_correction``, put the truncated importance weights into the experience
        (``experience["is_weights"]`` (B, N), detached, 0 on padding; the policy losses multiply their per-token
        surrogate by it). Nothing happens when the engine reported no log-probs (``hf``).

        Logs, over all ranks' real tokens: ``rollout/logprob_diff_mean``/``_max`` (|trainer - engine| log-prob of
        the sampled tokens, nats), ``rollout/is_weight_mean`` and ``rollout/is_clipped_fraction``
        (:func:`llmtune.rl.ops.engine_mismatch_metrics`).

        Args:
            experience: the rollout batch's experience dict (updated in place).
            inputs: (B, P + N) prompt + response model inputs (``rollout.join``). responses, mask: (B, N).
            engine_logps: (B, N) from :meth:`sample`. fwd: the rollout batch's :meth:`forward_chunks` output when
                already computed with ``truncation=self.correction_truncation(engine_logps)`` (its policy log-probs
                are the old log-probs), else the policy is run here.

        Both sides of the ratio are log-probs under the SAME distribution: the engine's are under its sampling
        distribution (temperature, then ``top_k``/``top_p`` truncation, renormalised), so the trainer's are taken
        under the same truncation of its own logits (``sampling_logps``); with the full-vocabulary log-prob the
        on-policy weight would be the kept probability mass, not 1 (issue 30).
        """
        if engine_logps is None:
            return
        truncation = self.sampling_truncation
        if fwd is None or "logps" not in fwd:
            fwd = self.forward_chunks(inputs, responses, with_values=False, reference=False,
                                      temperature=self.rollout.temperature, truncation=truncation)
        if truncation is not None and "sampling_logps" not in fwd:
            raise RuntimeError("engine_correction: the rollout forward was run without the engine's truncation "
                               "(forward_chunks(truncation=self.correction_truncation(engine_logps))): a bug")
        trainer_logps = fwd["sampling_logps"] if truncation is not None else fwd["logps"]
        maskf = mask.float()
        cap = self.rollout.vllm.importance_sampling_cap
        stats = ops.engine_mismatch_stats(trainer_logps, engine_logps, maskf, cap)[None]  # (1, 6)
        if self.args.world_size > 1:
            stats = self.accelerator.gather(stats)  # (ranks, 6)
        metrics = ops.engine_mismatch_metrics(stats)
        if "rollout/engine_logp_nonfinite_fraction" in metrics:
            log.warning("the rollout engine reported non-finite log-probs for %.2g%% of the sampled tokens (step %d): "
                        "their importance weight is 0 (an engine in bf16/fp16 overflowing? rollout.vllm.dtype)",
                        100 * metrics["rollout/engine_logp_nonfinite_fraction"], self.state.global_step)
        self.add_metrics(metrics)
        if self.rollout.vllm.importance_sampling_correction:
            experience["is_weights"] = ops.truncated_is_weights(trainer_logps, engine_logps, maskf, cap)

    def add_metrics(self, metrics: dict[str, float]) -> None:
        """Add metrics to the next training log (averaged with the other values logged until then, all ranks)."""
        for key, value in metrics.items():
            self._metric_sums[key] += float(value)
            self._metric_counts[key] += 1

    @torch.no_grad()
    def forward_chunks(self, inputs: dict[str, torch.Tensor], responses: torch.Tensor, with_values: bool,
                       reference: bool, temperature: float, exact_kl: bool = False,
                       policy: bool = True, truncation: tuple[int, float] | None = None) -> dict[str, torch.Tensor]:
        """Response log-probs of the policy (``logps``, ``entropy``; ``values`` when asked) and of the reference
        (``ref_logps``; ``kl_exact`` = the exact per-position KL(policy || reference) summed over the vocabulary),
        each (B, N), in eval mode.

        Memory: the forwards run in chunks of at most the eval batch size and of at most ``LOGITS_CHUNK_BYTES`` of
        fp32 logits per model (a (16, 161, 49152) fp32 logits tensor of the quickstart's greedy eval is 0.5 GiB), and
        the per-token statistics are taken one row at a time (:func:`_per_row`), so the (rows, N, V) fp32
        temporaries of softmax/logsumexp/KL never exist for a whole chunk; without ``exact_kl`` the policy's logits
        are freed before the reference forward. Same values as whole-chunk arithmetic (row-wise reductions).
        Without exact KL (GRPO's old and reference log-probs, PPO's with its values, the engine correction) the LM
        head runs at the real response tokens only (:meth:`~llmtune.rl.model.PolicyModel.response_logps`: no
        (rows, N, V) logits at all; values from the model's ``values``); the log-probs are then exactly 0 on padding
        (elsewhere padding holds garbage: multiply by the mask). ``truncation`` = ``(top_k, top_p)``
        (:attr:`sampling_truncation`) adds ``sampling_logps``: the policy's log-probs under the engine's truncated
        sampling distribution (masked LM head only)."""
        model = self.model
        if not exact_kl and hasattr(model, "response_logps") and (not with_values or hasattr(model, "values")):
            return self._response_logps_chunks(model, inputs, responses, reference, temperature, policy,
                                               with_values, truncation)
        if truncation is not None:
            raise ValueError("forward_chunks: the engine's truncated sampling log-probs come from the masked LM head "
                             "only (not with exact_kl or a model without response_logps)")
        was_training = model.training
        model.eval()
        width = responses.shape[1]
        vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
        size = max(1, min(self.args.per_device_eval_batch_size,
                          LOGITS_CHUNK_BYTES // max(1, (width + 1) * vocab * 4) if vocab else responses.shape[0]))
        out: dict[str, list[torch.Tensor]] = {}
        for start in range(0, responses.shape[0], size):
            part = {k: v[start:start + size] for k, v in inputs.items()}
            resp = responses[start:start + size]
            logits = values = None
            with self.compute_loss_context_manager():
                if policy or exact_kl:
                    logits, values = model(**part, response_width=width, with_values=with_values)
            if logits is not None:
                out.setdefault("logps", []).append(_per_row(
                    lambda lg, r: response_token_logps(lg, r, temperature), logits, resp))
                out.setdefault("entropy", []).append(_per_row(
                    lambda lg: ops.entropy_from_logits(lg.float() / temperature), logits))
                if not exact_kl:
                    logits = None
            if values is not None:
                out.setdefault("values", []).append(values)
            if reference:
                with self.compute_loss_context_manager():
                    ref_logits = model.reference_logits(**part, response_width=width)
                out.setdefault("ref_logps", []).append(_per_row(
                    lambda lg, r: response_token_logps(lg, r, temperature), ref_logits, resp))
                if exact_kl:  # sum over the vocabulary: KL(policy || reference) at each position
                    out.setdefault("kl_exact", []).append(_per_row(_exact_kl, logits, ref_logits))
                del ref_logits
            del logits
        model.train(was_training)
        return {k: torch.cat(v) for k, v in out.items()}

    @torch.no_grad()
    def _response_logps_chunks(self, model, inputs: dict[str, torch.Tensor], responses: torch.Tensor,
                               reference: bool, temperature: float, policy: bool,
                               with_values: bool = False, truncation: tuple[int, float] | None = None
                               ) -> dict[str, torch.Tensor]:
        """:meth:`forward_chunks` through the masked LM head: ``logps``/``entropy`` (policy) and ``ref_logps``,
        each (B, N), 0 on padding, ``values`` (B, N) (``model.values``, PPO) when asked, and ``sampling_logps``
        (the policy under the engine's ``truncation``) when given; chunks of the eval batch size."""
        was_training = model.training
        model.eval()
        width = responses.shape[1]
        size = max(1, self.args.per_device_eval_batch_size)
        out: dict[str, list[torch.Tensor]] = {}
        for start in range(0, responses.shape[0], size):
            part = {k: v[start:start + size] for k, v in inputs.items()}
            resp = responses[start:start + size]
            resp_mask = part["attention_mask"][:, -width:]  # rollout.join: prompt mask + response mask
            for name, ref in ((("logps", False),) if policy else ()) + ((("ref_logps", True),) if reference else ()):
                with self.compute_loss_context_manager():
                    got = model.response_logps(**part, responses=resp, response_mask=resp_mask,
                                               temperature=temperature, reference=ref, with_entropy=not ref,
                                               truncation=None if ref else truncation)
                out.setdefault(name, []).append(got.logps)
                if got.entropy is not None:
                    out.setdefault("entropy", []).append(got.entropy)
                if got.sampling_logps is not None:
                    out.setdefault("sampling_logps", []).append(got.sampling_logps)
            if with_values:
                with self.compute_loss_context_manager():
                    out.setdefault("values", []).append(model.values(**part, response_width=width))
        model.train(was_training)
        return {k: torch.cat(v) for k, v in out.items()}

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
        self.generation.sync(self.state.global_step)  # greedy answers of the policy of this step
        indices = list(range(len(rows_all)))[self.args.process_index::self.args.world_size]
        size = self.args.per_device_eval_batch_size
        per_row, samples = [], []
        max_new = self.rollout.eval_max_new_tokens or self.rollout.max_new_tokens
        names = self.rewards.names
        from tqdm.auto import tqdm

        progress = tqdm(total=len(indices), desc="eval: greedy responses", unit="prompt", leave=False,
                        disable=not self.is_world_process_zero() or self.args.disable_tqdm)
        for start in range(0, len(indices), size):
            rows = [rows_all[i] for i in indices[start:start + size]]
            batch = self.prompt_batch(rows)
            width = batch["input_ids"].shape[1]
            sequences, _ = self.generate(batch, greedy=True, max_new_tokens=max_new)
            responses, mask, ended = split_generation(sequences, width, self.eos_ids, self.pad_id)
            inputs = join(batch["input_ids"], batch["attention_mask"], responses, mask)
            fwd = self.forward_chunks(inputs, responses, with_values=False, reference=True, temperature=1.0,
                                      exact_kl=True)
            total, per_source = self.rewards.score(batch["input_ids"], batch["attention_mask"], responses, mask, rows)
            kl = (fwd["kl_exact"] * mask).sum(1)
            per_row.append(torch.stack([total.to(kl.device), kl, mask.sum(1).float(), (~ended).float(),
                                        *(per_source[n].to(kl.device) for n in names)], 1))
            progress.update(len(rows))
            if len(samples) < 8:
                texts = decode_responses(self.tokenizer, responses, mask)
                for b, (row, text) in enumerate(zip(rows, texts)):
                    samples.append({"prompt": row["prompt"], "response": text, "score": _number(total[b]),
                                    **({"rewards": {n: _number(per_source[n][b]) for n in names}}
                                       if self.per_source_eval else {})})
        progress.close()
        stats = torch.cat(per_row) if per_row else torch.zeros(0, 4 + len(names), device=self.args.device)
        if self.args.world_size > 1:
            stats = self.accelerator.gather_for_metrics(stats)
        score, kl, length, truncated = stats[:, :4].T
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
                column = stats[:, 4 + i]
                if (~torch.isnan(column)).any():
                    metrics[f"{p}_rewards/{n}"] = float(column.nanmean())
        metrics.update({
            f"{p}_kl": float(kl.sum() / length.sum().clamp(min=1)) if self.kl_per_token else float(kl.mean()),
            f"{p}_{self.length_name}": float(length.mean()),
            f"{p}_truncated_fraction": float(truncated.mean()),
            f"{p}_prompts": float(len(score)),
        })
        if len(scored) < len(score):
            metrics[f"{p}_rewards/abstained"] = 1.0 - len(scored) / len(score)
        if self.is_world_process_zero():
            path = self.run_dir / f"eval_samples_step{self.state.global_step}.jsonl"
            path.write_text("".join(json.dumps(s) + "\n" for s in samples[:8]))
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
