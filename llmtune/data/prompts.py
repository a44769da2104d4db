"""Prompt-only data for PPO: canonical prompt rows -> chat-template prompt ids, the prompt text and a reference.

Every format except ``text`` gives prompts (see :data:`llmtune.data.formats.PROMPT_ADAPTERS`): a conversation
loses its final assistant turn (which becomes the reference), alpaca ``instruction`` + ``input`` is the user
turn (``output`` the reference), ``prompt_completion`` / ``preference`` prompts are one user turn (completion /
chosen response the reference), HH transcripts end before their last ``Assistant:`` turn, a bare ``{prompt}``
column is a string or a message list, and ``builtin:gsm8k`` gives question -> prompt, answer -> reference.

Rendering (:func:`prompt_ids`): the prompt messages are rendered with the chat template and
``add_generation_prompt=True`` (the text ends where the answer starts, e.g. ChatML ``<|im_start|>assistant\\n``)
and tokenized exactly as SFT and preference pairs tokenize prompts (``add_special_tokens=False``, one BOS in
front when the tokenizer adds one by itself and the template does not render it): the ids equal
``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`` for templates that
render their own BOS or none.

Truncation, with ``P = data.max_prompt_length`` (default ``data.max_length``): a prompt longer than ``P``
tokens is cut to ``P`` so that it still ends with the whole generation prompt:

* ``keep_end``: the last ``P`` tokens (a leading BOS stays first and counts in ``P``; with
  ``data.truncation_keep_system`` the system message too), as preference pairs and SFT rows;
* ``keep_start``: the first ``P - g`` tokens followed by the ``g`` generation-prompt tokens.

Under ``data.truncation: drop`` such prompts are dropped instead. Both are counted in the
:class:`~llmtune.data.report.DataReport` (``truncated_rows`` / ``dropped``), never silent.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from llmtune.config.schema import DataConfig
from llmtune.data.cache import cached_build, write_dataset
from llmtune.data.collators import SFTCollator
from llmtune.data.errors import DataError, RowError
from llmtune.data.pipeline import batched, read_sources, reject_sft_options, tokenize_and_split
from llmtune.data.report import DataReport
from llmtune.data.templates import apply_chat_template_config
from llmtune.data.tokenize import (
    apply_cut,
    bos_prefix,
    encode_text,
    generation_prompt_length,
    prompt_cut,
    prompt_head,
    render_chat,
    tokenizer_adds_bos,
)

if TYPE_CHECKING:
    import datasets

PROMPT_COLUMNS = ["input_ids", "length", "index", "prompt", "messages", "reference"]
RAW_COLUMNS = "columns"  # the dataset row's own columns, pickled (build_prompt_data(keep_columns=True))
PROMPT_ROW_FIELDS = ("prompt", "messages", "reference", "index")  # what a prompt row says about its prompt
PROBE = [{"role": "user", "content": "Hi"}]


@dataclass
class TokenizedPrompt:
    """One tokenized prompt.

    Attributes:
        input_ids: (T,) prompt ids ending with the generation prompt.
        prompt: the text of the last user message (what a reward function sees).
        messages: JSON of the prompt conversation (``[{role, content}]``, system included).
        reference: the data's answer (dropped assistant turn, alpaca output, chosen response), or None.
        truncated: the ids were cut to ``max_prompt_length``. prompt_tokens_cut: how many tokens that cut removed.
        columns: the dataset row's own columns as read (``keep_columns``), else None.
    """

    input_ids: list[int]
    prompt: str
    messages: str
    reference: str | None
    truncated: bool = False
    prompt_tokens_cut: int = 0
    columns: dict | None = None


@dataclass
class PromptData:
    """Tokenized prompts for PPO.

    Attributes:
        train: ``datasets.Dataset`` with ``input_ids`` (list of ints, the rendered prompt ending with the
            generation prompt), ``length`` (= len(input_ids)), ``index`` (the row's position in this split),
            ``prompt`` (last user message), ``messages`` (JSON of the prompt conversation) and ``reference``
            (str, or None when the data has no answer); with ``keep_columns``, also ``columns`` (the dataset row's
            own columns, read with :func:`raw_columns`).
        eval: the same for the held-out prompts, or None when ``val_size == 0``.
        report: what was read, kept, dropped and truncated (``kind="prompt"``; ``tokens`` = prompt tokens,
            ``trained_tokens`` = 0: prompts carry no labels; ``max_length`` = the prompt limit used).
    """

    train: datasets.Dataset
    eval: datasets.Dataset | None
    report: DataReport


def prompt_ids(tokenizer, messages: list[dict], add_bos: bool | None = None, tools: list[dict] | None = None,
               generation_prompt: bool = True) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template and the generation prompt.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: ``[{role, content}]`` ending with a user turn (e.g. ``json.loads(row["messages"])``, to
            re-render a prompt for another tokenizer).
        add_bos: whether the tokenizer adds a BOS by itself (computed when None).
        tools: JSON schemas of the tools the template renders (multi-turn agent rollouts), or None.
        generation_prompt: end with the generation prompt (False: a whole conversation, for template checks).

    Returns:
        (T,) ids: the rendered text tokenized with ``add_special_tokens=False``, with one BOS in front when
        the tokenizer adds one by itself and the text does not start with it (as SFT and preference pairs).

    Raises:
        RowError: the template fails on these messages.
    """
    if add_bos is None:
        add_bos = tokenizer_adds_bos(tokenizer)
    text = render_chat(tokenizer, messages, generation_prompt=generation_prompt, tools=tools)
    return bos_prefix(tokenizer, add_bos, text) + encode_text(tokenizer, text)


class PromptTokenizer:
    """Turn canonical prompt rows ``{"prompt": messages, "reference"}`` into :class:`TokenizedPrompt`
    (picklable, so it can run in worker processes).

    Args:
        tokenizer: a Hugging Face (fast) tokenizer with a chat template.
        max_prompt_length: cut (or drop) prompts longer than this many tokens.
        truncation_mode: ``keep_end`` or ``keep_start`` (see the module docstring).
        truncation: ``truncate`` or ``drop``.
        keep_system: ``keep_end`` keeps the system message in front (``data.truncation_keep_system``).

    Raises:
        DataError: ``max_prompt_length`` leaves no prompt token beside the generation prompt (and BOS).
    """

    result_type = TokenizedPrompt

    def __init__(self, tokenizer, max_prompt_length: int, truncation_mode: str = "keep_end",
                 truncation: str = "truncate", keep_system: bool = False, tools: list[dict] | None = None):
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.truncation_mode = truncation_mode
        # a prompt with tools keeps its tools block or is dropped (counted): a cut one would hide the tools
        self.truncation = "drop" if tools else truncation
        self.keep_system = keep_system
        self.tools = tools or None
        self.add_bos = tokenizer_adds_bos(tokenizer)
        try:
            probe = prompt_ids(tokenizer, PROBE, self.add_bos, self.tools)
            reserved = generation_prompt_length(tokenizer, PROBE, self.tools) + self._bos_kept(probe)
        except RowError as err:
            raise DataError(f"the chat template cannot render a one-turn prompt: {err.reason}") from None
        if max_prompt_length <= reserved:
            raise DataError(
                f"data.max_prompt_length={max_prompt_length} leaves no prompt token: the generation prompt (and BOS) "
                f"take {reserved} tokens; raise data.max_prompt_length (default: data.max_length)."
            )

    def __call__(self, row: dict) -> TokenizedPrompt:
        """Tokenize one canonical prompt row.

        Raises:
            RowError: the template fails (bad row); the prompt is longer than ``max_prompt_length`` under
                ``truncation: drop``, or cannot be cut to it (policy drops, counted).
        """
        messages = row["prompt"]
        ids = prompt_ids(self.tokenizer, messages, self.add_bos, self.tools)
        P = self.max_prompt_length
        truncated, full = len(ids) > P, len(ids)
        if truncated:
            if self.truncation == "drop":
                why = "with tools, prompts are never cut" if self.tools else "data.truncation: drop"
                raise RowError(
                    "prompt longer than max_prompt_length",
                    f"the prompt has {len(ids)} tokens, more than data.max_prompt_length={P} ({why})",
                    bad=False,
                )
            ids = self._cut(ids, messages, P)
        return TokenizedPrompt(ids, messages[-1]["content"], json.dumps(messages, ensure_ascii=False),
                               row.get("reference"), truncated, full - len(ids), row.get(RAW_COLUMNS))

    def _bos_kept(self, ids: list[int]) -> int:
        bos = self.tokenizer.bos_token_id
        return int(bos is not None and bool(ids) and ids[0] == bos)

    def _cut(self, ids: list[int], messages: list[dict], n: int) -> list[int]:
        """``n`` ids that end with the whole generation prompt (see the module docstring)."""
        g = generation_prompt_length(self.tokenizer, messages)
        if self.truncation_mode == "keep_start":
            return apply_cut(ids, *prompt_cut(len(ids), n, "keep_start", tail=g))
        # exactly one BOS (and with keep_system the system message) in front, as preference prompts and SFT rows
        head = prompt_head(self.tokenizer, ids, messages, self.keep_system)
        a, b = prompt_cut(len(ids), n, "keep_end", head=head)
        if b < g:
            raise RowError("prompt cannot be cut", f"the prompt has {len(ids)} tokens and must be cut to {n}, but the "
                           f"kept system message leaves fewer than the {g} generation-prompt tokens; raise "
                           "data.max_prompt_length or set data.truncation_keep_system: false", bad=False)
        return apply_cut(ids, a, b)


def build_prompt_data(cfg: DataConfig, tokenizer, *, base_dir: str | Path = ".", tools: list[dict] | None = None,
                      keep_columns: bool = False) -> PromptData:
    """Read, validate, mix, tokenize and split the prompts of a recipe (PPO).

    Mixing (``weight``), ``max_samples`` (per source and total), ``val_size``, ``seed``, ``bad_rows`` and
    ``num_proc`` work as for SFT (:mod:`llmtune.data.pipeline`). Sets ``tokenizer.chat_template`` from
    ``cfg.chat_template`` (see :func:`apply_chat_template_config`): prompts are always rendered with a chat
    template and its generation prompt.

    Args:
        cfg: the recipe's ``data`` section; ``max_prompt_length`` (default ``max_length``) limits prompt tokens.
        tokenizer: a Hugging Face fast tokenizer.
        base_dir: directory that relative local paths are resolved against (usually the recipe's).
        tools: the JSON schemas of a multi-turn agent run's tools: the prompts are rendered with them (the template
            puts them in the system turn), and a prompt longer than ``max_prompt_length`` is dropped (counted), never
            cut (a cut could remove the tools).
        keep_columns: also keep each row's own columns as read from its source (every column, before any
            ``columns`` mapping), as the prompt rows' ``columns`` field (:func:`raw_columns`): what a multi-turn
            environment's ``reset`` receives. Tokenization and collation do not read them.

    Returns:
        :class:`PromptData` with train/eval ``datasets.Dataset`` and the :class:`DataReport`.

    Raises:
        DataError: packing or ``train_on: all`` requested; no chat template; a source cannot be read, is plain
            text (no prompt part) or holds no prompt format; bad rows under ``bad_rows: error`` (empty prompt,
            roles out of order, malformed rows; the first 10 listed with file, row index and reason);
            ``max_prompt_length`` too small for the generation prompt; ``val_size`` too large; no prompts left.
    """
    extra = {"tools": tools} if tools else {}  # part of the cache key
    if keep_columns:
        extra["keep_columns"] = True
    return cached_build("prompt", cfg, tokenizer, base_dir,
                        lambda: _build_prompt_data(cfg, tokenizer, base_dir=base_dir, tools=tools,
                                                   keep_columns=keep_columns), **extra)


def _build_prompt_data(cfg: DataConfig, tokenizer, *, base_dir: str | Path = ".", tools: list[dict] | None = None,
                       keep_columns: bool = False) -> PromptData:
    reject_sft_options(cfg, "prompts", "each prompt is generated from on its own", "they carry no labels")
    apply_chat_template_config(cfg, tokenizer)
    limit = cfg.max_prompt_length or cfg.max_length
    fn = PromptTokenizer(tokenizer, limit, cfg.truncation_mode, cfg.truncation, cfg.truncation_keep_system, tools)
    report = DataReport(max_length=limit, seed=cfg.seed, kind="prompt")
    pools = read_sources(cfg, base_dir, report, kind="prompt", keep_columns=keep_columns)
    train, evals = tokenize_and_split(cfg, pools, fn, report)
    report.train_sequences, report.eval_sequences = len(train), len(evals)
    report.tokens = sum(len(p.input_ids) for p in train)
    report.eval_tokens = sum(len(p.input_ids) for p in evals)
    return PromptData(train=_to_dataset(train, keep_columns),
                      eval=_to_dataset(evals, keep_columns) if len(evals) else None, report=report)


def _to_dataset(prompts: Iterable[TokenizedPrompt], keep_columns: bool = False):
    """The prompt dataset: ``index`` = the prompt's position in its split; with ``keep_columns``, ``columns`` = the
    row's own columns, pickled (their values keep their types: nothing is converted to fit an Arrow schema)."""
    import datasets

    features = {
        "input_ids": datasets.Sequence(datasets.Value("int64")), "length": datasets.Value("int64"),
        "index": datasets.Value("int64"), "prompt": datasets.Value("string"), "messages": datasets.Value("string"),
        "reference": datasets.Value("string"),
    }
    columns = PROMPT_COLUMNS
    if keep_columns:
        features[RAW_COLUMNS], columns = datasets.Value("binary"), [*PROMPT_COLUMNS, RAW_COLUMNS]
    def row(i: int, p: TokenizedPrompt) -> dict:
        out = {"input_ids": p.input_ids, "length": len(p.input_ids), "index": i, "prompt": p.prompt,
               "messages": p.messages, "reference": p.reference}
        if keep_columns:
            out[RAW_COLUMNS] = pickle.dumps(p.columns or {}, protocol=pickle.HIGHEST_PROTOCOL)
        return out

    rows = (row(i, p) for i, p in enumerate(prompts))
    return write_dataset(batched(rows, columns), datasets.Features(features))


def raw_columns(row: dict) -> dict:
    """The dataset row's own columns carried by a prompt row (``build_prompt_data(keep_columns=True)``), or ``{}``
    when the prompt data did not keep them."""
    data = row.get(RAW_COLUMNS)
    return pickle.loads(data) if data else {}  # written by _to_dataset into this run's own (private) data files


def shared_raw_columns(*splits) -> tuple[list[str], list[str]]:
    """``(every, some)``: the dataset columns every prompt row of these splits (None: skipped) carries, and those only
    some rows carry (:func:`raw_columns`; both empty when the data did not keep them), in first-seen order."""
    every: dict[str, None] | None = None
    seen: dict[str, None] = {}
    for split in splits:
        if split is None or RAW_COLUMNS not in split.column_names:
            continue
        for data in split[RAW_COLUMNS]:
            keys = list(pickle.loads(data)) if data else []
            seen.update(dict.fromkeys(keys))
            every = dict.fromkeys(keys) if every is None else {k: None for k in every if k in keys}
    every = every or {}
    return list(every), [k for k in seen if k not in every]


class PromptCollator:
    """Left-pad prompt ids into a batch for generation (the prompts end together where generation starts).

    Args:
        tokenizer: gives ``pad_token_id`` (falls back to ``eos_token_id``, then 0, as :class:`SFTCollator`;
            padded positions have ``attention_mask`` 0, so the value only needs to be a valid id).
        pad_to_multiple_of: round T up to a multiple of this; None = no rounding.
    """

    def __init__(self, tokenizer, pad_to_multiple_of: int | None = None):
        self.pad_token_id = SFTCollator(tokenizer).pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Collate prompt rows.

        Args:
            rows: B dicts with ``input_ids`` (T_i,) (list or 1-D tensor); optional ``index`` (int),
                ``prompt`` and ``reference`` (str or None) are passed through.

        Returns:
            ``input_ids`` (B, T) long, left-padded with the pad id; ``attention_mask`` (B, T) long, 1 on real
            tokens (row b's tokens sit at positions ``T - T_b .. T-1``); when every row has them, ``index``
            (B,) long and ``prompt`` / ``reference`` as lists of B strings (or None).

        Raises:
            ValueError: empty batch or a row without tokens.
        """
        if not rows:
            raise ValueError("PromptCollator got an empty batch")
        lengths = [len(r["input_ids"]) for r in rows]
        if min(lengths) == 0:
            raise ValueError(f"row {lengths.index(0)} of the batch has no input_ids")
        T = max(lengths)
        if self.pad_to_multiple_of:
            T = -(-T // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(rows), T), self.pad_token_id, dtype=torch.long)  # (B, T)
        attention_mask = torch.zeros((len(rows), T), dtype=torch.long)  # (B, T)
        for b, (row, n) in enumerate(zip(rows, lengths)):
            input_ids[b, T - n :] = torch.as_tensor(row["input_ids"], dtype=torch.long)
            attention_mask[b, T - n :] = 1
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        if all("index" in r for r in rows):
            batch["index"] = torch.as_tensor([int(r["index"]) for r in rows], dtype=torch.long)  # (B,)
        for key in ("prompt", "reference"):
            if all(key in r for r in rows):
                batch[key] = [r[key] for r in rows]
        return batch
