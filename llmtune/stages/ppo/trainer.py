"""PPO on the core trainer: rollouts feed transformers' own training loop.

One PPO iteration = sample one rollout batch (``ppo.rollout_batch_size`` prompts over all ranks), score it, turn it
into per-token rewards, advantages and returns, then ``ppo.ppo_epochs`` passes of optimizer steps over it, each
step ``train.global_batch_size`` rollouts split into micro-batches of ``train.micro_batch_size`` per rank.

Everything around the optimizer step is ``transformers.Trainer``'s (optimizer, schedule, clipping, DDP/DeepSpeed
no-sync and accumulation, fp16/bf16, logging, callbacks, checkpoints with optimizer/scheduler state): the trainer's
dataloader only counts optimizer steps, and :meth:`PPOTrainer.get_batch_samples` hands the loop the micro-batches
of the next PPO minibatch instead of dataloader rows, sampling a new rollout batch when the last one is used up.
Gradient accumulation is exact as in the other stages: the loss of a micro-batch is its token sum divided by the
response tokens of the whole minibatch over all ranks (:meth:`CoreTrainer._get_num_items_in_batch`).

Models (one base in memory): the policy is the ``default`` LoRA adapter, the reference is the same base with every
adapter disabled, the value model is a second LoRA adapter ``value`` plus a linear value head on the last hidden
state, switched with :func:`llmtune.models.adapters.adapter_scope` (which keeps both adapters trainable and is
gradient-checkpointing safe). The reward model of ``reward.from_run`` is a separate frozen copy (its own chain
merged); ``reward.function`` scores decoded texts instead.

Resume: a checkpoint is only written at the end of a PPO iteration (save_steps is a multiple of an iteration), so a
resumed run starts with a fresh rollout. Sampling, dropout and minibatch order are seeded from (seed, iteration,
rank), not from the RNG state saved in the checkpoint, so a resumed run draws exactly what the uninterrupted run
drew. The KL controller and the running score statistics are saved with the checkpoint (``ppo_state.json``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmtune.core.guard import ROW_KEY, NonFiniteError
from llmtune.core.trainer import CoreTrainer
from llmtune.data.templates import template_eos_ids
from llmtune.models.adapters import adapter_scope
from llmtune.stages.ppo import ops
from llmtune.stages.ppo.rollout import decode_responses, join, response_token_logps, split_generation
from llmtune.utils import get_logger

log = get_logger("ppo")

POLICY, VALUE = "default", "value"
VALUE_HEAD_FILE = "value_head.safetensors"
PPO_STATE = "ppo_state.json"
SAMPLES = "samples.jsonl"


class PolicyValueModel(nn.Module):
    """The policy (adapter ``default``) and the value model (adapter ``value`` + ``value_head``) on one base.

    ``forward`` runs both, so that DDP/DeepSpeed see one forward and one backward per micro-batch.

    Args:
        policy: a ``peft.PeftModel`` (causal LM) holding the adapters ``default`` and ``value``.
        value_head: ``nn.Linear(hidden_size, 1)``.
    """

    def __init__(self, policy: nn.Module, value_head: nn.Linear):
        super().__init__()
        self.policy = policy
        self.value_head = value_head
        self.config = policy.config

    # trl's unwrap_model_for_generation switches checkpointing off and back on with default kwargs, which would
    # drop our adapter-aware recompute context; generation runs in eval mode, where nothing is checkpointed anyway.
    is_gradient_checkpointing = False

    @property
    def backbone(self) -> nn.Module:
        """The transformer body (hidden states, no LM head) of the peft-wrapped base."""
        return self.policy.get_base_model().base_model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                response_width: int, with_values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Policy logits and values at the positions that predict the response tokens.

        Args:
            input_ids, attention_mask, position_ids: (B, P + N) prompt + response (see ``rollout.join``).
            response_width: N.
            with_values: also run the value model.

        Returns:
            ``(logits, values)``: (B, N, V) policy logits (position t predicts response token t) and (B, N) fp32
            values of the state before response token t (None without ``with_values``).
        """
        keep = response_width + 1
        with adapter_scope(self.policy, POLICY):
            logits = self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=False, logits_to_keep=keep).logits[:, :-1]
        if not with_values:
            return logits, None
        with adapter_scope(self.policy, VALUE):
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=False).last_hidden_state[:, -keep:-1]
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()
        return logits, values

    def reference_logits(self, input_ids, attention_mask, position_ids, response_width: int) -> torch.Tensor:
        """(B, N, V) logits of the reference = the base with every adapter disabled."""
        with adapter_scope(self.policy, None):
            return self.policy(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False, logits_to_keep=response_width + 1).logits[:, :-1]


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


class PPOTrainer(CoreTrainer):
    """``CoreTrainer`` whose micro-batches are PPO rollouts (see the module docstring).

    Constructed by the runner like every stage trainer: ``train_dataset``/``eval_dataset`` are prompt rows
    (``llmtune.data.prompts``), ``data_collator`` left-pads them, ``model`` is the peft policy (adapter ``default``).
    The value adapter, value head and the scorer are added here.

    Raises:
        RecipeError: PPO batch arithmetic (see ``llmtune.config.validate.ppo_problems``).
        ModelLoadError: the reward run cannot be loaded.
        RewardFunctionError: ``reward.function`` cannot be imported or returns bad values.
    """

    def __init__(self, *positional, stage, model, train_dataset, eval_dataset=None, data_collator=None,
                 processing_class=None, **kwargs):
        recipe = stage.recipe
        self.ppo = recipe.ppo
        self.tokenizer = processing_class
        self.prompts, self.prompt_collator = train_dataset, data_collator
        self.eval_prompts = eval_dataset
        world = int(kwargs["args"].world_size)
        self.local_minibatch = recipe.train.global_batch_size // world
        self.steps_per_iteration = self.ppo.ppo_epochs * self.ppo.rollout_batch_size // recipe.train.global_batch_size
        self.eos_ids = template_eos_ids(processing_class)
        if not self.eos_ids:
            raise ValueError("the tokenizer has no EOS token and its chat template ends turns with no special token: "
                             "responses could never end; set the tokenizer's eos_token (or data.chat_template)")
        self.pad_id = processing_class.pad_token_id if processing_class.pad_token_id is not None else self.eos_ids[0]
        self.kl_ctl = ops.KLController(self.ppo.kl_coef, self.ppo.kl_target, self.ppo.kl_horizon)
        self.score_stats = ops.RunningMoments()
        self._buffer: list[list[dict[str, torch.Tensor]]] = []

        self.scorer = build_scorer(recipe, processing_class)
        value_head = add_value_model(model, recipe, getattr(self.scorer, "run_dir", None))
        wrapped = PolicyValueModel(model, value_head)
        args = kwargs.pop("args")
        args.metric_for_best_model = None  # PPO evaluates by generation: there is no eval_loss to track
        slots = _StepSlots((recipe.train.max_steps or 0) * recipe.train.global_batch_size)
        super().__init__(*positional, stage=stage, model=wrapped, args=args, train_dataset=slots,
                         eval_dataset=eval_dataset, data_collator=_slot_collate, processing_class=processing_class,
                         **kwargs)
        if hasattr(self.scorer, "to"):
            self.scorer.to(self.args.device)

    @property
    def run_dir(self) -> Path:
        return Path(self.args.output_dir).parent

    # ---- the dataloader only counts steps ---------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        return torch.utils.data.SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

    def _load_rng_state(self, checkpoint):
        """Not restored: every PPO iteration seeds sampling, dropout and minibatch order from (seed, iteration,
        rank), so a resumed run already draws what the uninterrupted run drew."""
        return

    def get_batch_samples(self, epoch_iterator, num_batches: int, device: torch.device):
        """The micro-batches of the next PPO minibatch and the response tokens of the whole minibatch (all ranks)."""
        for _ in range(num_batches):  # keep the step-counting dataloader in step with the loop
            try:
                next(epoch_iterator)
            except StopIteration:
                break
        if not self._buffer:
            self._buffer = self.make_experience(self.state.global_step // self.steps_per_iteration)
        micro_batches = self._buffer.pop(0)
        return micro_batches, self._get_num_items_in_batch(micro_batches, device)

    # ---- rollouts ---------------------------------------------------------------------------------
    def prompt_indices(self, iteration: int) -> list[int]:
        """Rows of this rank's prompts for PPO iteration ``iteration``: the global order is a concatenation of
        per-epoch permutations seeded by (seed, epoch); the rollout batch of an iteration is the next
        ``rollout_batch_size`` rows of it, dealt to ranks round-robin."""
        n, size = len(self.prompts), self.ppo.rollout_batch_size
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

        # modulo numpy's seed range: seed + 1_000_003 x iteration passes 2**32 after ~4,300 iterations
        set_seed((self.args.seed + 1_000_003 * iteration + 7919 * self.args.process_index + salt) % 2**32)

    @torch.no_grad()
    def generate(self, batch: dict[str, torch.Tensor], greedy: bool, max_new_tokens: int) -> torch.Tensor:
        """(B, P + N) sequences sampled (or greedy) from the policy adapter for left-padded prompts."""
        from trl.models.utils import unwrap_model_for_generation

        sampling = {"do_sample": False} if greedy else {
            "do_sample": True, "temperature": self.ppo.temperature, "top_p": self.ppo.top_p, "top_k": self.ppo.top_k,
        }
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as unwrapped:
            was_training = unwrapped.training
            unwrapped.eval()
            with adapter_scope(unwrapped.policy, POLICY), self.compute_loss_context_manager():
                try:
                    sequences = unwrapped.policy.generate(
                        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        max_new_tokens=max_new_tokens, **sampling,
                        eos_token_id=self.eos_ids, pad_token_id=self.pad_id, use_cache=True,
                    )
                except RuntimeError as exc:  # torch.multinomial: "probability tensor contains either inf, nan ..."
                    if "nan" not in str(exc) or "inf" not in str(exc):
                        raise
                    raise NonFiniteError(
                        f"after optimizer step {self.state.global_step}: sampling PPO responses met NaN/inf "
                        f"probabilities ({str(exc).strip()}); the policy's logits are not finite. Likely causes: the "
                        "learning rate is too high (lower train.learning_rate), fp16 overflow (use precision.bf16), "
                        "or a bad prompt row. No adapter or lineage.json was written.") from None
            unwrapped.train(was_training)
        return sequences

    @torch.no_grad()
    def _forward_chunks(self, inputs: dict[str, torch.Tensor], responses: torch.Tensor, with_values: bool,
                        reference: bool, temperature: float, exact_kl: bool = False) -> dict[str, torch.Tensor]:
        """Response log-probs (policy, and reference when asked), values and entropy, in chunks of the eval batch."""
        model = self.model
        was_training = model.training
        model.eval()
        size = self.args.per_device_eval_batch_size
        width = responses.shape[1]
        out: dict[str, list[torch.Tensor]] = {}
        for start in range(0, responses.shape[0], size):
            part = {k: v[start:start + size] for k, v in inputs.items()}
            resp = responses[start:start + size]
            with self.compute_loss_context_manager():
                logits, values = model(**part, response_width=width, with_values=with_values)
                ref_logits = model.reference_logits(**part, response_width=width) if reference else None
            out.setdefault("logps", []).append(response_token_logps(logits, resp, temperature))
            out.setdefault("entropy", []).append(ops.entropy_from_logits(logits.float() / temperature))
            if values is not None:
                out.setdefault("values", []).append(values)
            if ref_logits is not None:
                out.setdefault("ref_logps", []).append(response_token_logps(ref_logits, resp, temperature))
                if exact_kl:  # sum over the vocabulary: KL(policy || reference) at each position
                    logp = torch.log_softmax(logits.float(), -1)
                    out.setdefault("kl_exact", []).append(
                        (logp.exp() * (logp - torch.log_softmax(ref_logits.float(), -1))).sum(-1))
        model.train(was_training)
        return {k: torch.cat(v) for k, v in out.items()}

    def make_experience(self, iteration: int) -> list[list[dict[str, torch.Tensor]]]:
        """Sample and score one rollout batch, compute advantages/returns, log its metrics and return the PPO
        minibatches (``ppo_epochs`` shuffled passes), each a list of micro-batch dicts."""
        self._seed(iteration)
        indices = self.prompt_indices(iteration)
        rows = [self.prompts[i] for i in indices]
        batch = {k: v.to(self.args.device) for k, v in self.prompt_collator(rows).items()
                 if k in ("input_ids", "attention_mask")}
        width = batch["input_ids"].shape[1]
        sequences = self.generate(batch, greedy=False, max_new_tokens=self.ppo.max_new_tokens)
        responses, mask, ended = split_generation(sequences, width, self.eos_ids, self.pad_id)
        inputs = join(batch["input_ids"], batch["attention_mask"], responses, mask)
        fwd = self._forward_chunks(inputs, responses, with_values=True, reference=True,
                                   temperature=self.ppo.temperature)
        maskf = mask.float()
        logps, ref_logps, values = fwd["logps"] * maskf, fwd["ref_logps"] * maskf, fwd["values"] * maskf
        raw_scores = self.scorer(batch["input_ids"], batch["attention_mask"], responses, mask, rows).to(maskf.device)
        scores = raw_scores.clone()
        if self.ppo.missing_eos_penalty is not None:
            scores = scores + self.ppo.missing_eos_penalty * (~ended).float()
        if self.ppo.normalize_scores:
            all_scores = self.accelerator.gather(scores)
            self.score_stats.update(all_scores)
            scores = (scores - self.score_stats.mean) / max(self.score_stats.std, 1e-8)
        if self.ppo.score_clip is not None:
            scores = scores.clamp(-self.ppo.score_clip, self.ppo.score_clip)
        rewards, kl = ops.per_token_rewards(scores, logps, ref_logps, maskf, self.kl_ctl.value)
        advantages, returns = ops.gae(rewards, values, maskf, self.ppo.gamma, self.ppo.lam)
        if self.ppo.whiten_advantages:
            stats = torch.stack([ops.masked_sum(advantages, maskf), ops.masked_sum(advantages**2, maskf), maskf.sum()])
            stats = self.accelerator.reduce(stats, reduction="sum") if self.args.world_size > 1 else stats
            advantages = ops.masked_whiten(advantages, maskf, stats=tuple(float(x) for x in stats))

        metrics = self._rollout_metrics(raw_scores, kl, rewards, fwd["entropy"], values, returns, maskf, ended)
        self.kl_ctl.update(metrics["kl"], self.ppo.rollout_batch_size)
        for key, value in metrics.items():
            self._metric_sums[key] += value
            self._metric_counts[key] += 1
        if iteration % self.ppo.sample_every == 0:
            self._write_samples(iteration, rows, responses, mask, raw_scores, kl.sum(1))

        experience = {
            **inputs, "responses": responses, "response_mask": mask, "old_logps": logps, "old_values": values,
            "advantages": advantages, "returns": returns,
            ROW_KEY: torch.tensor(indices, dtype=torch.long, device=responses.device),  # (B,) prompt rows (guard)
        }
        minibatches = []
        gen = torch.Generator().manual_seed(self.args.seed + 1_000_003 * iteration + self.args.process_index)
        micro = self.args.per_device_train_batch_size
        for _ in range(self.ppo.ppo_epochs):
            order = torch.randperm(len(rows), generator=gen)
            for start in range(0, len(rows), self.local_minibatch):
                idx = order[start:start + self.local_minibatch]
                minibatches.append([trim(experience, idx[m:m + micro].to(responses.device), width)
                                    for m in range(0, len(idx), micro)])
        return minibatches

    def _rollout_metrics(self, scores, kl, rewards, entropy, values, returns, mask, ended) -> dict[str, float]:
        """Means over all ranks' rollouts of this iteration (sequence sums for kl/non_score_reward)."""
        lengths = mask.sum(1)
        per_row = torch.stack([
            scores.float(), kl.sum(1), (rewards * mask).sum(1), lengths,
            (~ended).float(), ops.masked_sum(entropy, mask, dim=1) / lengths.clamp(min=1),
        ], dim=1)  # (B, 6)
        per_row = self.accelerator.gather(per_row) if self.args.world_size > 1 else per_row
        score, kl_seq, reward_seq, length, truncated, ent = per_row.T
        return {
            "score_mean": float(score.mean()), "score_std": float(score.std()) if len(score) > 1 else 0.0,
            "kl": float(kl_seq.mean()), "non_score_reward": -self.kl_ctl.value * float(kl_seq.mean()),
            "reward_mean": float(reward_seq.mean()), "response_length": float(length.mean()),
            "truncated_fraction": float(truncated.mean()), "entropy": float(ent.mean()),
            "kl_coef": self.kl_ctl.value, "explained_variance": ops.explained_variance(values, returns, mask),
        }

    def _write_samples(self, iteration, rows, responses, mask, scores, kl) -> None:
        if not self.is_world_process_zero():
            return
        texts = decode_responses(self.tokenizer, responses, mask)
        with (self.run_dir / SAMPLES).open("a") as f:
            for row, text, score, k in list(zip(rows, texts, scores.tolist(), kl.tolist()))[:4]:
                f.write(json.dumps({"step": self.state.global_step, "iteration": iteration, "prompt": row["prompt"],
                                    "response": text, "score": score, "kl": k}) + "\n")

    # ---- evaluation: greedy responses to held-out prompts ------------------------------------------
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """Greedy responses to the held-out prompts (sharded over ranks), scored like the rollouts.

        Returns (and logs) ``eval_score`` (mean raw score), ``eval_score_std``, ``eval_kl`` (per response: the
        exact KL(policy || reference) summed over the response tokens of the greedy path, nats),
        ``eval_response_length`` (tokens), ``eval_truncated_fraction``, ``eval_prompts``.
        """
        rows_all = eval_dataset if eval_dataset is not None else self.eval_prompts
        if rows_all is None or len(rows_all) == 0:
            return {}
        indices = list(range(len(rows_all)))[self.args.process_index::self.args.world_size]
        size = self.args.per_device_eval_batch_size
        per_row, samples = [], []
        max_new = self.ppo.eval_max_new_tokens or self.ppo.max_new_tokens
        from tqdm.auto import tqdm

        progress = tqdm(total=len(indices), desc="eval: greedy responses", unit="prompt", leave=False,
                        disable=not self.is_world_process_zero() or self.args.disable_tqdm)
        for start in range(0, len(indices), size):
            rows = [rows_all[i] for i in indices[start:start + size]]
            batch = {k: v.to(self.args.device) for k, v in self.prompt_collator(rows).items()
                     if k in ("input_ids", "attention_mask")}
            width = batch["input_ids"].shape[1]
            sequences = self.generate(batch, greedy=True, max_new_tokens=max_new)
            responses, mask, ended = split_generation(sequences, width, self.eos_ids, self.pad_id)
            inputs = join(batch["input_ids"], batch["attention_mask"], responses, mask)
            fwd = self._forward_chunks(inputs, responses, with_values=False, reference=True, temperature=1.0,
                                       exact_kl=True)
            scores = self.scorer(batch["input_ids"], batch["attention_mask"], responses, mask, rows).float()
            kl = (fwd["kl_exact"] * mask).sum(1)
            per_row.append(torch.stack([scores.to(kl.device), kl, mask.sum(1).float(), (~ended).float()], 1))
            progress.update(len(rows))
            if len(samples) < 8:
                for row, text, s in zip(rows, decode_responses(self.tokenizer, responses, mask), scores.tolist()):
                    samples.append({"prompt": row["prompt"], "response": text, "score": s})
        progress.close()
        stats = torch.cat(per_row) if per_row else torch.zeros(0, 4, device=self.args.device)
        if self.args.world_size > 1:
            stats = self.accelerator.gather_for_metrics(stats)
        score, kl, length, truncated = stats.T
        metrics = {
            f"{metric_key_prefix}_score": float(score.mean()),
            f"{metric_key_prefix}_score_std": float(score.std()) if len(score) > 1 else 0.0,
            f"{metric_key_prefix}_kl": float(kl.mean()),
            f"{metric_key_prefix}_response_length": float(length.mean()),
            f"{metric_key_prefix}_truncated_fraction": float(truncated.mean()),
            f"{metric_key_prefix}_prompts": float(len(score)),
        }
        if self.is_world_process_zero():
            path = self.run_dir / f"eval_samples_step{self.state.global_step}.jsonl"
            path.write_text("".join(json.dumps(s) + "\n" for s in samples[:8]))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # ---- checkpoints ------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Save the two adapters (peft layout: ``default`` at the root, ``value/`` below) and the value head;
        never the frozen base. ``state_dict`` (gathered by transformers under ZeRO-3) has ``policy.``/``value_head.``
        prefixes."""
        from safetensors.torch import save_file

        out = Path(output_dir or self.args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        if state_dict is None:
            policy_sd, head_sd = None, model.value_head.state_dict()
        else:
            policy_sd = {k[len("policy."):]: v for k, v in state_dict.items() if k.startswith("policy.")}
            head_sd = {k[len("value_head."):]: v for k, v in state_dict.items() if k.startswith("value_head.")}
        model.policy.save_pretrained(str(out), state_dict=policy_sd, safe_serialization=True)
        (out / VALUE).mkdir(exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in head_sd.items()}, str(out / VALUE / VALUE_HEAD_FILE))
        if self.processing_class is not None:
            self.processing_class.save_pretrained(str(out))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load_adapters(self.accelerator.unwrap_model(self.model), Path(resume_from_checkpoint))

    def save_extra_state(self, checkpoint: Path) -> None:
        """The KL controller and the running score statistics, in the checkpoint before it is committed."""
        state = {"kl_coef": self.kl_ctl.value, "score_stats": self.score_stats.state_dict()}
        (checkpoint / PPO_STATE).write_text(json.dumps(state))

    def can_stop_here(self) -> bool:
        """A signal stops PPO only at the end of an iteration: a checkpoint inside one would lose its rollouts."""
        return self.state.global_step % self.steps_per_iteration == 0

    def load_counters(self, checkpoint) -> None:
        super().load_counters(checkpoint)
        path = Path(checkpoint) / PPO_STATE
        if path.is_file():
            state = json.loads(path.read_text())
            self.kl_ctl.value = float(state["kl_coef"])
            self.score_stats.load_state_dict(state["score_stats"])


def trim(experience: dict[str, torch.Tensor], idx: torch.Tensor, prompt_width: int) -> dict[str, torch.Tensor]:
    """Rows ``idx`` of the experience, with the response columns cut to the longest real response among them."""
    rows = {k: v[idx] for k, v in experience.items()}
    n = max(int(rows["response_mask"].sum(1).max()), 1)
    for key in ("input_ids", "attention_mask", "position_ids"):
        rows[key] = rows[key][:, :prompt_width + n]
    for key in ("responses", "response_mask", "old_logps", "old_values", "advantages", "returns"):
        rows[key] = rows[key][:, :n]
    return rows


# ---- value model --------------------------------------------------------------------------------------------
def add_value_model(policy: nn.Module, recipe, reward_run: Path | None) -> nn.Linear:
    """Add the ``value`` LoRA adapter to the peft policy and return a value head ``Linear(hidden, 1)`` (fp32).

    With ``reward.from_run`` and ``ppo.init_value_from_reward`` the adapter takes the reward run's LoRA config and
    weights and the head its score head (the RM was trained on its own chain, so this is an initialisation, not
    the RM itself); otherwise the adapter is a fresh one with the recipe's adapter config and the head is zero.
    Both adapters stay trainable (peft's add_adapter would freeze the inactive one).

    Raises:
        ModelLoadError: the policy is not a peft LoRA model (``adapter.type: none`` has no adapters to share a base).
    """
    from peft import PeftModel

    from llmtune.models import ModelLoadError, build_lora_config

    if not isinstance(policy, PeftModel):
        raise ModelLoadError("PPO keeps policy, reference and value model on one base as LoRA adapters; "
                             "adapter.type: none is not supported for ppo (set adapter.type: lora)")
    hidden = policy.config.hidden_size
    head = nn.Linear(hidden, 1, dtype=torch.float32)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    rm_adapter = reward_run / "adapter" if reward_run is not None else None
    if rm_adapter is not None and recipe.ppo.init_value_from_reward and (rm_adapter / "adapter_config.json").is_file():
        from peft import LoraConfig, set_peft_model_state_dict
        from safetensors.torch import load_file

        config = LoraConfig.from_pretrained(str(rm_adapter))
        config.modules_to_save, config.task_type = None, policy.peft_config[POLICY].task_type
        policy.add_adapter(VALUE, config)
        weights = load_file(str(rm_adapter / "adapter_model.safetensors"))
        lora = {k: v for k, v in weights.items() if "lora_" in k}
        result = set_peft_model_state_dict(policy, lora, adapter_name=VALUE)
        missing = [k for k in getattr(result, "missing_keys", []) if "lora_" in k and f".{VALUE}." in k]
        if missing:
            log.warning("value adapter: %d LoRA weights not found in %s (e.g. %s); they start fresh",
                        len(missing), rm_adapter, missing[0])
        score = next((v for k, v in weights.items() if k.endswith("score.weight")), None)
        if score is not None and score.shape[-1] == hidden:
            head.weight.data.copy_(score.reshape(1, hidden).float())
        log.info("value model initialised from the reward model %s (LoRA r=%d, score head)", rm_adapter, config.r)
    else:
        policy.add_adapter(VALUE, build_lora_config(recipe.adapter, policy.peft_config[POLICY].task_type))
    for name, param in policy.named_parameters():
        if "lora_" in name and (f".{POLICY}." in name or f".{VALUE}." in name):
            param.requires_grad_(True)
    return head


def load_adapters(model: PolicyValueModel, directory: Path) -> None:
    """Load both adapters and the value head saved by :meth:`PPOTrainer._save` into ``model``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    set_peft_model_state_dict(model.policy, load_file(str(directory / "adapter_model.safetensors")),
                              adapter_name=POLICY)
    set_peft_model_state_dict(model.policy, load_file(str(directory / VALUE / "adapter_model.safetensors")),
                              adapter_name=VALUE)
    model.value_head.load_state_dict(load_file(str(directory / VALUE / VALUE_HEAD_FILE)))


# ---- scores -------------------------------------------------------------------------------------------------
class FunctionScorer:
    """Scores decoded responses with ``reward.function(prompts, completions, references)``."""

    def __init__(self, spec: str, tokenizer, base_dir: str | Path | None = None):
        from llmtune.rewards import load_reward_function

        self.fn, self.tokenizer = load_reward_function(spec, base_dir=base_dir), tokenizer

    def __call__(self, query_ids, query_mask, responses, mask, rows) -> torch.Tensor:
        """(B, P) left-padded prompts + mask, (B, N) responses + mask, B prompt rows -> (B,) fp32 scores.

        Raises:
            RewardFunctionError: the function raised, or did not return B finite numbers (the index is named).
        """
        from llmtune.rewards import call_reward_function

        completions = decode_responses(self.tokenizer, responses, mask)
        return call_reward_function(self.fn, [r["prompt"] for r in rows], completions,
                                    [r.get("reference") for r in rows]).to(responses.device)


class RewardModelScorer:
    """Scores (prompt, response) with the reward model of an ``llmtune rm`` run
    (:class:`llmtune.models.reward.RewardModel`, loaded once, frozen, chain merged, in the recipe's precision).

    When the RM's tokenizer and chat template equal the policy's, the policy's token ids are scored (prompt
    left-padded + response right-padded, plus the template's text after the end-of-turn token the RM was trained
    with: :meth:`~llmtune.models.reward.RewardModel.score_rollouts`; read at the last real token); otherwise the
    response is decoded and the conversation re-tokenized as the RM's training pairs were.
    """

    def __init__(self, run_dir: str | Path, recipe, tokenizer):
        from llmtune.models.reward import RewardModel

        self.rm = RewardModel(run_dir, recipe.precision, recipe.reward.batch_size)
        self.run_dir, self.tokenizer = self.rm.run_dir, tokenizer
        self.same_tokens = (self.rm.tokenizer.get_vocab() == tokenizer.get_vocab()
                            and self.rm.tokenizer.chat_template == tokenizer.chat_template)
        log.info("reward model %s loaded (%s)", self.run_dir,
                 "same tokenizer: scoring the policy's tokens" if self.same_tokens else "re-tokenizing its texts")

    def to(self, device):
        self.rm.to(device)
        return self

    def __call__(self, query_ids, query_mask, responses, mask, rows) -> torch.Tensor:
        """(B, P) left-padded prompts + mask, (B, N) right-padded responses + mask, B prompt rows -> (B,) fp32
        scores read at each row's last real token."""
        if self.same_tokens:
            return self.rm.score_rollouts(torch.cat([query_ids, responses], 1), torch.cat([query_mask, mask], 1))
        texts = decode_responses(self.tokenizer, responses, mask)
        return self.rm.score_texts([json.loads(r["messages"]) for r in rows], texts).to(responses.device)


def build_scorer(recipe, tokenizer) -> Any:
    """The recipe's score source: :class:`RewardModelScorer` or :class:`FunctionScorer`."""
    if recipe.reward.from_run:
        return RewardModelScorer(recipe.reward.from_run, recipe, tokenizer)
    return FunctionScorer(recipe.reward.function, tokenizer, base_dir=Path.cwd())
