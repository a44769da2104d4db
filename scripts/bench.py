#!/usr/bin/env python
"""Side-by-side benchmark: llmtune vs plain TRL (``SFTTrainer`` / ``DPOTrainer`` + peft) doing the same work.

    python scripts/bench.py --cpu     # SmolLM2-135M (builtin), GSM8K SFT + DPO pairs + GRPO, fp32, 2 cores
    python scripts/bench.py --cpu --cases grpo --threads 1   # GRPO only: llmtune vs TRL's GRPOTrainer
    python scripts/bench.py --gpu     # Llama-3-8B shape (random init), 2,048-token rows, LoRA / QLoRA nf4 / DPO, bf16
    python scripts/bench.py --tiny    # tiny random Llama, a few steps: the same code path in well under a minute
    python scripts/bench.py --async-rollouts   # GRPO max_staleness 1 vs 0 on one rollout server (bench_async.py)
    python scripts/bench.py --agent            # agent rollouts with slow tools: lock-step vs on their own (bench_agent.py)

DPO pairs: HH-RLHF from ``--hh-pairs PATH`` (or ``$LLMTUNE_BENCH_HH_PAIRS``), else pairs built from GSM8K.

Same work on both sides: the same model weights (llmtune's loader), the same token ids (llmtune tokenizes once; TRL
gets those ids pre-tokenized: ``input_ids`` + ``completion_mask`` for SFT, ``prompt_ids``/``chosen_ids``/
``rejected_ids`` for DPO), the same order (transformers' seeded sampler on both), micro/global batch, max length,
precision, LoRA config (llmtune's ``build_lora_config``: r16 all-linear, dropout 0), optimizer, schedule and seed.
Each run is its own subprocess (peak RSS per run); runs alternate A B A B ... The benchmark FAILS (exit 1) unless
both did the same work: identical trained tokens (and pairs) in every step, and step-1 losses within tolerance.

GRPO (``--cases grpo``): llmtune's ``llmtune grpo`` vs TRL's ``GRPOTrainer``, both sampling with transformers'
``generate`` on the training model: the same weights, the prompts llmtune draws in its order and as its token ids
(TRL's ``_tokenize_prompts`` looks them up; ``shuffle_dataset=False``), group size, completion length (every
completion is forced to exactly ``max_new_tokens`` tokens on both sides, so both sample and train the same tokens),
sampling settings and stop ids, LoRA, optimizer, clip range, token-mean loss, reward function (GSM8K correctness) and
seed. The check: identical prompt ids (hashed), prompt tokens and completion tokens in every iteration (completions
are sampled, so losses are not compared). Printed: ``GRPO | s per iteration | <llmtune> | <TRL> | <TRL / llmtune>x``,
sampling and the rest of the iteration apart, generation tokens/s, peak RSS, and the load average (the CPU may be
shared: read the ratios of alternated runs, not the absolute seconds).

Reported per run: trained tokens/s and processed (non-pad) tokens/s over the steady steps (after ``warmup``),
median step time, peak memory (CPU: peak RSS of the process; CUDA: ``max_memory_allocated``), MFU where the peak
FLOP/s of the device is known (``--peak-tflops`` or the GPU table). Ratios llmtune/TRL are computed per
alternated pair of runs; the table gives their median and min-max. Results go to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HH_ENV = "LLMTUNE_BENCH_HH_PAIRS"  # default of --hh-pairs: an HH-RLHF file (e.g. hh-rlhf-harmless-base-1800.jsonl.gz)


@dataclasses.dataclass
class Case:
    """One side-by-side comparison: a stage on a model and data, run by llmtune and by TRL."""

    name: str
    stage: str  # sft | dpo
    model: str  # llmtune model.name_or_path
    data: dict  # llmtune data: section
    micro_batch_size: int
    global_batch_size: int
    steps: int
    warmup: int  # first optimizer steps left out of the steady-state figures
    gradient_checkpointing: bool = False  # llmtune
    trl_gradient_checkpointing: bool = False
    load_in_4bit: bool = False
    bf16: bool = False
    loss_rtol: float = 2e-3  # step-1 loss tolerance (relative)
    grpo: dict | None = None  # grpo: section (stage grpo)
    rollout: dict | None = None  # rollout: section (stage grpo: the sampling settings)

    def recipe(self, out_dir: str, overrides: list[str] = ()) -> dict:
        """The llmtune recipe of this case (TRL's arguments are derived from the same recipe), with ``overrides``
        (``section.key=value``) applied."""
        from llmtune.config.load import apply_override, parse_override

        doc = {
            "stage": self.stage,
            "model": {"name_or_path": self.model, "load_in_4bit": self.load_in_4bit},
            "data": {**self.data, "val_size": 0},
            "adapter": {"type": "lora", "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.0,
                        "target_modules": "all-linear"},
            "train": {"micro_batch_size": self.micro_batch_size, "global_batch_size": self.global_batch_size,
                      "max_steps": self.steps, "learning_rate": 1e-4, "lr_scheduler": "constant", "warmup_steps": 0,
                      "group_by_length": False,  # the same (seeded random) order as TRL's default sampler
                      "gradient_checkpointing": self.gradient_checkpointing, "eval_at_start": False,
                      "logging_steps": 1, "seed": 42},
            "precision": {"bf16": self.bf16},
            "dpo": {"beta": 0.1},
            **({"grpo": self.grpo, "rollout": self.rollout, "reward": {"functions": [{"function": GRPO_REWARD}]}} if self.stage == "grpo"
               else {}),
            "output": {"dir": out_dir, "overwrite": True, "plot": False},
        }
        for text in overrides:
            apply_override(doc, *parse_override(text))
        return doc


GRPO_REWARD = "llmtune.rewards:gsm8k_reward"  # both sides (TRL through :func:`trl_gsm8k_reward`)


def grpo_case(model: str, steps: int, max_new_tokens: int, prompts: int = 4, num_generations: int = 4,
              max_samples: int = 64) -> Case:
    """GRPO on GSM8K questions: ``prompts`` x ``num_generations`` completions of exactly ``max_new_tokens`` tokens
    per iteration (:class:`RolloutProbe` forces the length on both sides), one optimizer step per iteration, the
    first iteration left out."""
    n = prompts * num_generations
    return Case("grpo", "grpo", model, {"datasets": [{"path": "builtin:gsm8k", "max_samples": max_samples}],
                                        "max_length": 512, "max_prompt_length": 256},
                micro_batch_size=min(4, n), global_batch_size=n, steps=steps, warmup=1,
                grpo={"num_generations": num_generations, "rollout_batch_size": n, "beta": 0.0, "epsilon_low": 0.2,
                      "epsilon_high": 0.28, "loss_aggregation": "token_mean", "scale_rewards": "group"},
                rollout={"engine": "hf", "max_new_tokens": max_new_tokens, "temperature": 0.8, "top_p": 1.0,
                         "top_k": 0})


# ---- cases of each mode ----------------------------------------------------------------------------------------
def pairs_source(work: Path, hh: Path | None, n: int = 400) -> dict:
    """The DPO pairs: the HH-RLHF file ``hh`` (``--hh-pairs`` / ``$LLMTUNE_BENCH_HH_PAIRS``) when given, else pairs
    built from GSM8K (the right answer vs the answer of the next question), written to ``work``."""
    if hh is not None:
        return {"path": str(hh), "format": "hh"}
    rows = gsm8k_rows(n + 1)
    path = work / "gsm8k_pairs.jsonl"
    with path.open("w") as f:
        for a, b in zip(rows, rows[1:]):
            f.write(json.dumps({"prompt": a["question"], "chosen": a["answer"], "rejected": b["answer"]}) + "\n")
    return {"path": str(path), "format": "preference"}


def gsm8k_rows(n: int) -> list[dict]:
    """The first ``n`` GSM8K rows ({question, answer}) of the builtin source."""
    from llmtune.config.schema import DatasetConfig
    from llmtune.data.sources import read_source

    return [r for r in read_source(DatasetConfig(path="builtin:gsm8k", max_samples=n), 0).rows]


def cpu_cases(work: Path, quick: bool, hh: Path | None = None) -> list[Case]:
    """SFT: 2 GSM8K rows per step, DPO: 1 HH pair per step, 4 steps (``--quick``: 3), the first left out;
    GRPO: 4 GSM8K questions x 4 completions x 48 tokens per iteration, 3 iterations (``--quick``: 32 tokens)."""
    steps, rows = (3, 2) if quick else (4, 2)
    return [
        Case("sft", "sft", "builtin:smollm2-135m-instruct",
             {"datasets": [{"path": "builtin:gsm8k", "max_samples": 64}], "max_length": 512}, rows, rows, steps, 1),
        Case("dpo", "dpo", "builtin:smollm2-135m-instruct",
             {"datasets": [{**pairs_source(work, hh), "max_samples": 64}], "max_length": 384, "max_prompt_length": 256,
              "bad_rows": "skip"}, rows // 2, rows // 2, steps, 1),
        grpo_case("builtin:smollm2-135m-instruct", 3, 32 if quick else 48),
    ]


def tiny_cases(work: Path, hh: Path | None = None) -> list[Case]:
    from llmtune.models.tiny import save_tiny_model

    model = save_tiny_model(work / "tiny-model", hidden_size=64, num_layers=2)
    sft = {"datasets": [{"path": "builtin:gsm8k", "max_samples": 24}], "max_length": 256}
    dpo = {"datasets": [{**pairs_source(work, hh), "max_samples": 16}], "max_length": 256, "max_prompt_length": 128,
           "bad_rows": "skip"}
    return [Case("sft", "sft", str(model), sft, 2, 4, 3, 1), Case("dpo", "dpo", str(model), dpo, 2, 2, 3, 1),
            grpo_case(str(model), 3, 8, prompts=2, max_samples=16)]


def gpu_cases(work: Path, hh: Path | None = None) -> list[Case]:
    model = str(work / "llama3-8b-shape")
    text = {"datasets": [{"path": str(work / "long_rows.jsonl"), "format": "text"}], "max_length": 2048}
    pairs = {"datasets": [{**pairs_source(work, hh), "max_samples": 128}], "max_length": 1024, "max_prompt_length": 512,
             "bad_rows": "skip"}
    tol = 5e-2  # bf16
    return [
        Case("sft_lora", "sft", model, text, 4, 4, 8, 2, gradient_checkpointing=False,
             trl_gradient_checkpointing=True, bf16=True, loss_rtol=tol),
        Case("sft_qlora", "sft", model, text, 4, 4, 8, 2, gradient_checkpointing=True,
             trl_gradient_checkpointing=True, load_in_4bit=True, bf16=True, loss_rtol=tol),
        Case("dpo", "dpo", model, pairs, 4, 4, 8, 2, gradient_checkpointing=False,
             trl_gradient_checkpointing=True, bf16=True, loss_rtol=tol),
    ]


def make_gpu_model(work: Path) -> None:
    """Llama-3-8B-shaped random-init model (bf16 safetensors) with SmolLM2's tokenizer, and rows of >= 2,048 tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtune.config import ModelConfig
    from llmtune.models import load_tokenizer

    out = work / "llama3-8b-shape"
    if not (out / "config.json").exists():
        cfg = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                          intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
                          rope_theta=500000.0, tie_word_embeddings=False, dtype="bfloat16")
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(out)
        del model
        torch.cuda.empty_cache()
        load_tokenizer(ModelConfig(name_or_path="builtin:smollm2-135m-instruct")).save_pretrained(out)
    rows = gsm8k_rows(1319)
    with (work / "long_rows.jsonl").open("w") as f:  # 30 GSM8K rows per text: > 2,048 tokens, cut at max_length
        for i in range(0, 64 * 30, 30):
            picked = (rows[j % len(rows)] for j in range(i, i + 30))
            text = "\n\n".join(r["question"] + "\n" + r["answer"] for r in picked)
            f.write(json.dumps({"text": text}) + "\n")


# ---- one run (worker subprocess) ----------------------------------------------------------------------------------
class Probe:
    """Per-optimizer-step measurements, taken the same way in both trainers: wraps ``_get_num_items_in_batch``
    (called once per optimizer step with all its micro-batches, before the first forward) and adds a callback for
    the end of the step. Step time = from that call to ``on_step_end`` (data, forward, backward, optimizer)."""

    def __init__(self):
        self.trainer = None
        self.start = None
        self.steps: list[dict] = []

    def wrap(self, cls) -> None:
        from transformers import TrainerCallback

        original = cls._get_num_items_in_batch
        probe = self

        class _End(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if probe.start is not None:
                    probe.steps[-1]["time_s"] = time.perf_counter() - probe.start
                    probe.start = None

        def wrapped(trainer, batch_samples, device):
            if probe.trainer is None:
                probe.trainer = trainer
                trainer.add_callback(_End())
            probe.start = time.perf_counter()
            probe.steps.append(work_of(batch_samples))
            return original(trainer, batch_samples, device)

        cls._get_num_items_in_batch = wrapped


class RolloutProbe:
    """Per-iteration measurements of GRPO, taken the same way in both trainers (one optimizer step per iteration):
    wraps transformers' ``GenerationMixin.generate`` (what both sample with) to time it, count prompts, prompt
    tokens and completion tokens (up to and including the first of ``eos_ids``) and hash the prompt ids, and forces
    every completion to ``max_new_tokens`` tokens (``min_new_tokens``: EOS suppressed until then), so that both sides
    sample and train the same number of tokens whatever they draw. Iteration time = from the end of the previous
    optimizer step (``on_step_end``; the first from ``on_train_begin``) to the end of this one: sampling, scoring,
    forward/backward and the optimizer step."""

    def __init__(self, max_new_tokens: int, eos_ids: list[int]):
        self.max_new_tokens, self.eos_ids = max_new_tokens, eos_ids
        self.trainer = None
        self.last = None
        self.current = self._empty()
        self.steps: list[dict] = []

    @staticmethod
    def _empty() -> dict:
        return {"generation_s": 0.0, "prompts": 0, "prompt_tokens": 0, "completion_tokens": 0, "prompt_hash": ""}

    def wrap(self, cls) -> None:
        import hashlib

        import torch
        from transformers import GenerationMixin, TrainerCallback

        probe = self

        class _Steps(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                probe.last = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                now = time.perf_counter()
                probe.steps.append({**probe.current, "time_s": now - probe.last})
                probe.current, probe.last = probe._empty(), now

        original_init = cls.__init__

        def init(trainer, *args, **kwargs):
            original_init(trainer, *args, **kwargs)
            if probe.trainer is None:
                probe.trainer = trainer
                trainer.add_callback(_Steps())

        cls.__init__ = init
        original_generate = GenerationMixin.generate

        def generate(model, *args, **kwargs):
            kwargs["min_new_tokens"] = probe.max_new_tokens
            start = time.perf_counter()
            out = original_generate(model, *args, **kwargs)
            seconds = time.perf_counter() - start
            ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            completions = sequences[:, ids.shape[1]:]
            is_eos = torch.isin(completions, torch.tensor(probe.eos_ids, device=completions.device))
            real = ((is_eos.long().cumsum(1) - is_eos.long()) == 0).sum()  # up to and including the first EOS
            prompts = sorted(tuple(row[m.bool()].tolist()) for row, m in zip(ids, mask))
            c = probe.current
            c["generation_s"] += seconds
            c["prompts"] += ids.shape[0]
            c["prompt_tokens"] += int(mask.sum())
            c["completion_tokens"] += int(real)
            c["prompt_hash"] = hashlib.sha1((c["prompt_hash"] + repr(prompts)).encode()).hexdigest()[:16]
            return out

        GenerationMixin.generate = generate


def work_of(batch_samples: list[dict]) -> dict:
    """Trained tokens (next-token targets; DPO: completion tokens), processed non-pad tokens and rows of a step."""
    trained = seen = rows = 0
    for b in batch_samples:
        if "labels" in b:
            trained += int((b["labels"][:, 1:] != -100).sum())
        else:  # TRL DPO: completion_mask over the unshifted sequence (the prompt is never empty)
            trained += int(b["completion_mask"].sum())
        seen += int(b["attention_mask"].sum()) if "attention_mask" in b else b["input_ids"].numel()
        # padding-free batches hold their rows in one sequence (row_index); 4-D or pair batches one row per row
        rows += int(b["row_index"].max()) + 1 if "row_index" in b else b["input_ids"].shape[0]
    return {"trained_tokens": trained, "seen_tokens": seen, "rows": rows}


def run_llmtune(case: Case, out: Path, probe: Probe, overrides: list[str] = ()) -> None:
    from llmtune.config import load_recipe
    from llmtune.core.runner import run_stage
    from llmtune.core.trainer import CoreTrainer
    from llmtune.stages import STAGES

    probe.wrap(CoreTrainer)
    run_stage(STAGES[case.stage](load_recipe(raw=case.recipe(str(out / "run"), overrides))), base_dir=str(ROOT))


def run_trl(case: Case, out: Path, probe: Probe) -> None:
    from datasets import Dataset

    from llmtune.config import load_recipe
    from llmtune.core.stage import prepare_tokenizer
    from llmtune.core.distributed import batch_layout
    from llmtune.models import build_lora_config, load_model
    from llmtune.stages import STAGES

    recipe = load_recipe(raw=case.recipe(str(out / "run")))
    tokenizer = prepare_tokenizer(recipe)
    rows = STAGES[case.stage](recipe).build_data(tokenizer, str(ROOT)).train  # llmtune's ids, TRL's trainer
    model = load_model(recipe.model, recipe.precision)
    if case.stage == "grpo":
        return run_trl_grpo(recipe, tokenizer, rows, model, out, probe)
    t = recipe.train
    common = dict(
        output_dir=str(out / "trl"), per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=batch_layout(recipe, 1)["accumulation_steps"], max_steps=t.max_steps,
        learning_rate=t.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, optim="adamw_torch", seed=t.seed, data_seed=t.seed, logging_steps=1,
        save_strategy="no", report_to="none", bf16=case.bf16, gradient_checkpointing=case.trl_gradient_checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False}, max_length=recipe.data.max_length,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    peft_config = build_lora_config(recipe.adapter)
    if case.stage == "sft":
        from trl import SFTConfig, SFTTrainer

        ds = Dataset.from_dict({"input_ids": list(rows["input_ids"]),
                                "completion_mask": [[int(x != -100) for x in lab] for lab in rows["labels"]]})
        probe.wrap(SFTTrainer)
        trainer = SFTTrainer(model=model, args=SFTConfig(**common, completion_only_loss=True, packing=False),
                             train_dataset=ds, processing_class=tokenizer, peft_config=peft_config)
    else:
        from trl import DPOConfig, DPOTrainer

        class PretokenizedDPOTrainer(DPOTrainer):
            def _prepare_dataset(self, dataset, *args, **kwargs):  # the ids are llmtune's, already tokenized
                return dataset

        def trained_span(row: dict, side: str) -> list[int]:
            """The completion up to its last trained token: TRL trains every completion id, llmtune not the
            template's text after the end-of-turn (label -100; a causal model's earlier logits do not see it)."""
            labels = row[f"{side}_labels"]
            end = max(i for i, x in enumerate(labels) if x != -100) + 1
            return row[f"{side}_input_ids"][row["prompt_length"]:end]

        cols = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": []}
        for row in rows:
            cols["prompt_ids"].append(row["chosen_input_ids"][:row["prompt_length"]])
            cols["chosen_ids"].append(trained_span(row, "chosen"))
            cols["rejected_ids"].append(trained_span(row, "rejected"))
        probe.wrap(PretokenizedDPOTrainer)
        trainer = PretokenizedDPOTrainer(model=model, args=DPOConfig(**common, beta=recipe.dpo.beta),
                                         train_dataset=Dataset.from_dict(cols), processing_class=tokenizer,
                                         peft_config=peft_config)
    trainer.train()


def trl_gsm8k_reward(prompts, completions, reference, **kwargs) -> list[float]:
    """llmtune's GSM8K reward (:data:`GRPO_REWARD`) in TRL's signature (dataset columns as keyword arguments)."""
    from llmtune.rewards import gsm8k_reward

    return gsm8k_reward(prompts, completions, reference)


def llmtune_prompt_order(n_rows: int, seed: int, iterations: int, per_iteration: int) -> list[int]:
    """The prompt rows llmtune's online RL draws in iterations 0 .. iterations-1 (one process), in order."""
    from llmtune.rl.rollouts import prompt_indices

    return [i for it in range(iterations) for i in prompt_indices(n_rows, seed, it, per_iteration)]


def run_trl_grpo(recipe, tokenizer, rows, model, out: Path, probe: RolloutProbe) -> None:
    """TRL's ``GRPOTrainer`` on llmtune's work: the prompts llmtune draws, in its order (``shuffle_dataset=False``),
    as llmtune's token ids (``_tokenize_prompts`` looks them up), the same stop ids, sampling settings, group size,
    LoRA, optimizer, clip range, token-mean loss ("dapo") and reward function; transformers' ``generate``."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from llmtune.core.distributed import batch_layout
    from llmtune.models import build_lora_config

    t, g, r = recipe.train, recipe.grpo, recipe.rollout
    order = llmtune_prompt_order(len(rows), t.seed, t.max_steps, g.rollout_batch_size // g.num_generations)
    ids_of: dict[str, list[int]] = {}
    for i in order:
        ids = list(rows[i]["input_ids"])
        if ids_of.setdefault(rows[i]["prompt"], ids) != ids:
            raise SystemExit(f"error: two prompt rows with the text {rows[i]['prompt'][:60]!r} differ in token ids")
    ds = Dataset.from_dict({"prompt": [rows[i]["prompt"] for i in order],
                           "reference": [rows[i]["reference"] for i in order]})

    class PretokenizedGRPOTrainer(GRPOTrainer):
        def _tokenize_prompts(self, prompts):  # llmtune's prompt ids (chat template, one BOS, truncation)
            return [ids_of[p] for p in prompts], None, {}

    model.generation_config.eos_token_id = probe.eos_ids  # stop where llmtune stops (the template's end of turn)
    args = GRPOConfig(
        output_dir=str(out / "trl"), per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=batch_layout(recipe, 1)["accumulation_steps"], max_steps=t.max_steps,
        learning_rate=t.learning_rate, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm, optim="adamw_torch", seed=t.seed, data_seed=t.seed, logging_steps=1,
        save_strategy="no", report_to="none", bf16=False, fp16=False, gradient_checkpointing=False,
        dataloader_num_workers=0, disable_tqdm=True, shuffle_dataset=False,
        num_generations=g.num_generations, generation_batch_size=g.rollout_batch_size, num_iterations=g.num_iterations,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        beta=g.beta, epsilon=g.epsilon_low, epsilon_high=g.epsilon_high, loss_type="dapo", scale_rewards="group",
        mask_truncated_completions=g.mask_truncated_completions,
    )
    probe.wrap(PretokenizedGRPOTrainer)
    trainer = PretokenizedGRPOTrainer(model=model, reward_funcs=[trl_gsm8k_reward], args=args, train_dataset=ds,
                                      processing_class=tokenizer, peft_config=build_lora_config(recipe.adapter))
    trainer.train()


def worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    case, side, out = Case(**spec["case"]), spec["side"], Path(spec["out"])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from llmtune.core.memory import peak_memory_gb, reset_peak_memory

    reset_peak_memory()  # both sides measured from here (llmtune's run_stage resets it again: nothing in between)
    probe = rollout_probe(case) if case.stage == "grpo" else Probe()
    t0 = time.perf_counter()
    if side == "trl":
        run_trl(case, out, probe)
    else:
        run_llmtune(case, out, probe, spec.get("overrides", []) if side == "alt" else [])
    history = probe.trainer.state.log_history
    losses = [r["loss"] for r in history if "loss" in r]
    flops = None
    if case.stage != "grpo":
        from llmtune.core.flops import train_flops_per_token

        steps = probe.steps
        seq_len = sum(x["seen_tokens"] for x in steps) / max(sum(x["rows"] for x in steps), 1)
        flops = train_flops_per_token(probe.trainer.model, seq_len, reference_forward=case.stage == "dpo")
    result = {
        "side": side, "case": case.name, "steps": probe.steps, "losses": losses, "peak_mem_gb": peak_memory_gb(),
        "wall_s": time.perf_counter() - t0, "flops_per_token": flops,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }
    Path(spec["result"]).write_text(json.dumps(result))


def rollout_probe(case: Case) -> RolloutProbe:
    """The :class:`RolloutProbe` of a GRPO case: its max_new_tokens and llmtune's stop set (the template's end of
    turn, the tokenizer's and the model's generation-config EOS: :func:`llmtune.data.templates.stop_token_ids`, where
    llmtune stops a completion; TRL is given the same ids)."""
    from transformers import GenerationConfig

    from llmtune.config import load_recipe
    from llmtune.core.stage import prepare_tokenizer
    from llmtune.data.templates import stop_token_ids
    from llmtune.models.load import resolve_model_source

    recipe = load_recipe(raw=case.recipe(tempfile.mkdtemp()))
    try:
        generation = GenerationConfig.from_pretrained(resolve_model_source(recipe.model).path)
    except OSError:  # no generation_config.json: the tokenizer and template only
        generation = None
    return RolloutProbe(recipe.rollout.max_new_tokens, stop_token_ids(prepare_tokenizer(recipe), generation))


# ---- driver ----------------------------------------------------------------------------------------------------------
def summarize(r: dict, case: Case, peak_tflops: float | None) -> dict:
    steady = [s for s in r["steps"][case.warmup:] if "time_s" in s]
    if case.stage == "grpo":  # one optimizer step per iteration
        med = statistics.median
        return {"s_per_iteration": med(s["time_s"] for s in steady),
                "generation_s": med(s["generation_s"] for s in steady),
                "rest_s": med(s["time_s"] - s["generation_s"] for s in steady),
                "generation_tokens_per_s": (sum(s["completion_tokens"] for s in steady)
                                            / sum(s["generation_s"] for s in steady)),
                "peak_mem_gb": r["peak_mem_gb"], "wall_s": r["wall_s"]}
    time_s = sum(s["time_s"] for s in steady)
    trained = sum(s["trained_tokens"] for s in steady)
    seen = sum(s["seen_tokens"] for s in steady)
    rows = sum(s["rows"] for s in steady)
    out = {
        "trained_tokens_per_s": trained / time_s, "tokens_per_s": seen / time_s,
        "median_step_s": statistics.median(s["time_s"] for s in steady), "peak_mem_gb": r["peak_mem_gb"],
        "pairs_per_s": rows / 2 / time_s if case.stage == "dpo" else None, "wall_s": r["wall_s"],
    }
    out["model_tflops_per_s"] = r["flops_per_token"] * out["tokens_per_s"] / 1e12  # llmtune.core.flops
    out["mfu"] = out["model_tflops_per_s"] / peak_tflops if peak_tflops else None
    return out


def check_same_work(a: dict, b: dict, case: Case) -> list[str]:
    """Problems if llmtune (a) and TRL (b) did not do the same work. GRPO: the same prompt ids (hashed), prompt and
    completion tokens in every iteration (completions are sampled, so losses are not compared)."""
    problems = []
    if case.stage == "grpo":
        keys = ("prompt_hash", "prompts", "prompt_tokens", "completion_tokens")
        ka, kb = ([tuple(s[k] for k in keys) for s in r["steps"]] for r in (a, b))
        if ka != kb or not ka:
            problems.append(f"{case.name}: {keys} per iteration differ: llmtune {ka} vs TRL {kb}")
        return problems
    ka = [(s["trained_tokens"], s["rows"]) for s in a["steps"]]
    kb = [(s["trained_tokens"], s["rows"]) for s in b["steps"]]
    if ka != kb:
        problems.append(f"{case.name}: (trained tokens, rows) per step differ: llmtune {ka} vs TRL {kb}")
    if not a["losses"] or not b["losses"]:
        problems.append(f"{case.name}: a run logged no loss")
    elif abs(a["losses"][0] - b["losses"][0]) > case.loss_rtol * max(abs(b["losses"][0]), 1e-3):
        problems.append(f"{case.name}: step-1 loss llmtune {a['losses'][0]:.6f} vs TRL {b['losses'][0]:.6f} "
                        f"(tolerance {case.loss_rtol:.0e} relative)")
    return problems


def run_one(case: Case, side: str, work: Path, tag: str, timeout: float, overrides: list[str] = ()) -> dict:
    out = work / f"{case.name}-{side}-{tag}"
    out.mkdir(parents=True, exist_ok=True)
    spec = {"case": dataclasses.asdict(case), "side": side, "out": str(out), "result": str(out / "result.json"),
            "overrides": list(overrides)}
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TQDM_DISABLE": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--worker", str(out / "spec.json")], env=env,
                          capture_output=True, text=True, timeout=timeout)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"error: the {side} run of {case.name} failed (exit {proc.returncode}); log {out / 'log.txt'}:"
                         f"\n{(proc.stdout + proc.stderr)[-3000:]}")
    print(f"  {case.name:10s} {side:8s} run {tag}: {time.perf_counter() - t0:6.1f} s", flush=True)
    return json.loads((out / "result.json").read_text())


def ratio_stats(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--cpu", action="store_true", help="SmolLM2-135M on the CPU (default)")
    mode.add_argument("--gpu", action="store_true", help="Llama-3-8B shape on one CUDA GPU")
    mode.add_argument("--tiny", action="store_true", help="tiny random model, seconds (tests, acceptance --tiny)")
    ap.add_argument("--reps", type=int, default=None, help="alternated run pairs per case (default 2; tiny, gpu 1)")
    ap.add_argument("--cases", default=None, help="comma-separated case names to run (default all)")
    ap.add_argument("--quick", action="store_true", help="--cpu with fewer steps")
    ap.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: GPU table)")
    ap.add_argument("--work", default=None, help="directory for runs (default a temporary one)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per run")
    ap.add_argument("--hh-pairs", type=Path, default=os.environ.get(HH_ENV) or None, metavar="PATH",
                    help=f"HH-RLHF pairs file for the DPO cases (default ${HH_ENV}; without either: pairs built "
                    "from GSM8K)")
    ap.add_argument("--against", action="append", default=[], metavar="KEY=VALUE",
                    help="ablation: compare llmtune's defaults with llmtune under this recipe override (repeatable) "
                         "instead of TRL, e.g. --against data.padding_free=false")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads per run (OMP_NUM_THREADS; default torch's own: one per core)")
    ap.add_argument("--generation", action="store_true", help="instead: rollout generation tokens/s of the hf and "
                    "vLLM engines side by side (scripts/bench_generation.py)")
    ap.add_argument("--async-rollouts", action="store_true", help="instead: GRPO with rollout.max_staleness 1 vs 0 "
                    "on one rollout server (scripts/bench_async.py)")
    ap.add_argument("--agent", action="store_true", help="instead: multi-turn rollouts with slow tools, lock-step vs "
                    "each rollout on its own vs the ideal (scripts/bench_agent.py)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.async_rollouts:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_async import main as async_main

        return async_main(["--tiny"] if args.tiny else [])
    if args.agent:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_agent import main as agent_main

        return agent_main(["--tiny"] if args.tiny else [])
    if args.generation:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_generation import main as generation_main

        return generation_main(["--tiny"] if args.tiny else [])
    sys.path.insert(0, str(ROOT))
    hh = args.hh_pairs
    if hh is not None and not Path(hh).is_file():
        print(f"error: --hh-pairs / ${HH_ENV}: {hh} is not a file; give an HH-RLHF pairs file (e.g. "
              "hh-rlhf-harmless-base-1800.jsonl.gz) or leave both unset to use pairs built from GSM8K",
              file=sys.stderr)
        return 2
    if hh is None and not args.generation:
        print(f"DPO pairs: built from GSM8K (no --hh-pairs / ${HH_ENV} given)", flush=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="llmtune-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    name = "gpu" if args.gpu else "tiny" if args.tiny else "cpu"
    if args.gpu:
        make_gpu_model(work)
        cases = gpu_cases(work, hh)
    elif args.tiny:
        cases = tiny_cases(work, hh)
    else:
        cases = cpu_cases(work, args.quick, hh)
    if args.cases:
        wanted = set(args.cases.split(","))
        cases = [c for c in cases if c.name in wanted]
    reps = args.reps or (1 if args.tiny or args.gpu else 2)  # --gpu: 6 runs of an 8B model fit ~10 minutes
    peak = args.peak_tflops
    import torch

    if peak is None:
        from llmtune.core.flops import peak_tflops

        peak = peak_tflops()
    import platform

    import peft
    import transformers
    import trl

    env = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "mode": name, "cpus": os.cpu_count(),
           "processor": platform.processor() or platform.machine(),
           "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "torch": torch.__version__,
           "transformers": transformers.__version__, "peft": peft.__version__, "trl": trl.__version__,
           "command": " ".join(["python", "scripts/bench.py", *(argv if argv is not None else sys.argv[1:])])}
    print(f"bench {name}: {reps} alternated pair(s) per case; {env}", flush=True)
    other = "alt" if args.against else "trl"
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by every run
        env["threads"] = args.threads
    env["baseline"] = f"llmtune with {' '.join(args.against)}" if args.against else f"TRL {trl.__version__}"
    problems, report = [], {"env": env, "cases": {}}
    for case in cases:
        runs = {"llmtune": [], other: []}
        for rep in range(reps):
            order = ("llmtune", other) if rep % 2 == 0 else (other, "llmtune")  # A B, then B A: no side always first
            for side in order:
                runs[side].append(run_one(case, side, work, str(rep), args.timeout, args.against))
        for a, b in zip(runs["llmtune"], runs[other]):
            problems += check_same_work(a, b, case)
        sums = {side: [summarize(r, case, peak) for r in rs] for side, rs in runs.items()}
        sums["trl"] = sums.pop(other)  # the baseline column (TRL, or llmtune with --against)
        runs["trl"] = runs.pop(other)
        pairs = list(zip(sums["llmtune"], sums["trl"]))
        first = runs["llmtune"][0]
        if case.stage == "grpo":  # speed = TRL's seconds / llmtune's (> 1: llmtune faster)
            ratios = {"speed": [y["s_per_iteration"] / x["s_per_iteration"] for x, y in pairs],
                      "generation": [y["generation_s"] / x["generation_s"] for x, y in pairs],
                      "rest": [y["rest_s"] / x["rest_s"] for x, y in pairs],
                      "peak_mem": [x["peak_mem_gb"] / y["peak_mem_gb"] for x, y in pairs]}
            same_work = {key + "_per_step": [s[key] for s in first["steps"]]
                         for key in ("prompts", "prompt_tokens", "completion_tokens")}
        else:
            speed = "pairs_per_s" if case.stage == "dpo" else "trained_tokens_per_s"
            ratios = {"speed": [x[speed] / y[speed] for x, y in pairs],
                      "step_time": [x["median_step_s"] / y["median_step_s"] for x, y in pairs],
                      "peak_mem": [x["peak_mem_gb"] / y["peak_mem_gb"] for x, y in pairs]}
            same_work = {"trained_tokens_per_step": [s["trained_tokens"] for s in first["steps"]],
                         "rows_per_step": [s["rows"] for s in first["steps"]],
                         "step1_loss": {"llmtune": first["losses"][:1], "trl": runs["trl"][0]["losses"][:1]}}
        report["cases"][case.name] = {"case": dataclasses.asdict(case), "runs": sums, "ratios": ratios,
                                      "work": same_work, "load_average": os.getloadavg()}
    print_table(report, peak)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    if problems:
        print(f"FAILED: llmtune and {env['baseline']} did not do the same work:\n  " + "\n  ".join(problems))
        return 1
    print("same work: identical trained tokens and rows in every step; step-1 losses within tolerance"
          + ("; GRPO: identical prompt ids, prompt and completion tokens in every iteration"
             if any(c["case"]["stage"] == "grpo" for c in report["cases"].values()) else ""))
    return 0


def print_table(report: dict, peak: float | None) -> None:
    med = statistics.median
    base = report["env"]["baseline"]
    lines = ["", f"| case | metric | llmtune | {base} | llmtune / baseline (median, min-max) |",
             "|---|---|---:|---:|---:|"]
    for name, c in report["cases"].items():
        L, T, R = c["runs"]["llmtune"], c["runs"]["trl"], c["ratios"]
        if c["case"]["stage"] == "grpo":
            lines += grpo_rows(name.upper(), c)
            continue
        speed = "pairs_per_s" if c["case"]["stage"] == "dpo" else "trained_tokens_per_s"
        rows = [(speed.replace("_", " "), speed, "speed", "{:.1f}"),
                ("processed tokens/s", "tokens_per_s", None, "{:.1f}"),
                ("median step s", "median_step_s", "step_time", "{:.2f}"),
                ("peak memory GiB", "peak_mem_gb", "peak_mem", "{:.2f}"),
                ("model TFLOP/s", "model_tflops_per_s", None, "{:.3f}")]
        if peak:
            rows.append(("MFU", "mfu", None, "{:.1%}"))
        for label, key, ratio, fmt in rows:
            r = ratio_stats(R[ratio]) if ratio else ""
            lines.append(f"| {name} | {label} | {fmt.format(med(x[key] for x in L))} | "
                         f"{fmt.format(med(x[key] for x in T))} | {r} |")
        w = c["work"]
        lines.append(f"| {name} | trained tokens per step (both) | {w['trained_tokens_per_step']} | | |")
        lines.append(f"| {name} | step-1 loss | {w['step1_loss']['llmtune']} | {w['step1_loss']['trl']} | |")
    print("\n".join(lines), flush=True)


def grpo_rows(name: str, c: dict) -> list[str]:
    """Table rows of a GRPO case; time ratios are TRL / llmtune (speed-up), the memory ratio llmtune / TRL."""
    med = statistics.median
    L, T, R = c["runs"]["llmtune"], c["runs"]["trl"], c["ratios"]
    rows = [("s per iteration", "s_per_iteration", "speed", "{:.2f}", "x"),
            ("sampling s per iteration", "generation_s", "generation", "{:.2f}", "x"),
            ("rest s per iteration", "rest_s", "rest", "{:.2f}", "x"),
            ("generation tokens/s", "generation_tokens_per_s", None, "{:.1f}", ""),
            ("peak memory GiB (CPU: RSS)", "peak_mem_gb", "peak_mem",
             "{:.2f}", "")]
    lines = []
    for label, key, ratio, fmt, unit in rows:
        r = ""
        if ratio:
            values = R[ratio]
            r = f"{med(values):.2f}{unit} ({min(values):.2f}-{max(values):.2f})"
        lines.append(f"| {name} | {label} | {fmt.format(med(x[key] for x in L))} | {fmt.format(med(x[key] for x in T))}"
                     f" | {r} |")
    w = c["work"]
    lines.append(f"| {name} | completion tokens per iteration (both) | {w['completion_tokens_per_step']} | | |")
    lines.append(f"| {name} | prompt tokens per iteration (both) | {w['prompt_tokens_per_step']} | | |")
    lines.append(f"| {name} | load average (1, 5, 15 min) at the end | {', '.join(f'{x:.1f}' for x in c['load_average'])} | | |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
