"""PPO on the shared online-RL trainer (:class:`llmtune.rl.trainer.OnlineRLTrainer`).

One PPO iteration = sample one rollout batch (``ppo.rollout_batch_size`` prompts over all ranks), score it, turn it
into per-token rewards, advantages and returns, then ``ppo.ppo_epochs`` passes of optimizer steps over it, each
step ``train.global_batch_size`` rollouts split into micro-batches of ``train.micro_batch_size`` per rank. The loss
of a micro-batch is its token sum divided by the response tokens of the whole minibatch over all ranks.

Models (one base in memory): the policy is the ``default`` LoRA adapter, the reference is the same base with every
trained adapter disabled (a frozen ``model.from_run`` chain on a 4-bit base stays on: it is part of the base), the
value model is a second LoRA adapter ``value`` plus a linear value head on the last hidden
state, switched with :func:`llmtune.models.adapters.adapter_scope` (which keeps both adapters trainable and is
gradient-checkpointing safe). The reward model of ``reward.from_run`` is a separate frozen copy (its own chain
merged); ``reward.function`` scores decoded texts instead.

Resume: as every online-RL stage (checkpoints at iteration ends, rollouts seeded by (seed, iteration, rank)); the
KL controller and the running score statistics are saved with the checkpoint (``ppo_state.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from llmtune.core.guard import ROW_KEY
from llmtune.models.adapters import activate_frozen_chain, adapter_scope
from llmtune.rewards.shaping import RewardResult, require_rewards
from llmtune.rl.iteration import Loop
from llmtune.rl.model import PolicyModel, PolicyOutput
from llmtune.rl.ops import masked_sum, pack_left, unpack_left
from llmtune.rl.rollouts import conversation_fields, prompt_indices
from llmtune.rl.trainer import OnlineRLTrainer
from llmtune.rl.types import Experience, Layout, RolloutBatch
from llmtune.stages.ppo import ops
from llmtune.utils import get_logger

log = get_logger("ppo")

POLICY, VALUE = "default", "value"
VALUE_HEAD_FILE = "value_head.safetensors"
PPO_STATE = "ppo_state.json"


class PolicyValueModel(PolicyModel):
    """The policy (adapter ``default``), its reference (adapters disabled) and the value model (adapter ``value`` +
    ``value_head``) on one base.

    ``forward`` runs policy and value model, so that DDP/DeepSpeed see one forward and one backward per micro-batch.

    Args:
        policy: a ``peft.PeftModel`` (causal LM) holding the adapters ``default`` and ``value``.
        value_head: ``nn.Linear(hidden_size, 1)``.
    """

    def __init__(self, policy: nn.Module, value_head: nn.Linear):
        super().__init__(policy)
        self.value_head = value_head

    @property
    def backbone(self) -> nn.Module:
        """The transformer body (hidden states, no LM head) of the peft-wrapped base."""
        return self.policy.get_base_model().base_model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                responses: torch.Tensor, response_mask: torch.Tensor, temperature: float = 1.0,
                with_entropy: bool = False, score_mask: torch.Tensor | None = None) -> PolicyOutput:
        """The policy's :meth:`~PolicyModel.response_logps` (the LM head at the real response tokens only, no
        (B, N, V) logits) and the values (:meth:`values`) in one forward, so that DDP/DeepSpeed see one forward and
        one backward per micro-batch.

        Args:
            input_ids, attention_mask, position_ids: (B, P + N) prompt + response (``RolloutBatch.model_inputs``).
            responses, response_mask: (B, N) sampled ids and their real-token mask.
            temperature: divides the logits. with_entropy: also the (B, N) entropy.
            score_mask: (B, N) the positions whose log-probs are wanted (the tokens the policy sampled).

        Returns:
            :class:`PolicyOutput` with ``values`` (B, N) fp32: the value of the state before response token t.
        """
        out = self.response_logps(input_ids, attention_mask, position_ids, responses, response_mask, temperature,
                                  with_entropy=with_entropy, score_mask=score_mask)
        return out._replace(values=self.values(input_ids, attention_mask, position_ids, responses.shape[1]))

    def values(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
               response_width: int) -> torch.Tensor:
        """(B, N) fp32 values of the state before each response token (value adapter + ``value_head``)."""
        keep = response_width + 1
        with adapter_scope(self.policy, VALUE):
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=False).last_hidden_state[:, -keep:-1]
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1).float()


class PPOTrainer(OnlineRLTrainer):
    """``OnlineRLTrainer`` whose micro-batches are PPO rollouts (see the module docstring). The value adapter and
    value head are added here; the iteration's PPO part is :class:`PPO`.

    Raises:
        RecipeError: PPO batch arithmetic (see ``llmtune.config.validate.ppo_problems``).
        ModelLoadError: the reward run cannot be loaded; the policy has no LoRA adapter.
        RewardFunctionError: ``reward.function`` cannot be imported or returns bad values.
    """

    value_forward = True  # each micro-batch also runs the value adapter through the body (model FLOPs)

    def build_algorithm(self, recipe, prompts, args) -> PPO:
        return PPO(recipe, prompts, args.seed, args.process_index, args.world_size)

    def build_model(self, policy, recipe) -> PolicyValueModel:
        return PolicyValueModel(policy, add_value_model(policy, recipe, self.rewards.sources.run_dir))

    # ---- checkpoints: both adapters and the value head ----------------------------------------------
    def save_extra(self, out: Path, model, state_dict: dict | None) -> None:
        """The value adapter (peft layout, ``value/``) and the value head (``value/value_head.safetensors``)."""
        from safetensors.torch import save_file

        head_sd = model.value_head.state_dict() if state_dict is None else {
            k[len("value_head."):]: v for k, v in state_dict.items() if k.startswith("value_head.")}
        (out / VALUE).mkdir(exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in head_sd.items()}, str(out / VALUE / VALUE_HEAD_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        load_adapters(self.accelerator.unwrap_model(self.model), Path(resume_from_checkpoint))

    def save_extra_state(self, checkpoint: Path) -> None:
        """The KL controller and the running score statistics, in the checkpoint before it is committed."""
        state = {"kl_coef": self.algorithm.kl_ctl.value, "score_stats": self.algorithm.score_stats.state_dict()}
        (checkpoint / PPO_STATE).write_text(json.dumps(state))

    def load_counters(self, checkpoint) -> None:
        super().load_counters(checkpoint)
        path = Path(checkpoint) / PPO_STATE
        if path.is_file():
            state = json.loads(path.read_text())
            self.algorithm.kl_ctl.value = float(state["kl_coef"])
            self.algorithm.score_stats.load_state_dict(state["score_stats"])


class PPO:
    """PPO's part of an iteration (:class:`llmtune.rl.iteration.Algorithm`): which prompts, and the experience of a
    scored rollout batch (per-token rewards, GAE, whitening), with the adaptive KL controller and the running score
    statistics (saved with each checkpoint).

    Args:
        recipe: the typed recipe (``ppo``, ``train.global_batch_size``). prompts: the prompt rows.
        seed: ``train.seed`` (the prompt order). rank, world: this process.
    """

    def __init__(self, recipe, prompts, seed: int, rank: int, world: int):
        self.ppo = recipe.ppo
        self.prompts, self.seed, self.rank, self.world = prompts, seed, rank, world
        self.steps_per_iteration = self.ppo.ppo_epochs * self.ppo.rollout_batch_size // recipe.train.global_batch_size
        self.passes = self.ppo.ppo_epochs
        self.kl_ctl = ops.KLController(self.ppo.kl_coef, self.ppo.kl_target, self.ppo.kl_horizon)
        self.score_stats = ops.RunningMoments()

    def rollout_rows(self, iteration: int) -> tuple[list[dict], list[int]]:
        """This rank's prompts of iteration ``iteration`` (one trajectory each, its own group)."""
        indices = prompt_indices(len(self.prompts), self.seed, iteration, self.ppo.rollout_batch_size, self.rank,
                                 self.world)
        rows = [self.prompts[i] for i in indices]
        return rows, list(range(len(rows)))

    def experience(self, loop: Loop, iteration: int, batch: RolloutBatch, rewards: RewardResult
                   ) -> tuple[Experience, None]:
        """Per-token rewards (the KL penalty at every sampled token, the score at the last one, each turn's reward at
        that turn's last sampled token), GAE advantages and returns, whitening; logs the metrics and a few samples.

        A rollout that cannot train (a multi-turn rollout whose environment or tool infrastructure failed, or one
        sampled more than ``rollout.max_staleness`` steps ago) has an empty loss mask (``rewards.loss_mask``) and
        enters no statistic: not the score statistics (``score_mean``/``score_std``, ``ppo.normalize_scores``'
        running moments), not ``kl`` (nor the adaptive KL controller), not ``response_length``, ``entropy`` or
        ``truncated_fraction``; ``trained_response_fraction`` counts the rollouts that train.

        Raises:
            RewardFunctionError: every reward source abstained on a rollout that would train (PPO needs a reward for
                every one).
        """
        require_rewards(rewards)
        trained = rewards.trains  # (B,) the rollouts that train
        # the learner's rows: one per rollout, or one per segment of a rollout whose agent rewrote its history (each
        # an episode of its own that ends with its rollout's score; docs/agents-openai.md)
        train, rollout = batch.training_rows()
        mask = rewards.loss_mask(train, rollout)  # THE mask: the tokens the policy sampled, of the rollouts that train
        fwd = loop.forward(train, mask, reference=True, values=True)
        maskf = mask.float()  # values, GAE, KL and whitening over these
        logps, ref_logps, values = fwd.logps * maskf, fwd.ref_logps * maskf, fwd.values * maskf
        raw_scores = torch.nan_to_num(rewards.task, nan=0.0).to(maskf.device)
        scores = self.shaped_scores(loop, rewards.outcome.to(maskf.device), trained.to(maskf.device))
        rollout = rollout.to(maskf.device)
        # per-token rewards and GAE walk the policy's actions in order: on the sampled tokens packed to the left
        # (multi-turn: the tool results between turns are not actions; single-turn: the identity)
        index, packed = pack_left(maskf)
        take = lambda x: x.gather(1, index) * packed  # noqa: E731
        per_token, kl = ops.per_token_rewards(scores[rollout], take(logps), take(ref_logps), packed,
                                              self.kl_ctl.value)
        turn_rewards = rewards.token_rewards(train, rollout)  # each turn's reward at its last sampled token, or None
        if turn_rewards is not None:
            per_token = per_token + take(turn_rewards.to(maskf.device))
        advantages, returns = ops.gae(per_token, take(values), packed, self.ppo.gamma, self.ppo.lam)
        width = maskf.shape[1]
        per_token, kl, advantages, returns = (unpack_left(x, index, packed, width)
                                              for x in (per_token, kl, advantages, returns))
        if self.ppo.whiten_advantages:
            stats = torch.stack([masked_sum(advantages, maskf), masked_sum(advantages**2, maskf), maskf.sum()])
            stats = loop.ranks.reduce(stats)
            advantages = ops.masked_whiten(advantages, maskf, stats=tuple(float(x) for x in stats))

        sums = per_rollout(torch.stack([kl.sum(1), (per_token * maskf).sum(1), maskf.sum(1),
                                        masked_sum(fwd.entropy, maskf, dim=1)], 1), rollout, len(trained))
        metrics, n_trained = self._rollout_metrics(loop, raw_scores, sums, values, returns, maskf, batch.ended,
                                                   trained)
        if n_trained:  # the controller follows the KL of the rollouts that train, counted as such
            self.kl_ctl.update(metrics["kl"], n_trained)
        loop.log_metrics({**metrics, **loop.rewards.metrics(rewards, loop.ranks.gather, loop.step())})
        if iteration % self.ppo.sample_every == 0:
            loop.write_samples(iteration, [
                {"prompt": row["prompt"], "response": text, "score": score if ok else None,
                 "kl": k if ok else None, **conversation_fields(t)}
                for row, text, score, k, ok, t in zip(
                    batch.rows, rewards.completions, raw_scores.tolist(), sums[:, 0].tolist(), trained.tolist(),
                    batch.trajectories)][:4])

        experience = Experience.from_batch(train, mask)
        for name, value in (("old_logps", logps), ("old_values", values), ("advantages", advantages),
                            ("returns", returns)):
            experience.add(name, value, Layout.TOKEN)
        if all("index" in row for row in train.rows):  # (S,) prompt rows, named by the non-finite guard
            experience.add(ROW_KEY, torch.tensor([int(row["index"]) for row in train.rows], dtype=torch.long,
                                                 device=maskf.device), Layout.SEQUENCE)
        loop.engine_correction(experience, train, fwd, mask)  # vLLM: is_weights
        return experience, None

    def shaped_scores(self, loop: Loop, scores: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
        """(B,) the scores PPO puts at the last sampled token: the outcome reward (the sources and the shaping terms,
        :attr:`~llmtune.rewards.shaping.RewardResult.outcome`) normalised with the running moments of every rank's
        trained scores (``normalize_scores``; the moments are updated with those first), clipped to ``score_clip``;
        0 on the rows that do not train (``trained`` False: they enter no moment)."""
        scores = scores.clone()
        if self.ppo.normalize_scores:
            gathered = loop.ranks.gather(torch.stack([scores, trained.float()], 1))  # (B, 2)
            self.score_stats.update(gathered[gathered[:, 1] > 0, 0])
            scores = (scores - self.score_stats.mean) / max(self.score_stats.std, 1e-8)
        if self.ppo.score_clip is not None:
            scores = scores.clamp(-self.ppo.score_clip, self.ppo.score_clip)
        return scores.masked_fill(~trained, 0.0)

    def _rollout_metrics(self, loop: Loop, scores, sums, values, returns, mask, ended, trained
                         ) -> tuple[dict[str, float], int]:
        """Means over all ranks' rollouts of this iteration that train (sequence sums for kl/non_score_reward), and
        how many of them there are; ``trained_response_fraction`` = that count / all rollouts. Without any, only
        ``kl_coef`` and the fraction are logged (a mean over no rollout is never logged).

        Args:
            scores: (B,) task rewards. sums: (B, 4) per rollout (over all its rows): KL, per-token reward, sampled
                tokens, entropy, each summed over its tokens. values, returns, mask: (S, N) of the training rows.
            ended, trained: (B,) bool.
        """
        kl, reward, lengths, entropy = sums.T
        per_row = torch.stack([
            scores.float(), kl, reward, lengths, (~ended.to(sums.device)).float(), entropy / lengths.clamp(min=1),
            trained.float().to(sums.device),
        ], dim=1)  # (B, 7)
        per_row = loop.ranks.gather(per_row)
        good = per_row[:, 6] > 0
        metrics = {"kl_coef": self.kl_ctl.value, "trained_response_fraction": float(good.float().mean())}
        n = int(good.sum())
        if not n:
            log.warning("no rollout of this iteration trains (step %d): every one failed (environment / tool "
                        "infrastructure) or is beyond rollout.max_staleness", loop.step())
            return metrics, 0
        score, kl_seq, reward_seq, length, truncated, ent, _ = per_row[good].T
        metrics.update({
            "score_mean": float(score.mean()), "score_std": float(score.std()) if n > 1 else 0.0,
            "kl": float(kl_seq.mean()), "non_score_reward": -self.kl_ctl.value * float(kl_seq.mean()),
            "reward_mean": float(reward_seq.mean()), "response_length": float(length.mean()),
            "truncated_fraction": float(truncated.mean()), "entropy": float(ent.mean()),
            "explained_variance": ops.explained_variance(values, returns, mask),
        })
        return metrics, n


def per_rollout(values: torch.Tensor, rollout: torch.Tensor, n: int) -> torch.Tensor:
    """(S, k) per training row -> (n, k) summed over each rollout's rows (the identity when every rollout is one
    row, ``rollout`` = arange)."""
    out = torch.zeros(n, values.shape[1], dtype=values.dtype, device=values.device)
    return out.index_add_(0, rollout.to(values.device), values)


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
        policy.add_adapter(VALUE, build_lora_config(recipe.adapter, policy.peft_config[POLICY].task_type, policy))
    for name, param in policy.named_parameters():
        if "lora_" in name and (f".{POLICY}." in name or f".{VALUE}." in name):
            param.requires_grad_(True)
    activate_frozen_chain(policy)  # add_adapter set every layer back to the policy adapter alone
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
