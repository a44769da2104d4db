"""On-policy preference pairs: sample k completions per prompt from a policy run, score them, pair them.

Used by the ``pairs`` step of ``llmtune pipeline`` (e.g. GSM8K: chosen = a completion with the right final answer,
or the reference solution when none is right; rejected = a wrong one); the pairs then feed ``rm``/``dpo``.

Files written into the step's directory:

* ``samples.jsonl``: one line per prompt after each batch: ``{index, prompt (messages), reference, completions (k),
  scores (k), ended (k: stopped at EOS), reference_score}``. Batch b is sampled with seed ``seed + its first prompt
  index`` from whole batches only, so an interrupted run continues after its last complete batch and gives the
  same pairs as an uninterrupted one.
* ``pairs.jsonl``: the pairs in the ``preference_messages`` format the data layer reads: ``{prompt: [messages],
  chosen: [{role: assistant, content}], rejected: [...], chosen_score, rejected_score, source, index}``.
* ``data_report.json`` (the prompts) and ``pairs_report.json`` (written last): prompts, completions, pairs (from
  completions / with the reference), and every prompt without a pair, counted by reason with its index.

Scores come from a reward function (``reward.function: module:function``, see :mod:`llmtune.rewards`) or a
finished ``llmtune rm`` run (``reward.from_run``), whose score is read at the last real token.
"""

from __future__ import annotations

import gc
import json
import time
from collections import Counter
from pathlib import Path
from typing import Callable

from pydantic import BaseModel, ConfigDict, Field

from llmtune.config import DataConfig, load_recipe
from llmtune.config.schema import RewardConfig
from llmtune.core import rundir as rd
from llmtune.utils import get_logger, write_json
from llmtune.errors import LlmtuneError

log = get_logger("pairs")

PAIRS_FILE, PAIRS_REPORT, SAMPLES = "pairs.jsonl", "pairs_report.json", "samples.jsonl"


class PairsError(LlmtuneError, RuntimeError):
    """No prompt gave a pair, or ``reward.from_run`` is not a reward model."""


class PairsConfig(BaseModel):
    """On-policy preference pairs: sample ``k`` completions per prompt from a policy, score them, pair them.

    chosen = the best-scored completion, rejected = the worst one, when their scores differ by more than
    ``min_score_gap``; otherwise (all tied, e.g. every GSM8K answer wrong) the reference answer is chosen if
    ``use_reference_as_chosen`` and it scores higher than the worst completion. Prompts without a pair are
    counted with their reason in ``pairs_report.json``.
    """

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), strict=True, allow_inf_nan=False)

    data: DataConfig = Field(default_factory=DataConfig, description="Prompts (any prompt-giving format; the "
                             "reference answer comes with them, e.g. builtin:gsm8k answers).")
    k: int = Field(4, ge=2, description="Completions sampled per prompt.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Scores: function (module:function) "
                                 "or from_run (an rm run, e.g. \"{rm}\" in a pipeline).")
    max_new_tokens: int = Field(192, ge=1, description="Longest completion in tokens.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling threshold (1 = off).")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    batch_size: int = Field(8, ge=1, description="Prompts per generate call (x k sequences).")
    use_reference_as_chosen: bool = Field(True, description="Chosen = the reference answer when no two "
                                          "completions differ in score.")
    min_score_gap: float = Field(0.0, ge=0, description="chosen score - rejected score must exceed this.")
    seed: int = Field(42, ge=0, le=2**32 - 1, description="Sampling seed (batch b uses seed + its first prompt "
                      "index), 0 .. 2**32-1.")


def choose_pair(scores: list[float], completions: list[str], reference: str | None, reference_score: float | None,
                use_reference: bool = True, min_gap: float = 0.0) -> dict | str:
    """Pick (chosen, rejected) among one prompt's k scored completions.

    chosen = the first best-scored completion and rejected = the first worst-scored one when
    ``best - worst > min_gap`` and their texts differ; else, when ``use_reference`` and the reference scores
    more than ``min_gap`` above the worst completion, chosen = the reference. Ties never make a pair.

    Args:
        scores: k scores, same order as ``completions``.
        completions: k completion texts.
        reference: the data's answer, or None.
        reference_score: its score (same reward), or None.

    Returns:
        ``{chosen, rejected, chosen_score, rejected_score, source}`` (source: ``completions`` or ``reference``),
        or the reason no pair exists (a short string, counted in the report).
    """
    best = max(range(len(scores)), key=lambda j: scores[j])
    worst = min(range(len(scores)), key=lambda j: scores[j])
    if scores[best] - scores[worst] > min_gap and completions[best] != completions[worst]:
        return {"chosen": completions[best], "rejected": completions[worst], "chosen_score": scores[best],
                "rejected_score": scores[worst], "source": "completions"}
    tied = "all completions scored alike" if scores[best] - scores[worst] <= min_gap else "best and worst identical"
    if not use_reference:
        return tied
    if reference is None or reference_score is None:
        return f"{tied}, no reference answer"
    if reference_score - scores[worst] <= min_gap or reference == completions[worst]:
        return f"{tied}, reference not better"
    return {"chosen": reference, "rejected": completions[worst], "chosen_score": reference_score,
            "rejected_score": scores[worst], "source": "reference"}


def read_samples(path: Path) -> list[dict]:
    """The complete lines of ``samples.jsonl`` (a line cut by a kill, and everything after it, is ignored)."""
    out = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def load_policy(run_dir: Path):
    """``(model, tokenizer)`` of a finished policy run: the base with its whole adapter chain merged, eval mode.

    Raises:
        ModelLoadError: the run is not finished or its base cannot be loaded.
    """
    from transformers import AutoTokenizer

    from llmtune.models import adapter_chain, load_model_with_chain
    from llmtune.models.lineage import read_run

    lineage, raw = read_run(run_dir)
    recipe = load_recipe(raw=raw)
    model = load_model_with_chain(recipe.model, recipe.precision, adapter_chain(run_dir, lineage))
    return model.eval(), AutoTokenizer.from_pretrained(run_dir / rd.ADAPTER)


def sample_completions(model, tokenizer, rows: list[dict], cfg: PairsConfig) -> tuple[list[str], list[bool]]:
    """Sample ``cfg.k`` completions for each of B prompt rows through the ``hf`` rollout engine
    (:class:`llmtune.rl.engines.hf.HFEngine`, the same engine online RL samples with; the one stop set of
    :func:`llmtune.data.templates.stop_token_ids`).

    Args:
        model: the policy (its adapter chain merged). rows: B prompt rows (``input_ids``).

    Returns:
        B x k texts, prompt-major (completion j of prompt b at ``b * k + j``), decoded without special tokens and
        stripped, and for each whether it stopped at a stop token (else it hit ``max_new_tokens``).
    """
    from llmtune.data.prompts import PromptCollator
    from llmtune.data.templates import stop_token_ids
    from llmtune.rl.engines import Policy
    from llmtune.rl.engines.hf import HFEngine
    from llmtune.rl.types import STOP, SamplingParams

    stop = stop_token_ids(tokenizer, model.generation_config)
    engine = HFEngine(Policy(model, None, lambda: 0, device=model.device), PromptCollator(tokenizer).pad_token_id)
    prompts = [[int(i) for i in row["input_ids"]] for row in rows for _ in range(cfg.k)]
    completions = engine.generate(prompts, SamplingParams(cfg.max_new_tokens, tuple(stop), cfg.temperature, cfg.top_p,
                                                          cfg.top_k))
    texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True).strip() for c in completions]
    return texts, [c.finish_reason == STOP for c in completions]


def _scorer(cfg: PairsConfig, base_dir: Path, source_dir: Path) -> Callable[[list[dict], list[str], list], list]:
    """``score(rows, texts, references) -> floats`` from the reward function or the reward-model run (one
    :mod:`llmtune.rewards.sources` source, the kind online RL uses)."""
    from llmtune.rewards.functions import RewardFunctionError
    from llmtune.rewards.sources import FunctionScorer, RewardModelScorer, Scored

    if cfg.reward.function:
        source = FunctionScorer(cfg.reward.function, recipe_dir=source_dir)
    else:
        source = RewardModelScorer(base_dir / cfg.reward.from_run, batch_size=cfg.reward.batch_size)

    def score(rows: list[dict], texts: list[str], refs: list) -> list[float]:
        values = source(Scored(rows, texts)).tolist()
        missing = [b for b, v in enumerate(values) if v != v]
        if missing:
            raise RewardFunctionError(f"the pairs step needs a score for every completion, but the reward function "
                                      f"abstained (returned None) on completion {missing[0]} ({len(missing)} of "
                                      f"{len(values)}): return a number there")
        return values

    return score


def build_pairs(cfg: PairsConfig, out: Path, policy_dir: Path, *, base_dir: Path = Path("."),
                source_dir: Path | None = None, report_extra: dict | None = None, progress=None) -> dict:
    """Sample, score and pair; continue after the complete batches already in ``out/samples.jsonl``.

    Args:
        cfg: what to sample and how to score.
        out: the step directory (must exist).
        policy_dir: a finished policy run (its adapter chain is merged into its base).
        base_dir: relative data paths and ``reward.from_run`` resolve against it.
        source_dir: directory of the recipe, for ``reward.function`` files next to it.
        report_extra: stored in ``pairs_report.json`` too (the pipeline's identity of this step).
        progress: ``callable(done_prompts, total_prompts)`` after each batch.

    Returns:
        The report written to ``pairs_report.json``.

    Raises:
        PairsError: no prompt gave a pair. DataError: bad prompt data. RewardFunctionError: a failing reward.
    """
    import torch

    from llmtune.data.prompts import build_prompt_data

    t0 = time.perf_counter()
    model, tokenizer = load_policy(policy_dir)
    data = build_prompt_data(cfg.data, tokenizer, base_dir=base_dir)
    data.report.save(out / rd.DATA_REPORT)
    prompts = data.train if data.eval is None else _concat(data.train, data.eval)
    score = _scorer(cfg, base_dir, source_dir or base_dir)
    done = read_samples(out / SAMPLES)
    done = done[: len(done) // cfg.batch_size * cfg.batch_size]  # whole batches only: same seeds on resume
    (out / SAMPLES).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in done))
    n, k = len(prompts), cfg.k
    if done:
        log.info("pairs: %d of %d prompts already sampled; continuing", len(done), n)
    for start in range(len(done), n, cfg.batch_size):
        rows = [prompts[j] for j in range(start, min(start + cfg.batch_size, n))]
        torch.manual_seed(cfg.seed + start)
        texts, ended = sample_completions(model, tokenizer, rows, cfg)
        refs = [r["reference"] for r in rows]
        with_ref = [b for b, ref in enumerate(refs) if ref is not None]  # references are scored after the B*k
        scores = score([r for r in rows for _ in range(k)] + [rows[b] for b in with_ref],
                       texts + [refs[b] for b in with_ref], [ref for ref in refs for _ in range(k)] +
                       [refs[b] for b in with_ref])
        ref_scores = dict(zip(with_ref, scores[len(texts):]))
        with open(out / SAMPLES, "a") as fh:
            for b, r in enumerate(rows):
                fh.write(json.dumps({
                    "index": start + b, "prompt": json.loads(r["messages"]), "reference": refs[b],
                    "completions": texts[b * k:(b + 1) * k], "scores": scores[b * k:(b + 1) * k],
                    "ended": ended[b * k:(b + 1) * k], "reference_score": ref_scores.get(b),
                }, ensure_ascii=False) + "\n")
        if progress is not None:
            progress(min(start + cfg.batch_size, n), n)
    del model, score
    gc.collect()
    return write_pairs(cfg, out, read_samples(out / SAMPLES), time.perf_counter() - t0, report_extra or {})


def _concat(a, b):
    import datasets

    return datasets.concatenate_datasets([a, b])


def write_pairs(cfg: PairsConfig, out: Path, samples: list[dict], wall_s: float, report_extra: dict) -> dict:
    """Pair every sampled prompt (:func:`choose_pair`); write ``pairs.jsonl``, then ``pairs_report.json``.

    Raises:
        PairsError: no prompt gave a pair (the report is written first).
    """
    pairs, reasons, no_pair = [], Counter(), []
    for rec in samples:
        pick = choose_pair(rec["scores"], rec["completions"], rec["reference"], rec["reference_score"],
                           cfg.use_reference_as_chosen, cfg.min_score_gap)
        if isinstance(pick, str):
            reasons[pick] += 1
            no_pair.append(rec["index"])
            continue
        pairs.append({"prompt": rec["prompt"], "chosen": [{"role": "assistant", "content": pick["chosen"]}],
                      "rejected": [{"role": "assistant", "content": pick["rejected"]}],
                      "chosen_score": pick["chosen_score"], "rejected_score": pick["rejected_score"],
                      "source": pick["source"], "index": rec["index"]})
    tmp = out / (PAIRS_FILE + ".tmp")
    tmp.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in pairs))
    tmp.replace(out / PAIRS_FILE)
    scores = [s for rec in samples for s in rec["scores"]]
    report = {
        **report_extra, "pairs_file": str(out / PAIRS_FILE), "format": "preference_messages",
        "prompts": len(samples), "completions": len(scores),
        "completions_without_eos": sum(not e for rec in samples for e in rec["ended"]),
        "mean_score": sum(scores) / len(scores) if scores else None,
        "pairs": len(pairs), "pairs_from_completions": sum(p["source"] == "completions" for p in pairs),
        "pairs_with_reference": sum(p["source"] == "reference" for p in pairs),
        "no_pair": dict(reasons), "no_pair_indices": no_pair, "wall_s": round(wall_s, 1),
    }
    write_json(out / PAIRS_REPORT, report)
    log.info("pairs: %d of %d prompts paired (%d with the reference answer); no pair: %s", len(pairs), len(samples),
             report["pairs_with_reference"], dict(reasons) or "none")
    if not pairs:
        raise PairsError(f"no preference pair from {len(samples)} prompts ({dict(reasons)}); see "
                         f"{out / PAIRS_REPORT}. Sample more (k, temperature) or set use_reference_as_chosen: true")
    return report
