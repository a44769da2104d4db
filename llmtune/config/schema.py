"""Recipe schema: one pydantic model per YAML section, each field with type, default and help.

The help text of every field (``Field(description=...)``) is the single source for
``llmtune <stage> --help`` and for the README's option table. Units are in the names:
``*_steps`` are optimizer steps, ``*_tokens`` tokens, ``micro_batch_size`` is samples per device
per forward pass, ``global_batch_size`` samples per optimizer step across all devices.
Gradient accumulation is derived (``global_batch_size / (micro_batch_size * world_size)``), never set.

Cross-field rules live in :mod:`llmtune.config.validate` so that they can be reported together
with field errors in one message.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


SEED_MAX = 2**32 - 1  # numpy.random.seed accepts 0 .. 2**32-1


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors (``extra='forbid'``), types are strict and numbers
    finite."""

    # strict: no bool -> number and no str -> number coercion (`learning_rate: yes` is an error, not 1.0);
    # allow_inf_nan=False: `1.0e+400` (read as inf) and `.nan` are errors. YAML ints still fill float fields.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), strict=True,
                              allow_inf_nan=False)


class ModelConfig(Section):
    """Which base model to load and how."""

    name_or_path: str = Field(
        "builtin:smollm2-135m-instruct",
        description="Base model: a local HF directory, a hub id (needs network), a .gguf file, "
        "or builtin:smollm2-135m-instruct (the embedded default).",
    )
    from_run: str | None = Field(
        None,
        description="Start from an earlier finished run directory (e.g. runs/sft): its base model, chat template and "
        "adapter chain (lineage.json) are inherited; the earlier adapters are merged into the base in fp32 before "
        "this stage's new adapter is attached. An explicit name_or_path overrides the recorded base (logged).",
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) for hub ids.")
    dtype: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto",
        description="dtype the base weights are loaded in; auto = bf16/fp16 when precision asks for it, else fp32.",
    )
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention"] = Field(
        "sdpa", description="Attention kernel passed to transformers."
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the hub (off by default).")
    load_in_4bit: bool = Field(False, description="QLoRA: quantize the frozen base to 4 bit with bitsandbytes.")
    load_in_8bit: bool = Field(False, description="Quantize the frozen base to 8 bit with bitsandbytes (LLM.int8).")
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type (nf4 or fp4).")
    bnb_4bit_use_double_quant: bool = Field(True, description="Quantize the 4-bit quantization constants too.")
    bnb_4bit_compute_dtype: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="dtype of the 4-bit matmuls; auto = the training precision."
    )
    cache_dir: str | None = Field(
        None, description="Where builtin/GGUF conversions are cached (default $LLMTUNE_CACHE or ~/.cache/llmtune)."
    )


class DatasetConfig(Section):
    """One data source. Several sources are mixed by ``weight``."""

    path: str = Field(
        ...,
        description="Local .json/.jsonl/.parquet/.csv file, a datasets save_to_disk directory, a hub dataset "
        "name (needs network), builtin:gsm8k or builtin:sharegpt.",
    )
    format: Literal[
        "auto", "alpaca", "sharegpt", "messages", "text", "prompt_completion", "prompt", "preference",
        "preference_messages", "hh", "unpaired"
    ] = Field(
        "auto",
        description="Row format; auto detects it from the columns of the first row. SFT: alpaca, sharegpt, messages, "
        "text, prompt_completion. Preference pairs (rm, dpo): preference ({prompt, chosen, rejected} strings), "
        "preference_messages ({chosen, rejected} message lists sharing a prompt prefix, optional prompt), "
        "hh (HH-RLHF transcripts; prompt = text before the last Assistant turn). PPO prompts: any of these (a "
        "final assistant turn / completion / chosen response becomes the reference answer) or prompt ({prompt} "
        "string or message list, optional reference). KTO: unpaired ({prompt | messages, completion, label: "
        "true|false}) or any preference format (each pair becomes a desirable and an undesirable row).",
    )
    columns: dict[str, str] = Field(
        default_factory=dict,
        description="Map canonical field names to this file's column names, e.g. {instruction: question, "
        "output: answer} or {messages: conversations, role: from, content: value}.",
    )
    split: str = Field("train", description="Split to read from hub datasets and datasets directories.")
    name: str | None = Field(None, description="Hub dataset configuration name.")
    weight: float = Field(
        1.0, gt=0, description="Rows taken = weight x this source's valid rows (0.5 = a seeded random half, "
        "2 = every row twice, 1.5 = once plus a random half)."
    )
    max_samples: int | None = Field(None, ge=1, description="Read at most this many rows of this source.")
    allow_truncated_json: bool = Field(
        False,
        description="If the JSON file is cut off mid-record, keep the complete records before the cut "
        "(counted in the data report) instead of failing.",
    )
    system_prompt: str | None = Field(None, description="System message prepended to rows without one.")


class DataConfig(Section):
    """Data sources, formatting, masking and splitting."""

    datasets: list[DatasetConfig] = Field(
        default_factory=lambda: [DatasetConfig(path="builtin:gsm8k")], description="Data sources (mixed by weight)."
    )
    chat_template: str | None = Field(
        None,
        description="Chat template: null = the tokenizer's own, a builtin name (chatml, llama2, llama3, "
        "alpaca, zephyr), or a Jinja string. Saved with the adapter.",
    )
    max_length: int = Field(1024, ge=8, description="Maximum tokens per training sequence.")
    truncation: Literal["truncate", "drop"] = Field(
        "truncate", description="Rows longer than max_length: truncate them or drop them (counted). SFT truncate: "
        "the context (everything before the last assistant turn) is cut to max_prompt_length as truncation_mode "
        "says, then the response is cut at its end; text rows keep their first max_length tokens. Pairs and PPO "
        "prompts: see max_prompt_length."
    )
    bad_rows: Literal["error", "skip"] = Field(
        "error", description="Malformed rows: stop with an error naming them, or skip and count them."
    )
    train_on: Literal["assistant", "all"] = Field(
        "assistant", description="Which tokens get labels: assistant turns only (default) or the whole sequence."
    )
    packing: bool = Field(
        False, description="Pack short rows into max_length sequences (no attention across rows)."
    )
    padding_free: bool = Field(
        True, description="SFT: run each micro-batch as one sequence of its rows without padding, attention row by "
        "row (needs model.attn_implementation: sdpa, else transformers' packed-sequence mask). DPO: the prompt of a "
        "pair is computed once for chosen and rejected (sdpa/eager). Same losses either way."
    )
    max_samples: int | None = Field(None, ge=1, description="Use at most this many rows after mixing.")
    val_size: float = Field(
        0.0, ge=0, description="Held-out validation rows: a fraction in (0, 1) or an absolute count >= 1."
    )
    seed: int = Field(42, ge=0, le=SEED_MAX, description="Seed for mixing, shuffling and the validation split "
                      "(0 .. 2**32-1, numpy's range).")
    num_proc: int | None = Field(
        None, ge=1, description="Processes for tokenization; null = one per available CPU core (at most 8, shared by "
        "the ranks of this machine) when at least 2,000 rows are tokenized, else one.")
    cache: bool = Field(
        True, description="Reuse the tokenized data of an identical earlier build (same files by content, tokenizer, "
        "template, data section and llmtune code): a rerun, a resume and llmtune validate skip tokenization.")
    cache_dir: str | None = Field(
        None, description="Where tokenized data is cached (default $LLMTUNE_DATA_CACHE, else "
        "$LLMTUNE_CACHE/data or ~/.cache/llmtune/data).")
    max_prompt_length: int | None = Field(
        None,
        ge=1,
        description="SFT rows and preference pairs (rm, dpo) longer than max_length keep at most this many prompt "
        "tokens (SFT: the context before the last assistant turn: system, earlier turns, last user turn, generation "
        "prompt), cut as truncation_mode says, then the response/completions are cut at their end; must be < "
        "max_length. null = max_length - min(response tokens (pairs: the longer completion), max_length // 2): the "
        "response keeps all its tokens or at least half of max_length, and a prompt that fits in the rest is never "
        "cut. PPO prompts: the prompt limit (default max_length); the generation prompt is always kept.",
    )
    truncation_mode: Literal["keep_end", "keep_start"] = Field(
        "keep_end",
        description="Preference pairs, PPO prompts and the context of SFT rows: which end of a prompt longer than "
        "max_prompt_length is kept: keep_end (the last turns and the generation prompt, as TRL; the oldest turns go "
        "first, the BOS stays first) or keep_start (SFT and PPO: the generation prompt stays at the end). "
        "Completions/responses are always cut at their end.",
    )
    truncation_keep_system: bool = Field(
        False,
        description="truncation_mode keep_end: keep the system message in front of a cut prompt/context (SFT, pairs, "
        "PPO); a row whose system message alone does not fit, or whose template cannot render it on its own, is "
        "dropped and counted.",
    )


class AdapterConfig(Section):
    """Parameter-efficient adapter trained on top of the frozen base (peft)."""

    type: Literal["lora", "none"] = Field("lora", description="lora (LoRA/DoRA/QLoRA) or none (full fine-tuning).")
    lora_r: int = Field(16, ge=1, description="LoRA rank r.")
    lora_alpha: float = Field(32.0, gt=0, description="LoRA alpha; the update is scaled by alpha/r (alpha/sqrt(r) with rsLoRA).")
    lora_dropout: float = Field(0.05, ge=0, lt=1, description="Dropout on the LoRA input, in [0, 1).")
    target_modules: Annotated[list[str], Field(min_length=1)] | str = Field(
        "all-linear", description="Module names to adapt, or all-linear (every linear layer except the output head)."
    )
    modules_to_save: list[str] = Field(
        default_factory=list, description="Modules trained in full and saved with the adapter (e.g. lm_head, score)."
    )
    use_dora: bool = Field(False, description="Weight-decomposed LoRA (DoRA, Liu et al. 2024).")
    use_rslora: bool = Field(False, description="Rank-stabilised LoRA scaling alpha/sqrt(r) (Kalajdzievski 2023).")


class TrainConfig(Section):
    """Optimisation, schedule, evaluation and checkpointing. Steps are optimizer steps."""

    micro_batch_size: int = Field(1, ge=1, description="Samples per device per forward pass.")
    global_batch_size: int = Field(
        8, ge=1, description="Samples per optimizer step across all devices; accumulation is derived from it."
    )
    num_epochs: float = Field(1.0, gt=0, description="Passes over the training rows (ignored when max_steps is set).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    learning_rate: float = Field(2e-4, gt=0, description="Peak learning rate.")
    lr_scheduler: Literal["linear", "cosine", "constant", "cosine_with_min_lr", "warmup_stable_decay",
                          "cosine_with_restarts", "polynomial", "inverse_sqrt"] = Field(
        "cosine", description="transformers schedule after warmup (constant keeps the warmup then a flat rate; "
        "cosine_with_min_lr needs lr_scheduler_kwargs {min_lr_rate: 0.1} or {min_lr}; warmup_stable_decay needs "
        "{num_decay_steps: N})."
    )
    lr_scheduler_kwargs: dict[str, float | int | str] = Field(
        default_factory=dict, description="Extra arguments of the schedule (transformers' lr_scheduler_kwargs), "
        "checked against the schedule's signature, e.g. {min_lr_rate: 0.1}; steps are optimizer steps."
    )
    optim: str = Field(
        "adamw_torch", description="transformers optimizer name: adamw_torch, adamw_torch_fused (fused kernel), "
        "adamw_8bit / paged_adamw_8bit / paged_adamw_32bit (bitsandbytes; the usual QLoRA choice), adafactor, ..."
    )
    extra_args: dict[str, object] = Field(
        default_factory=dict, description="Any other transformers TrainingArguments field, e.g. "
        "{torch_compile: true}; fields llmtune sets from the recipe are refused with the key to use instead."
    )
    warmup_steps: int = Field(0, ge=0, description="Linear warmup length in optimizer steps.")
    warmup_ratio: float = Field(
        0.0, ge=0, le=1, description="Warmup as a fraction of all optimizer steps, ceil(ratio x steps) steps (used if "
        "warmup_steps=0; 1.0 = warm up over the whole run).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay; never applied to biases and norm weights.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    max_grad_norm: float = Field(1.0, ge=0, description="Clip the global gradient norm to this (0 = no clipping).")
    group_by_length: bool = Field(
        True, description="Batch training rows of similar length together (less padding; the order stays seeded)."
    )
    gradient_checkpointing: bool | Literal["auto"] = Field(
        "auto", description="Recompute activations in backward (non-reentrant; saves memory, ~30% slower). auto: "
        "off when the memory estimate printed before training without it fits in 85% of the device memory (CPU: the "
        "RAM this process can get), else on (llmtune.core.memory)."
    )
    seed: int = Field(42, ge=0, le=SEED_MAX, description="Seed for initialisation, dropout and data order "
                      "(0 .. 2**32-1, numpy's range).")
    eval_steps: int | None = Field(None, ge=1, description="Evaluate every N optimizer steps (null: only at start/end).")
    eval_at_start: bool = Field(True, description="Evaluate once before the first step (baseline for comparison).")
    eval_batch_size: int | None = Field(None, ge=1, description="Samples per device per eval forward (default micro_batch_size).")
    early_stopping_patience: int | None = Field(
        None, ge=1, description="Stop when eval loss has not improved for this many evaluations."
    )
    save_steps: int | None = Field(None, ge=1, description="Write a resumable checkpoint every N optimizer steps.")
    save_total_limit: int | None = Field(2, ge=1, description="Keep at most this many checkpoints.")
    resume_from: str | None = Field(
        "auto", description="auto: continue an unfinished run from its newest complete checkpoint, start fresh when "
        "it has none (a finished run or another recipe is refused); latest: the newest complete checkpoint, which "
        "must exist (also extends a finished run); a checkpoint directory; null: always start fresh (an existing run "
        "dir is refused)."
    )
    logging_steps: int = Field(1, ge=1, description="Log metrics every N optimizer steps.")
    max_nonfinite_steps: int = Field(
        3, ge=1, description="Stop the run after this many optimizer steps in a row whose loss or gradient norm is "
        "NaN/inf (such steps are never applied: skipped, counted and logged in metrics.jsonl).",
    )
    dataloader_num_workers: int = Field(0, ge=0, description="Data loader worker processes.")


class PrecisionConfig(Section):
    """Mixed precision. fp32 when both flags are off."""

    bf16: bool = Field(False, description="bf16 mixed precision (Ampere+ GPUs; CPU supported but slow).")
    fp16: bool = Field(False, description="fp16 mixed precision with loss scaling (GPU only).")
    tf32: bool = Field(False, description="Allow TF32 matmuls on Ampere+ GPUs.")


class DistributedConfig(Section):
    """Multi-process / multi-node launch and DeepSpeed ZeRO sharding.

    With ``nproc_per_node`` > 1 or ``nnodes`` > 1, ``llmtune <stage>`` re-launches itself through ``torchrun``
    (one process per GPU); under a launcher already (torchrun, accelerate launch, deepspeed, srun) the launcher
    keys are not used. Data is sharded over the ranks; ``train.global_batch_size`` stays samples per optimizer
    step over ALL ranks, so the accumulation shrinks as ranks are added.
    """

    deepspeed: str | None = Field(
        None, description="Path to a DeepSpeed JSON config, relative to the working directory (e.g. "
        "deepspeed_configs/zero3.json); its \"auto\" values (micro batch, accumulation, precision, clipping, "
        "optimizer) are filled from the recipe.")
    zero_stage: Literal[0, 1, 2, 3] | None = Field(
        None, description="DeepSpeed ZeRO stage when no config file is given: 1 shards optimizer states, 2 also "
        "gradients, 3 also the weights (the built-in config equals deepspeed_configs/zero<stage>.json).")
    nproc_per_node: int | None = Field(
        None, ge=1, description="Processes (GPUs) per node; > 1 re-launches through torchrun. null = 1, or what "
        "an outer launcher set up.")
    nnodes: int = Field(1, ge=1, description="Number of nodes (machines); every node runs the same command with "
                        "its own node_rank.")
    node_rank: int = Field(0, ge=0, description="Rank of this node, 0 .. nnodes-1 (node 0 hosts the rendezvous "
                           "and writes the run directory).")
    master_addr: str = Field("127.0.0.1", description="Address (host name or IP) of node 0, reachable from every "
                             "node.")
    master_port: int = Field(29500, ge=1, le=65535, description="Free TCP port on node 0 for the rendezvous.")


class RMConfig(Section):
    """Reward modeling (`llmtune rm`): Bradley-Terry loss on the score of the last real token."""

    margin: float = Field(
        0.0, description="Constant margin m in -log sigmoid(r_chosen - r_rejected - m), in reward units (0 = plain "
        "Bradley-Terry)."
    )
    center_rewards_coef: float = Field(
        0.0, ge=0, description="Weight c of the reward-centering term c * mean((r_chosen + r_rejected)^2) that keeps "
        "scores near zero (Eisenstein et al. 2023); 0 = off, 0.01 is typical."
    )


class DPOConfig(Section):
    """Direct preference optimization (`llmtune dpo`); the reference is the policy with its adapter disabled."""

    beta: float = Field(0.1, gt=0, description="Strength beta of the implicit KL penalty (higher = stay closer to "
                        "the reference); rewards are beta * (logp - ref_logp).")
    loss_type: Literal["sigmoid", "ipo", "hinge", "robust"] = Field(
        "sigmoid", description="sigmoid = DPO (Rafailov et al. 2023; cDPO with label_smoothing), ipo (Azar et al. "
        "2023), hinge (SLiC, Zhao et al. 2023), robust = rDPO (Chowdhury et al. 2024; needs label_smoothing > 0)."
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="Assumed probability epsilon in [0, 0.5) that a pair's preference label is "
        "flipped (sigmoid: cDPO, Mitchell 2023; robust: rDPO). Not used by ipo/hinge."
    )
    precompute_ref_logps: bool = Field(
        False, description="Compute the reference log-probs of every train/eval pair once before training and store "
        "them with the rows (no reference forward per step; needed for adapter.type: none)."
    )

    @model_validator(mode="after")
    def _smoothing_applies(self):
        if self.label_smoothing > 0 and self.loss_type in ("ipo", "hinge"):
            raise ValueError(f"label_smoothing applies to loss_type sigmoid or robust, not {self.loss_type}; "
                             "set dpo.label_smoothing: 0")
        if self.loss_type == "robust" and self.label_smoothing == 0:
            raise ValueError("loss_type robust needs label_smoothing in (0, 0.5) (the assumed label-flip rate)")
        return self


class ORPOConfig(Section):
    """ORPO (`llmtune orpo`; Hong et al. 2024): SFT loss on chosen + beta x odds-ratio term; no reference model."""

    beta: float = Field(0.1, ge=0, description="Weight lambda of the odds-ratio term -log sigmoid(log odds(chosen) "
                        "- log odds(rejected)) added to the chosen NLL (odds from token-mean log-probs; 0 = SFT on "
                        "chosen); rewards are beta * token-mean logp.")
    nll_on_prompt: bool = Field(False, description="Include the prompt tokens (and the template's text after the "
                                "turn) in the NLL term: token-mean NLL of the whole chosen sequence, as TRL's "
                                "ORPOTrainer always does and the paper's code without --disable_prompt_loss; false = "
                                "NLL of the chosen completion only (the SFT loss). The odds-ratio term always uses "
                                "completion tokens.")


class SimPOConfig(Section):
    """SimPO (`llmtune simpo`; Meng et al. 2024): length-normalised log-prob margin with a target margin; no
    reference model."""

    beta: float = Field(2.0, gt=0, description="Reward scale beta: reward = beta * token-mean logp of a completion "
                        "(the paper uses 2.0-10).")
    gamma: float = Field(0.5, ge=0, description="Target reward margin gamma in -log sigmoid(r_chosen - r_rejected - "
                         "gamma), in reward units (the paper uses 0.3-1.6; gamma / beta ~ 0.5 is a good start).")
    length_normalize: bool = Field(True, description="Divide each completion's summed log-prob by its token count "
                                   "(SimPO); false = summed log-probs (a reference-free DPO with a margin).")


class KTOConfig(Section):
    """KTO (`llmtune kto`; Ethayarajh et al. 2024): desirable / undesirable completions against a KL reference
    point estimated from mismatched prompt/completion pairs of each optimizer step; reference = adapter disabled."""

    beta: float = Field(0.1, gt=0, description="Strength beta: reward = beta * (logp - ref_logp).")
    desirable_weight: float = Field(1.0, gt=0, description="Loss weight lambda_D of desirable rows (label true). "
                                    "With imbalanced data keep desirable_weight x n_desirable / (undesirable_weight "
                                    "x n_undesirable) in [1, 4/3] (paper, Eq. 8; see data_report.json kto_balance).")
    undesirable_weight: float = Field(1.0, gt=0, description="Loss weight lambda_U of undesirable rows (label false).")


class PPOConfig(Section):
    """PPO (`llmtune ppo`): actor-critic RLHF (Schulman et al. 2017; Ouyang et al. 2022) with GAE (Schulman et al.
    2016). A PPO iteration = one rollout batch of ``rollout_batch_size`` prompts, then ``ppo_epochs`` passes over it
    in optimizer steps of ``train.global_batch_size`` rollouts; ``train.max_steps``/``save_steps``/``eval_steps`` count
    optimizer steps and must be multiples of ppo_epochs x rollout_batch_size / global_batch_size."""

    rollout_batch_size: int = Field(16, ge=1, description="Prompts generated per PPO iteration, over all ranks.")
    ppo_epochs: int = Field(2, ge=1, description="Passes of optimizer steps over each rollout batch.")
    kl_coef: float = Field(0.05, ge=0, description="Initial coefficient of the per-token KL(policy||reference) "
                           "penalty in the reward.")
    kl_target: float | None = Field(None, gt=0, description="Adaptive KL controller target (nats per response; "
                                    "Ziegler et al. 2019); null = fixed kl_coef.")
    kl_horizon: int = Field(10000, ge=1, description="Adaptive KL controller horizon, in rollouts (samples).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount gamma of GAE.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    cliprange: float = Field(0.2, gt=0, description="Clip range epsilon of the policy ratio.")
    cliprange_value: float = Field(0.2, gt=0, description="Clip range of the value prediction around the rollout "
                                   "value, in reward units.")
    vf_coef: float = Field(0.1, ge=0, description="Weight of the value loss in the total loss.")
    whiten_advantages: bool = Field(True, description="Normalise advantages to mean 0 / std 1 over the rollout batch.")
    normalize_scores: bool = Field(False, description="Normalise scores with their running mean/std (over all "
                                   "rollouts so far, this one included; never the identity).")
    score_clip: float | None = Field(None, gt=0, description="Clip (normalised) scores to [-score_clip, score_clip].")
    missing_eos_penalty: float | None = Field(None, description="Added to the score of a response that did not end "
                                              "with EOS within rollout.max_new_tokens (e.g. -1.0); null = none.")
    value_model: Literal["adapter"] = Field("adapter", description="adapter = a value head on its own LoRA adapter "
                                            "over the policy's base (one base in memory).")
    init_value_from_reward: bool = Field(True, description="Initialise the value adapter and head from the reward "
                                         "model's adapter and score head when reward.from_run is set.")
    sample_every: int = Field(1, ge=1, description="Write a few rollout completions to samples.jsonl every N PPO "
                              "iterations.")


class GRPOConfig(Section):
    """GRPO (`llmtune grpo`): group-relative policy optimization without a value model (Shao et al. 2024), with
    the DAPO (Yu et al. 2025) and Dr. GRPO (Liu et al. 2025) variants. An iteration = one rollout batch of
    ``rollout_batch_size`` completions (``rollout_batch_size / num_generations`` prompts, ``num_generations``
    completions each), then ``num_iterations`` passes over it in optimizer steps of ``train.global_batch_size``
    completions; ``train.max_steps``/``save_steps``/``eval_steps`` count optimizer steps and must be multiples of
    num_iterations x rollout_batch_size / global_batch_size. The reference is the policy with its adapter disabled."""

    num_generations: int = Field(4, ge=2, description="Completions sampled per prompt (the group size G).")
    rollout_batch_size: int = Field(16, ge=2, description="Completions per rollout batch over all ranks "
                                    "(prompts x num_generations); a multiple of train.global_batch_size.")
    num_iterations: int = Field(1, ge=1, description="Passes mu of optimizer steps over each rollout batch; the "
                                "importance ratio is taken against the sampling policy.")
    epsilon_low: float = Field(0.2, gt=0, lt=1, description="Lower clip range: ratio clipped at 1 - epsilon_low.")
    epsilon_high: float = Field(0.2, gt=0, description="Upper clip range: ratio clipped at 1 + epsilon_high (DAPO "
                                "clip-higher uses 0.28).")
    beta: float = Field(0.0, ge=0, description="Weight of the per-token KL(policy || reference) term in the loss "
                        "(0 = no KL term and no reference forward in training, as DAPO / TRL's default).")
    kl_estimator: Literal["k1", "k2", "k3"] = Field("k3", description="Per-token KL estimator (Schulman 2020); "
                                                   "k3 = exp(ref - logp) - (ref - logp) - 1, GRPO's.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="advantage_estimator grpo: advantage = reward - group mean, divided by the group's std "
        "(group, GRPO), the rollout batch's std (batch) or nothing (none, Dr. GRPO); statistics over the rows that "
        "train. YAML true/false read as group/none (TRL's scale_rewards).")

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _yaml_bool_scale(cls, value):
        # TRL and axolotl accept `scale_rewards: false` (Dr. GRPO's no std) and `true` (GRPO's group std)
        return {False: "none", True: "group"}.get(value, value) if isinstance(value, bool) else value

    advantage_estimator: Literal["grpo", "rloo", "reinforce_plus_plus"] = Field(
        "grpo", description="Baseline of the advantage (names as verl's AdvantageEstimator): grpo = group-relative "
        "(Shao et al. 2024; scale_rewards applies); rloo = reward - mean of the other trainable completions of its "
        "prompt, no std (Ahmadian et al. 2024; OpenRLHF rloo); reinforce_plus_plus = (reward - mean) / std over all "
        "trainable tokens of the rollout batch on all ranks, no per-prompt baseline (Hu 2025; OpenRLHF reinforce).")
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio against the sampling policy: token = per token (PPO/GRPO, clipped by "
        "epsilon_low/epsilon_high); sequence = GSPO (Zheng et al. 2025): exp(mean over the completion's tokens of "
        "logp - old logp), clipped by sequence_epsilon_low/high (TRL's importance_sampling_level).")
    sequence_epsilon_low: float = Field(3e-4, gt=0, lt=1, description="importance_sampling_level sequence: lower "
                                        "clip range of the sequence ratio (GSPO paper, Sec. 5.1: 3e-4; TRL reuses "
                                        "epsilon for it).")
    sequence_epsilon_high: float = Field(4e-4, gt=0, description="importance_sampling_level sequence: upper clip "
                                         "range of the sequence ratio (GSPO paper, Sec. 5.1: 4e-4).")
    overlong_buffer_tokens: int | None = Field(
        None, ge=0, description="DAPO overlong reward shaping (Yu et al. 2025, Eq. 13): L_cache, the last tokens "
        "before max_new_tokens over which the penalty grows linearly from 0 to -overlong_penalty_factor (completion "
        "length counts its end-of-turn token, as verl's DAPO reward manager); null or 0 = off. Logged as "
        "rewards/overlong_penalty_mean.")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="DAPO overlong reward shaping: the penalty at "
                                           "max_new_tokens (DAPO and verl: 1.0).")
    loss_aggregation: Literal["token_mean", "sequence_mean", "constant"] = Field(
        "token_mean", description="token_mean: sum over all completion tokens of the step / their number (DAPO); "
        "sequence_mean: mean over each completion's tokens, then over completions (GRPO); constant: token sum / "
        "(completions x rollout.max_new_tokens) (Dr. GRPO).")
    dynamic_sampling: Literal["off", "drop", "resample"] = Field(
        "off", description="Groups whose rewards are all equal carry no signal (always counted: "
        "all_equal_group_fraction). drop: leave them out of the loss and its normaliser; resample (DAPO): sample "
        "more prompts in their place, up to max_resample_rounds, then drop what is left.")
    @field_validator("dynamic_sampling", mode="before")
    @classmethod
    def _yaml_off(cls, value):
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false

    max_resample_rounds: int = Field(2, ge=1, description="dynamic_sampling resample: extra sampling rounds per "
                                     "rollout batch at most.")
    mask_truncated_completions: bool = Field(False, description="Leave completions cut at rollout.max_new_tokens "
                                             "out of the loss and of the advantage statistics (DAPO overlong "
                                             "filtering).")
    missing_eos_penalty: float | None = Field(None, description="Added to the reward of a completion cut at "
                                              "rollout.max_new_tokens (e.g. -1.0); null = none.")
    sample_every: int = Field(1, ge=1, description="Write a few rollout completions to samples.jsonl every N "
                              "iterations.")


# rollout.max_new_tokens when null: each online-RL stage's own default (completion / response tokens)
ROLLOUT_MAX_NEW_TOKENS = {"ppo": 64, "grpo": 128}


class VLLMConfig(Section):
    """The vLLM rollout engine (``rollout.engine: vllm``): in this process (``colocate``) or a server of its own
    (``server``, possibly on other GPUs or nodes, in its own environment). The trained LoRA adapter reaches the
    engine as a new, versioned LoRA request after every optimizer step; the adapters below it are merged once
    into the engine's base."""

    mode: Literal["colocate", "server"] = Field(
        "colocate", description="colocate: vLLM runs in the training process on the same device(s); server: the "
        "trainer samples through a running rollout server at url (`llmtune rollout-server RECIPE`).")
    url: str | None = Field(None, description="server mode: http://host:port of a running rollout server.")
    gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="colocate on GPU: fraction (0, 1] of device memory for vLLM (weights + KV "
        "cache); the trainer uses the rest.")
    enable_sleep_mode: bool = Field(True, description="colocate on GPU: release vLLM's KV cache and weights while "
                                    "training, wake it for each rollout batch.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest sequence (prompt + completion tokens) the engine serves; null = the longest "
        "prompt (data.max_prompt_length or data.max_length) + rollout.max_new_tokens.")
    max_lora_rank: int | None = Field(None, ge=1, description="Largest LoRA rank the engine accepts; null = the "
                                      "trained adapter's adapter.lora_r.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="dtype of the engine's weights and compute; auto = the trainer's precision (bf16/fp16 "
        "when precision asks for it, else float32).")
    startup_timeout_s: float = Field(600.0, gt=0, description="Seconds to wait for the engine / server to become "
                                     "healthy before failing.")
    request_timeout_s: float = Field(600.0, gt=0, description="Seconds one generation or weight-sync request to the "
                                     "engine may take before failing.")
    importance_sampling_correction: bool = Field(
        True, description="Truncated importance sampling (TIS; Yao et al. 2025, \"Your efficient RL framework "
        "secretly brings you off-policy RL training\"; TRL's vllm_importance_sampling_correction): multiply the "
        "per-token policy-gradient loss by min(pi_trainer / pi_engine, importance_sampling_cap) of each sampled "
        "token, correcting for the engine/trainer numerical mismatch (not the KL term).")
    importance_sampling_cap: float = Field(
        2.0, ge=1, description="Cap C of the per-token weight min(pi_trainer / pi_engine, C), >= 1 (Yao et al. "
        "2025 use C = 2, as TRL's token-level vllm_importance_sampling_cap default 2.0 did; TRL 1.16 defaults to "
        "sequence-level masking at 3.0).")

    @field_validator("url")
    @classmethod
    def _http_url(cls, value):
        if value is not None and not re.fullmatch(r"https?://[^/\s:]+(:\d{1,5})?/?", value):
            raise ValueError(f"must look like http://host:port (e.g. http://127.0.0.1:8000), got {value!r}")
        return value


class RolloutConfig(Section):
    """Sampling of the online-RL stages (PPO and GRPO): which rollout engine generates the completions and with which
    settings. The trainer recomputes the log-probs used in the loss; the engine's own log-probs only measure the
    mismatch (rollout/logprob_diff_*) and feed the importance-sampling correction."""

    engine: Literal["auto", "hf", "vllm"] = Field(
        "auto", description="Rollout engine: hf = transformers' generate on the training model; vllm = vLLM (see "
        "rollout.vllm); auto = vllm when CUDA is available and vLLM can be used (importable here for colocate, "
        "rollout.vllm.url set for server), else hf.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of the rollouts; the loss's log-probs "
                               "are taken at this temperature too.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold of the rollouts (1 = off).")
    top_k: int = Field(0, ge=0, description="Top-k sampling of the rollouts (0 = off).")
    max_new_tokens: int | None = Field(
        None, ge=1, description="Longest sampled completion in tokens; one that reaches it without the end-of-turn "
        "token is truncated (truncated_fraction). null = the stage's default (ppo 64, grpo 128).")
    eval_max_new_tokens: int | None = Field(None, ge=1, description="Longest greedy eval completion in tokens "
                                            "(null = max_new_tokens).")
    seed: int | None = Field(None, ge=0, le=SEED_MAX, description="Seed of the sampling; null = train.seed. The "
                             "engine's per-request seeds derive from (seed, iteration, rank).")
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)


class RewardFunctionConfig(Section):
    """One weighted reward function (``reward.functions`` entry)."""

    function: str = Field(..., description="module:function(prompts, completions[, references]) -> list[float].")
    weight: float = Field(1.0, description="Weight of this reward in the total.")
    name: str | None = Field(None, description="Metric name (rewards/<name>_mean); default the function's name.")


class RewardConfig(Section):
    """Where the reward of a (prompt, completion) comes from: an RM run and/or Python functions, each weighted
    (PPO takes exactly one of from_run / function)."""

    from_run: str | None = Field(None, description="A finished `llmtune rm` run directory: its base, adapter chain "
                                 "and score head give the score at the last real token.")
    function: str | None = Field(None, description="module:function(prompts, completions, references) -> "
                                 "list[float] (references = the dataset's answers when present, else None); "
                                 "builtin: llmtune.rewards:gsm8k_reward (+1 when the final '#### <number>' equals "
                                 "the reference answer, else 0), llmtune.rewards:format_reward (+1 when the "
                                 "completion ends with '#### <number>').")
    functions: list[RewardFunctionConfig] = Field(
        default_factory=list, description="GRPO: several weighted reward functions ({function, weight, name}); "
        "total = sum of weight x reward over these, function (weight 1) and from_run (from_run_weight).")
    from_run_weight: float = Field(1.0, description="Weight of the reward model's score in the total (GRPO).")
    batch_size: int = Field(8, ge=1, description="Sequences per reward-model forward.")


class OutputConfig(Section):
    """Where the run directory goes and what is logged."""

    dir: str = Field("runs/sft", description="Run directory (recipe, data report, metrics, checkpoints, adapter).")
    overwrite: bool = Field(False, description="Allow writing into a non-empty run directory that holds another run.")
    report_to: list[str] = Field(
        default_factory=list, description="Extra loggers, any transformers integration that is installed "
        "(tensorboard, wandb, mlflow, trackio, comet_ml, ...); metrics.jsonl is always written."
    )
    plot: bool = Field(True, description="Draw plots/summary.png and plots/all_metrics.png at the end.")
    push_to_hub: bool = Field(False, description="Upload adapter/ (with its model card) to the hub repo "
                              "hub_model_id when the stage finishes (needs network and a hub login).")
    hub_model_id: str | None = Field(None, description="Hub repo (org/name) for push_to_hub; created if missing.")
    hub_private: bool = Field(True, description="Create the hub repo private (an existing repo keeps its "
                              "visibility).")


class Recipe(Section):
    """A whole recipe: the sections nest like the YAML."""

    stage: Literal["sft", "rm", "dpo", "ppo", "grpo", "orpo", "simpo", "kto"] | None = Field(
        None, description="Stage this recipe is for; the CLI command must agree when it is set."
    )
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    adapter: AdapterConfig = Field(default_factory=AdapterConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    rm: RMConfig = Field(default_factory=RMConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    orpo: ORPOConfig = Field(default_factory=ORPOConfig)
    simpo: SimPOConfig = Field(default_factory=SimPOConfig)
    kto: KTOConfig = Field(default_factory=KTOConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @model_validator(mode="after")
    def _stage_max_new_tokens(self):
        """Fill ``rollout.max_new_tokens: null`` with the stage's default, so every reader gets an int."""
        if self.rollout.max_new_tokens is None and self.stage in ROLLOUT_MAX_NEW_TOKENS:
            self.rollout.max_new_tokens = ROLLOUT_MAX_NEW_TOKENS[self.stage]
        return self


SECTIONS: dict[str, type[Section]] = {
    name: field.annotation for name, field in Recipe.model_fields.items() if isinstance(field.annotation, type)
}
