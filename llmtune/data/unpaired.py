"""Unpaired preference rows for KTO: a prompt, one completion and a desirable/undesirable label.

Canonical rows come from :mod:`llmtune.data.formats` with ``kind="unpaired"``: ``{"prompt": str | messages,
"completion": str, "label": bool}`` (format ``unpaired``), or preference pairs ``{"prompt", "chosen",
"rejected"}`` (formats preference, preference_messages, hh), each split into a desirable row (chosen) and an
undesirable row (rejected) that keep their pair's ``pair_index`` (held-out pairwise accuracy) and stay on the same
side of the train/eval split.

Tokenization is the pairs' (:class:`~llmtune.data.preference.PairTokenizer`: the prompt tokenized once, each
completion on its own, the same truncation and drop rules), so a KTO row is byte-for-byte the chosen (or rejected)
sequence DPO would train on. Rows: ``input_ids``, ``labels`` (-100 on the prompt), ``prompt_length`` (the first
trained position), ``label`` (1 desirable, 0 undesirable) and ``pair_index`` (-1 for unpaired rows).

The data report adds ``kto_balance``: desirable/undesirable row counts, the loss weights and the paper's guidance
for imbalanced data (Ethayarajh et al. 2024, Eq. 8: ``desirable_weight * n_D / (undesirable_weight * n_U)`` in
[1, 4/3]), with the weight ranges that would satisfy it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from llmtune.config.schema import DataConfig
from llmtune.data.cache import cached_build
from llmtune.data.collators import SFTCollator
from llmtune.data.errors import DataError, RowError
from llmtune.data.pipeline import read_sources, reject_sft_options, to_dataset, tokenize_and_split
from llmtune.data.preference import PairTokenizer, completion_labels
from llmtune.data.report import DataReport
from llmtune.data.templates import apply_chat_template_config
from llmtune.data.tokenize import IGNORE_INDEX
from llmtune.utils import get_logger

log = get_logger("data")

UNPAIRED_COLUMNS = ["input_ids", "labels", "prompt_length", "label", "pair_index", "kl_input_ids", "kl_labels"]
KL_SCAN = 16  # results looked ahead for a KL completion of another prompt
BALANCE_RANGE = (1.0, 4.0 / 3.0)  # Ethayarajh et al. 2024, Eq. 8


@dataclass
class TokenizedUnpaired:
    """One canonical row tokenized: the prompt ids, its completion(s) (two for a pair: chosen, rejected), their
    labels and ``tails`` (the last ids of each completion that are not trained: the template's text after the
    turn, see :func:`~llmtune.data.preference.render_turn`)."""

    prompt_ids: list[int]
    completions: list[list[int]]
    labels: list[bool]
    paired: bool
    truncated: bool = False
    tails: list[int] = field(default_factory=list)

    def completion_rows(self) -> list[tuple[list[int], list[int]]]:
        """``[(completion ids, completion labels)]``, one per completion."""
        tails = self.tails or [0] * len(self.completions)
        return [(c, completion_labels(c, tail)) for c, tail in zip(self.completions, tails)]

    def to_rows(self, pair_index: int, donor: TokenizedUnpaired, max_length: int, shift: int = 0) -> list[dict]:
        """Dataset rows (one per completion); ``pair_index`` is recorded for pairs only (else -1).

        ``kl_input_ids``/``kl_labels``: KTO's mismatched sequence of each row (its prompt + completion ``k + shift``
        of ``donor``, another row of the data; see :func:`kl_donors`), cut to ``max_length`` tokens, at least one
        completion token kept.
        """
        p, masked = self.prompt_ids, [IGNORE_INDEX] * len(self.prompt_ids)
        others = donor.completion_rows()
        rows = []
        for k, ((c, labels), y) in enumerate(zip(self.completion_rows(), self.labels)):
            kl_ids, kl_labels = others[(k + shift) % len(others)]
            room = max(max_length - len(p), 1)
            rows.append({"input_ids": p + c, "labels": masked + labels, "prompt_length": len(p), "label": int(y),
                         "pair_index": pair_index if self.paired else -1, "kl_input_ids": p + kl_ids[:room],
                         "kl_labels": masked + kl_labels[:room]})
        return rows


def kl_donors(results: Sequence[TokenizedUnpaired], fallback: Sequence[TokenizedUnpaired] | None = None
              ) -> Iterator[tuple[TokenizedUnpaired, TokenizedUnpaired, int]]:
    """For each result of a split, in order: ``(result, donor, shift)``, whose completions give KTO's mismatched
    prompt/completion pairs (Ethayarajh et al. 2024: the KL reference point from x_i with y_j, j != i).

    The donor is never the row itself: the next result of the split (cyclically, within :data:`KL_SCAN` results)
    whose prompt differs, else the next result; a split of one result takes it from ``fallback`` (the other split:
    an eval set of one row pairs with a train row); with no other row at all, a pair's two rows swap completions
    (``shift`` 1). Fixed when the data is built (as TRL's KL dataset), so train and eval batches of any size,
    micro-batch split or number of ranks see the same pairs.
    """
    n = len(results)
    head = [(j, r) for j, r in zip(range(min(n, KL_SCAN)), results)]  # for the wrap-around
    ahead: deque = deque()
    stream = iter(enumerate(results))
    for i in range(n):
        while len(ahead) < min(n - i, KL_SCAN + 1):
            ahead.append(next(stream))
        current = ahead[0][1]
        candidates = [r for _, r in list(ahead)[1:]] + [r for j, r in head if j < i and j + n > ahead[-1][0]]
        if not candidates and fallback is not None and len(fallback):
            candidates = [r for _, r in zip(range(KL_SCAN), fallback)]
        donor = next((r for r in candidates if r.prompt_ids != current.prompt_ids), candidates[0] if candidates
                     else None)
        yield (current, donor, 0) if donor is not None else (current, current, 1)
        ahead.popleft()


class UnpairedTokenizer:
    """Tokenize canonical unpaired rows and pairs with a :class:`PairTokenizer` (picklable).

    Raises (per row):
        RowError: as :meth:`PairTokenizer.__call__` (empty prompt or completion, too long under ``truncation:
            drop``, a prompt that fills ``max_length``).
    """

    result_type = TokenizedUnpaired

    def __init__(self, pairs: PairTokenizer):
        self.pairs = pairs

    def __call__(self, row: dict) -> TokenizedUnpaired:
        if "completion" not in row:  # a preference pair: chosen = desirable, rejected = undesirable
            pair = self.pairs(row)
            return TokenizedUnpaired(pair.prompt_ids, [pair.chosen_ids, pair.rejected_ids], [True, False], True,
                                     pair.truncated, [pair.chosen_tail, pair.rejected_tail])
        try:
            pair = self.pairs({"prompt": row["prompt"], "chosen": row["completion"], "rejected": row["completion"]})
        except RowError as err:  # the pair tokenizer speaks of "the chosen completion"
            raise RowError(err.kind, err.reason.replace("the chosen completion", "the completion"), bad=err.bad) from None
        return TokenizedUnpaired(pair.prompt_ids, [pair.chosen_ids], [bool(row["label"])], False, pair.truncated,
                                 [pair.chosen_tail])


@dataclass
class UnpairedReport(DataReport):
    """:class:`DataReport` of KTO data plus ``kto_balance`` (see :func:`kto_balance`)."""

    kto_balance: dict = field(default_factory=dict)

    def summary(self, examples: int = 3) -> str:
        b = self.kto_balance
        if not b:
            return super().summary(examples)
        verdict = "within" if b["in_range"] else "OUTSIDE"
        ratio = "n/a" if b["ratio"] is None else f"{b['ratio']:.3f}"
        line = (f"  KTO balance: {b['desirable']} desirable / {b['undesirable']} undesirable train rows; "
                f"desirable_weight x n_D / (undesirable_weight x n_U) = {ratio}, {verdict} the paper's [1, 4/3]")
        return super().summary(examples) + "\n" + line + ("" if b["in_range"] else f"\n  {b['advice']}")


def kto_balance(n_desirable: int, n_undesirable: int, desirable_weight: float, undesirable_weight: float) -> dict:
    """The paper's weighting guidance for imbalanced KTO data (Ethayarajh et al. 2024, Eq. 8).

    Args:
        n_desirable, n_undesirable: train rows (samples) of each label.
        desirable_weight, undesirable_weight: the loss weights lambda_D, lambda_U.

    Returns:
        ``{desirable, undesirable, desirable_weight, undesirable_weight, ratio, recommended_ratio, in_range,
        desirable_weight_range, undesirable_weight_range, advice}``: ``ratio = lambda_D n_D / (lambda_U n_U)``
        (None when there are no undesirable rows); the weight ranges give ``ratio`` in [1, 4/3] when only that
        weight is changed (None when a label has no rows).
    """
    lo, hi = BALANCE_RANGE
    d, u = n_desirable * desirable_weight, n_undesirable * undesirable_weight
    ratio = d / u if u else None
    in_range = ratio is not None and lo <= ratio <= hi + 1e-12
    des_range = [round(u * lo / n_desirable, 4), round(u * hi / n_desirable, 4)] if n_desirable and u else None
    und_range = [round(d / (hi * n_undesirable), 4), round(d / (lo * n_undesirable), 4)] if n_undesirable and d else None
    if not n_desirable or not n_undesirable:
        advice = (f"only {'undesirable' if not n_desirable else 'desirable'} rows: KTO needs both labels to learn "
                  "a preference (check the label column)")
    elif in_range:
        advice = "weights are within the paper's guidance"
    else:
        advice = (f"set EITHER kto.desirable_weight in {des_range} OR kto.undesirable_weight in {und_range} (not "
                  "both) to bring desirable_weight x n_D / (undesirable_weight x n_U) into [1, 4/3]")
    return {"desirable": n_desirable, "undesirable": n_undesirable, "desirable_weight": desirable_weight,
            "undesirable_weight": undesirable_weight, "ratio": ratio, "recommended_ratio": [lo, round(hi, 4)],
            "in_range": in_range, "desirable_weight_range": des_range, "undesirable_weight_range": und_range,
            "advice": advice}


@dataclass
class UnpairedData:
    """Tokenized KTO rows: ``train``/``eval`` ``datasets.Dataset`` with :data:`UNPAIRED_COLUMNS`, and the report."""

    train: Any
    eval: Any
    report: UnpairedReport


def build_unpaired_data(cfg: DataConfig, tokenizer, *, base_dir: str | Path = ".", desirable_weight: float = 1.0,
                        undesirable_weight: float = 1.0) -> UnpairedData:
    """Read, validate, mix, tokenize and split KTO data (unpaired rows and/or pairs) of a recipe.

    Mixing, ``max_samples``, ``val_size`` (counted in canonical rows: a pair is one row), truncation and bad rows
    work as for preference pairs (:func:`~llmtune.data.preference.build_preference_data`).

    Args:
        cfg: the recipe's ``data`` section. tokenizer: a Hugging Face fast tokenizer.
        base_dir: directory relative local paths are resolved against.
        desirable_weight, undesirable_weight: the recipe's KTO loss weights (for the balance report).

    Returns:
        :class:`UnpairedData`.

    Raises:
        DataError: as for preference pairs; bad unpaired rows (missing or non-boolean ``label``, no prompt,
            prompt and messages both given, a malformed completion) under ``bad_rows: error``, each with file, row
            index, field, what was expected and how to fix it.
    """
    weights = {"desirable_weight": desirable_weight, "undesirable_weight": undesirable_weight}
    return cached_build("unpaired", cfg, tokenizer, base_dir,
                        lambda: _build_unpaired_data(cfg, tokenizer, base_dir=base_dir, **weights), **weights)


def _build_unpaired_data(cfg: DataConfig, tokenizer, *, base_dir: str | Path = ".", desirable_weight: float = 1.0,
                        undesirable_weight: float = 1.0) -> UnpairedData:
    reject_sft_options(cfg, "KTO rows", "each row is one prompt + completion scored on its own",
                       "only completions are scored")
    if cfg.chat_template is not None:
        apply_chat_template_config(cfg, tokenizer)
    pairs = PairTokenizer(tokenizer, cfg.max_length, cfg.max_prompt_length, cfg.truncation_mode, cfg.truncation,
                          cfg.truncation_keep_system)
    report = UnpairedReport(max_length=cfg.max_length, seed=cfg.seed, kind="unpaired")
    pools = read_sources(cfg, base_dir, report, kind="unpaired")
    if not pairs.chat and any(not isinstance(row["prompt"], str) for pool in pools for row in pool.rows):
        apply_chat_template_config(cfg, tokenizer)  # raises: message prompts need a chat template
        pairs = PairTokenizer(tokenizer, cfg.max_length, cfg.max_prompt_length, cfg.truncation_mode, cfg.truncation,
                          cfg.truncation_keep_system)
    train_res, eval_res = tokenize_and_split(cfg, pools, UnpairedTokenizer(pairs), report)
    labels = {bool(y) for r in train_res for y in r.labels}
    if len(labels) < 2:
        missing = "undesirable" if True in labels else "desirable"
        per_file = "; ".join(f"data.datasets[{i}] {ds.path}: {_label_counts(pool)}"
                             for i, (ds, pool) in enumerate(zip(cfg.datasets, pools)))
        raise DataError(
            f"KTO data ({per_file}): the {len(train_res)} train row(s) are all "
            f"{'desirable' if True in labels else 'undesirable'}: "
            f"no {missing} (label {str(missing == 'desirable').lower()}) row, so KTO cannot learn a preference. Add "
            f"{missing} rows (check the label column and data.datasets[].columns.label), or use preference pairs "
            "(each gives one row of each label), or train on the rows with `llmtune sft` instead.")
    scalar = ("prompt_length", "label", "pair_index")
    train_counts, eval_counts = _Counts(cfg.max_length), _Counts(cfg.max_length)
    train = to_dataset(train_counts.rows(kl_donors(train_res, eval_res)), UNPAIRED_COLUMNS, scalar)
    evals = to_dataset(eval_counts.rows(kl_donors(eval_res, train_res)), UNPAIRED_COLUMNS, scalar) \
        if len(eval_res) else None
    report.train_sequences, report.tokens, report.trained_tokens = train_counts.summary()
    report.eval_sequences, report.eval_tokens, report.eval_trained_tokens = eval_counts.summary()
    report.kto_balance = kto_balance(train_counts.desirable, train_counts.rows_ - train_counts.desirable,
                                     desirable_weight, undesirable_weight)
    if not report.kto_balance["in_range"]:  # both labels are present here: the weights are outside [1, 4/3]
        log.warning("KTO data: %s", report.kto_balance["advice"])
    return UnpairedData(train, evals, report)


def _label_counts(pool) -> str:
    """``"3 desirable, 0 undesirable rows"`` of one source's canonical rows (a preference pair counts as one of each)."""
    good = bad = 0
    for row in pool.rows:
        if "label" in row:
            good, bad = good + bool(row["label"]), bad + (not row["label"])
        else:
            good, bad = good + 1, bad + 1
    return f"{good} desirable, {bad} undesirable rows"


class _Counts:
    """Rows, tokens, completion tokens and desirable rows of the dataset rows of a split, counted while written."""

    def __init__(self, max_length: int):
        self.max_length = max_length
        self.rows_ = self.tokens = self.trained = self.desirable = 0

    def rows(self, results: Iterable[tuple[TokenizedUnpaired, TokenizedUnpaired, int]]) -> Iterator[dict]:
        """The dataset rows of ``(result, KL donor, shift)`` (:func:`kl_donors`; ``pair_index`` = the result's
        position), counted."""
        for i, (r, donor, shift) in enumerate(results):
            for row in r.to_rows(i, donor, self.max_length, shift):
                self.rows_ += 1
                self.tokens += len(row["input_ids"])
                self.trained += sum(label != IGNORE_INDEX for label in row["labels"])
                self.desirable += row["label"]
                yield row

    def summary(self) -> tuple[int, int, int]:
        return self.rows_, self.tokens, self.trained


class UnpairedCollator:
    """Right-pad KTO rows into one batch (padding by position, as :class:`~llmtune.data.SFTCollator`).

    Returns:
        ``input_ids``, ``attention_mask``, ``labels`` (B, T) long (labels -100 on prompt and padding), and
        ``prompt_length``, ``label`` (1 desirable / 0 undesirable), ``pair_index`` (B,) long; with the rows' KL
        sequences, ``kl_input_ids``, ``kl_attention_mask``, ``kl_labels`` (B, T') long, padded the same way.
    """

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = None):
        self.pad = SFTCollator(tokenizer, pad_to_multiple_of)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = self.pad([{"input_ids": r["input_ids"], "labels": r["labels"]} for r in rows])
        if "kl_input_ids" in rows[0]:
            kl = self.pad([{"input_ids": r["kl_input_ids"], "labels": r["kl_labels"]} for r in rows])
            batch.update({f"kl_{k}": v for k, v in kl.items()})
        for key in ("prompt_length", "label", "pair_index"):
            batch[key] = torch.tensor([int(r[key]) for r in rows], dtype=torch.long)
        return batch
