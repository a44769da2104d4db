"""Preference pairs for reward modeling and DPO: canonical pairs -> prompt + chosen/rejected ids and labels.

A canonical pair is ``{"prompt": str | messages, "chosen": str, "rejected": str}`` (see
:mod:`llmtune.data.formats`: formats ``preference``, ``preference_messages``, ``hh``).

Tokenization (:class:`PairTokenizer`): the prompt is rendered and tokenized **once** and each completion
**on its own** (``add_special_tokens=False``), then the ids are concatenated, so ``chosen_input_ids`` and
``rejected_input_ids`` start with the identical prompt ids and the first trained position is exactly
``prompt_length`` (re-tokenizing prompt + completion as one text can merge tokens across the boundary
and shift it: trl #2054).

* With a chat template (the tokenizer's own or ``data.chat_template``) every stage (RM, DPO, ORPO, SimPO, KTO) sees
  one rendering (:func:`render_turn`): each side is the chat template's exact output for the conversation prompt +
  assistant answer, tokenized as ``tokenizer.apply_chat_template(conversation, tokenize=True)`` tokenizes it
  (the text after the end-of-turn token, e.g. ChatML's ``"\n"``, included; no BOS the template does not render).
  The shared prompt is the longest common prefix of both sides and the tokenized prompt (rendered with the
  generation prompt). The trained tokens follow the SFT span rule (:func:`~llmtune.data.tokenize.assistant_span`):
  the answer through its end-of-turn token (ChatML ``answer<|im_end|>``); the whitespace the template renders after
  it is in the sequence but not trained (labels -100), as it is never generated. A reward model reads its score at
  the last token, so consumers that score ``apply_chat_template`` output read the position it was trained at.
* Without a chat template (string prompts only): the raw prompt, then completion + EOS.
* BOS as in SFT: one BOS id in front when the tokenizer adds one by itself and the prompt does not start
  with the BOS text; never two.

Truncation, with ``L = data.max_length`` and ``P = data.max_prompt_length``:

1. a prompt longer than ``P`` is cut to ``P`` tokens (``P`` null: ``L - min(longest completion, L // 2)`` for a
   pair longer than ``L``, as SFT rows, so a long prompt never costs the pair), keeping its end
   (``truncation_mode: keep_end``; the BOS, if any, stays first, and with ``data.truncation_keep_system`` the
   system message) or its start (``keep_start``) (:func:`~llmtune.data.tokenize.prompt_cut`, shared with SFT
   rows and PPO prompts);
2. a completion longer than ``L - prompt`` is cut at its end, so prompt+chosen and prompt+rejected are
   both <= ``L`` and share the identical prompt;
3. so every kept pair has completion tokens (a pair reduced to padding gave NaN metrics: LLaMA-Factory #4402,
   trl #3382); a pair whose prompt cannot be cut (a kept system message that fills ``P``) is dropped and counted.

With ``data.truncation: drop`` every pair that would need a cut is dropped instead (counted).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from llmtune.config.schema import DataConfig
from llmtune.data.cache import cached_build
from llmtune.data.errors import DataError, RowError
from llmtune.data.pipeline import read_sources, reject_sft_options, to_dataset, tokenize_and_split
from llmtune.data.report import DataReport
from llmtune.data.templates import apply_chat_template_config
from llmtune.data.tokenize import (
    IGNORE_INDEX,
    apply_cut,
    bos_prefix,
    encode_text,
    not_prefix_consistent,
    prompt_cut,
    prompt_head,
    render_chat,
    render_labels,
    tokenizer_adds_bos,
)

if TYPE_CHECKING:
    import datasets

PAIR_COLUMNS = ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels", "prompt_length"]


@dataclass
class TokenizedPair:
    """One tokenized pair: the shared prompt ids and each completion's ids (already truncated)."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    truncated: bool = False
    prompt_tokens_cut: int = 0  # removed from the prompt
    response_tokens_cut: int = 0  # removed from the ends of chosen and rejected together
    chosen_tail: int = 0  # last ids of chosen_ids that are not trained (the template's text after the turn)
    rejected_tail: int = 0

    def to_row(self) -> dict:
        """The dataset row: ``{chosen,rejected}_{input_ids,labels}`` (prompt + completion) and ``prompt_length``."""
        p = self.prompt_ids
        masked = [IGNORE_INDEX] * len(p)
        return {
            "chosen_input_ids": p + self.chosen_ids, "chosen_labels": masked + completion_labels(self.chosen_ids,
                                                                                                self.chosen_tail),
            "rejected_input_ids": p + self.rejected_ids,
            "rejected_labels": masked + completion_labels(self.rejected_ids, self.rejected_tail),
            "prompt_length": len(p),
        }


def completion_labels(ids: list[int], tail: int) -> list[int]:
    """Labels of a completion: its ids, with the last ``tail`` (template text after the turn) set to -100."""
    return list(ids[: len(ids) - tail]) + [IGNORE_INDEX] * tail


@dataclass
class RenderedTurn:
    """One conversation (prompt + one assistant answer) as the chat template renders it, tokenized whole.

    Attributes:
        ids: ``apply_chat_template(conversation, tokenize=True)``'s ids (``add_special_tokens=False``).
        prompt_ids: the prompt rendered with the generation prompt, tokenized alone.
        tail: trailing ids of ``ids`` that lie entirely in the text after the answer's trained span (the
            whitespace after the end-of-turn token: ChatML ``"\n"``; 0 for Llama-2-style templates).
    """

    ids: list[int]
    prompt_ids: list[int]
    tail: int


def render_turn(tokenizer, messages: list[dict], content: str, prompt_text: str | None = None) -> RenderedTurn:
    """The one rendering of a prompt + assistant answer that every pair stage (RM, DPO, ORPO, SimPO, KTO) trains on.

    The text is ``render(messages + [assistant: content])`` exactly; the trained span is the SFT span rule's
    (:func:`~llmtune.data.tokenize.assistant_span`: from the generation prompt's end to the end of the turn without
    trailing whitespace). A token that straddles the end of the span is trained.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template. messages: the prompt conversation.
        content: the assistant answer. prompt_text: ``messages`` rendered with the generation prompt (computed
            when None).

    Raises:
        RowError: the template is not prefix-consistent (the prompt rendering is no prefix of the conversation's),
            or fails on these messages.
    """
    if prompt_text is None:
        prompt_text = render_chat(tokenizer, messages, generation_prompt=True)
    text = render_chat(tokenizer, [*messages, {"role": "assistant", "content": content}])
    if not text.startswith(prompt_text):
        raise not_prefix_consistent(len(messages))
    end = max(len(prompt_text), len(text.rstrip()))
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, tail = enc["input_ids"], sum(1 for start, _ in enc["offset_mapping"] if start >= end)
    else:  # slow tokenizers: the ids after the tokenized span, when the span's ids are a prefix of the whole
        ids, head = encode_text(tokenizer, text), encode_text(tokenizer, text[:end])
        tail = len(ids) - len(head) if ids[: len(head)] == head else 0
    return RenderedTurn(ids, encode_text(tokenizer, prompt_text), tail)


@dataclass
class PreferenceData:
    """Tokenized preference pairs.

    Attributes:
        train: ``datasets.Dataset`` with list-of-int columns ``chosen_input_ids``, ``chosen_labels``,
            ``rejected_input_ids``, ``rejected_labels`` (labels -100 on the prompt) and the int column
            ``prompt_length`` (the first trained position; both sequences start with the same prompt ids).
        eval: the same for the held-out pairs, or None when ``val_size == 0``.
        report: what was read, kept, dropped (with row indices and reasons) and truncated; its token counts
            cover chosen and rejected sequences, trained tokens = completion tokens.
    """

    train: datasets.Dataset
    eval: datasets.Dataset | None
    report: DataReport


def check_special_tokens(tokenizer) -> None:
    """Fail at set-up when the tokenizer lacks a token that pairs need (never ``None`` inside ids, trl #1073).

    Raises:
        DataError: no EOS token (it ends every completion), or a chat template that renders ``bos_token``
            while the tokenizer has none.
    """
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    if tokenizer.eos_token is None or tokenizer.eos_token_id is None:
        raise DataError(
            f"the tokenizer {name!r} has no EOS token (eos_token is None), which ends every chosen/rejected "
            "completion; set eos_token in its tokenizer_config.json (or special_tokens_map.json)."
        )
    template = getattr(tokenizer, "chat_template", None)
    if template and "bos_token" in str(template) and (tokenizer.bos_token is None or tokenizer.bos_token_id is None):
        raise DataError(
            f"the chat template of {name!r} renders bos_token, but the tokenizer has no BOS token (bos_token is None); "
            "set bos_token in its tokenizer_config.json or use a template without it (data.chat_template)."
        )


class PairTokenizer:
    """Turn canonical pairs into :class:`TokenizedPair` (picklable, so it can run in worker processes).

    Args:
        tokenizer: a Hugging Face (fast) tokenizer; its ``chat_template`` (if any) renders prompts and turns.
        max_length: maximum tokens of prompt + completion, for each of chosen and rejected.
        max_prompt_length: cut prompts to this many tokens (None: prompts are not cut).
        truncation_mode: ``keep_end`` or ``keep_start``: the end of a cut prompt that is kept.
        truncation: ``truncate`` (cut as described in the module docstring) or ``drop`` (drop pairs that need a cut).
        keep_system: ``keep_end`` keeps the system message in front (``data.truncation_keep_system``).

    Raises:
        DataError: see :func:`check_special_tokens`; ``max_prompt_length >= max_length``.
    """

    result_type = TokenizedPair

    def __init__(self, tokenizer, max_length: int, max_prompt_length: int | None = None,
                 truncation_mode: str = "keep_end", truncation: str = "truncate", keep_system: bool = False):
        check_special_tokens(tokenizer)
        if max_prompt_length is not None and max_prompt_length >= max_length:
            raise DataError(
                f"data.max_prompt_length={max_prompt_length} must be below data.max_length={max_length} so that at "
                "least one completion token fits; lower max_prompt_length or raise max_length."
            )
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.max_prompt_length = max_prompt_length
        self.truncation_mode = truncation_mode
        self.truncation = truncation
        self.keep_system = keep_system
        self.add_bos = tokenizer_adds_bos(tokenizer)
        self.chat = bool(getattr(tokenizer, "chat_template", None))

    def __call__(self, row: dict) -> TokenizedPair:
        """Tokenize one canonical pair.

        Raises:
            RowError: template not prefix-consistent, empty prompt or completion (bad rows); too long under
                ``truncation: drop``, or a prompt that leaves no completion token (policy drops).
        """
        prompt = row["prompt"]
        if self.chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            prompt_text = render_chat(self.tokenizer, messages, generation_prompt=True)
            return self._fit(*self._template_ids(messages, prompt_text, row))
        if not isinstance(prompt, str):  # build_preference_data sets a template first; direct callers may not
            raise DataError("this pair's prompt is a list of messages but the tokenizer has no chat template; "
                            "set data.chat_template.")
        completions = [row[k].removesuffix(self.tokenizer.eos_token) for k in ("chosen", "rejected")]
        prompt_ids = bos_prefix(self.tokenizer, self.add_bos, prompt) + encode_text(self.tokenizer, prompt)
        need = self.max_length + 1  # enough to know that a completion is too long
        chosen, rejected = (self._encode_completion(c, need) + [self.tokenizer.eos_token_id] for c in completions)
        return self._fit(prompt_ids, chosen, rejected)

    def _encode_completion(self, text: str, need: int) -> list[int]:
        """Completion ids; a long one is tokenized whole so that the report counts exactly what a cut removes."""
        ids = encode_text(self.tokenizer, text, need)
        return encode_text(self.tokenizer, text) if len(ids) >= need else ids

    def _template_ids(self, messages: list[dict], prompt_text: str, row: dict) -> tuple:
        """``(shared prompt ids, chosen ids, rejected ids, messages, chosen tail, rejected tail)``: the
        concatenations are the template's exact output (:func:`render_turn`) for prompt + each completion."""
        sides = [render_turn(self.tokenizer, messages, row[key], prompt_text) for key in ("chosen", "rejected")]
        prompt = sides[0].prompt_ids
        k = next((i for i, ids in enumerate(zip(prompt, sides[0].ids, sides[1].ids)) if len(set(ids)) > 1),
                 min(len(prompt), len(sides[0].ids), len(sides[1].ids)))
        chosen, rejected = sides[0].ids[k:], sides[1].ids[k:]
        return (sides[0].ids[:k], chosen, rejected, messages, min(sides[0].tail, len(chosen)),
                min(sides[1].tail, len(rejected)))

    def _fit(self, prompt: list[int], chosen: list[int], rejected: list[int], messages=None, chosen_tail: int = 0,
             rejected_tail: int = 0) -> TokenizedPair:
        if not prompt:
            raise RowError("empty prompt", "the prompt has no tokens, so no completion token can be predicted")
        if len(chosen) <= chosen_tail or len(rejected) <= rejected_tail:
            which = "chosen" if len(chosen) <= chosen_tail else "rejected"
            raise RowError("no completion tokens", f"the {which} completion renders no tokens")
        L, P = self.max_length, self.max_prompt_length
        longest = max(len(chosen), len(rejected))
        if P is None and len(prompt) + longest > L:  # as SFT rows: completions keep all their tokens or L // 2
            P = L - min(longest, L // 2)
        cut_prompt = P is not None and len(prompt) > P
        if self.truncation == "drop" and (cut_prompt or len(prompt) + longest > L):
            raise RowError(
                "longer than max_length",
                f"prompt + completion longer than data.max_length={L} tokens"
                + (f" or prompt longer than data.max_prompt_length={P}" if self.max_prompt_length else "")
                + " (data.truncation: drop)",
                bad=False,
            )
        full = len(prompt)
        if cut_prompt:
            prompt = self._cut_prompt(prompt, P, messages)
        room = L - len(prompt)
        if room < 1:
            raise RowError(
                "prompt fills max_length",
                f"the prompt has {len(prompt)} tokens, leaving no completion token within data.max_length={L}; set "
                "data.max_prompt_length below max_length (prompts are then cut) or raise max_length",
                bad=False,
            )
        truncated = cut_prompt or len(chosen) > room or len(rejected) > room
        cut = max(0, len(chosen) - room) + max(0, len(rejected) - room)
        tails = [max(0, tail - max(0, len(ids) - room)) for ids, tail in ((chosen, chosen_tail),
                                                                           (rejected, rejected_tail))]
        return TokenizedPair(prompt, chosen[:room], rejected[:room], truncated, full - len(prompt), cut, *tails)

    def _cut_prompt(self, prompt: list[int], n: int, messages: list[dict] | None) -> list[int]:
        if self.truncation_mode == "keep_start":
            return prompt[:n]
        head = prompt_head(self.tokenizer, prompt, messages, self.keep_system)  # exactly one BOS in front
        return apply_cut(prompt, *prompt_cut(len(prompt), n, "keep_end", head=head))


def build_preference_data(cfg: DataConfig, tokenizer, *, base_dir: str | Path = ".") -> PreferenceData:
    """Read, validate, mix, tokenize and split the preference pairs of a recipe.

    Mixing (``weight``), ``max_samples`` (per source and total), ``val_size`` and ``seed`` work as for SFT
    (:mod:`llmtune.data.pipeline`). Sets ``tokenizer.chat_template`` from ``cfg.chat_template`` when that is
    set or some prompt is a list of messages (see :func:`apply_chat_template_config`).

    Args:
        cfg: the recipe's ``data`` section.
        tokenizer: a Hugging Face fast tokenizer.
        base_dir: directory that relative local paths are resolved against (usually the recipe's).

    Returns:
        :class:`PreferenceData` with train/eval ``datasets.Dataset`` and the :class:`DataReport`.

    Raises:
        DataError: packing or ``train_on: all`` requested; a source cannot be read or holds no preference
            format; bad rows under ``bad_rows: error`` (prompt mismatch, chosen == rejected, malformed rows; the
            first 10 listed with file, row index and reason); no chat template for message prompts; the
            tokenizer lacks EOS (or BOS its template renders); ``max_prompt_length >= max_length``;
            ``val_size`` too large; no pairs left.
    """
    return cached_build("preference", cfg, tokenizer, base_dir,
                        lambda: _build_preference_data(cfg, tokenizer, base_dir=base_dir))


def _build_preference_data(cfg: DataConfig, tokenizer, *, base_dir: str | Path = ".") -> PreferenceData:
    reject_sft_options(cfg, "preference pairs", "each pair is one chosen and one rejected sequence",
                       "only completions are scored")
    if cfg.chat_template is not None:
        apply_chat_template_config(cfg, tokenizer)
    # Set-up errors (missing EOS/BOS, max_prompt_length) come before any data is read.
    fn = PairTokenizer(tokenizer, cfg.max_length, cfg.max_prompt_length, cfg.truncation_mode, cfg.truncation,
                       cfg.truncation_keep_system)
    report = DataReport(max_length=cfg.max_length, seed=cfg.seed, kind="preference")
    pools = read_sources(cfg, base_dir, report, kind="preference")
    if not fn.chat and any(not isinstance(row["prompt"], str) for pool in pools for row in pool.rows):
        apply_chat_template_config(cfg, tokenizer)  # raises: message prompts need a chat template
    train_pairs, eval_pairs = tokenize_and_split(cfg, pools, fn, report)
    report.train_sequences, report.eval_sequences = len(train_pairs), len(eval_pairs)
    report.tokens, report.trained_tokens = _count_tokens(train_pairs)
    report.eval_tokens, report.eval_trained_tokens = _count_tokens(eval_pairs)
    return PreferenceData(
        train=to_dataset((p.to_row() for p in train_pairs), PAIR_COLUMNS, scalar=("prompt_length",)),
        eval=to_dataset((p.to_row() for p in eval_pairs), PAIR_COLUMNS, scalar=("prompt_length",))
        if len(eval_pairs) else None,
        report=report,
    )


def _count_tokens(pairs: Iterable[TokenizedPair]) -> tuple[int, int]:
    """(tokens of all chosen and rejected sequences, their trained completion tokens)."""
    completion = untrained = 0
    for p in pairs:
        completion += len(p.chosen_ids) + len(p.rejected_ids) - p.chosen_tail - p.rejected_tail
        untrained += 2 * len(p.prompt_ids) + p.chosen_tail + p.rejected_tail
    return completion + untrained, completion


def render_pair(row: dict, tokenizer) -> str:
    """Decode a pair for ``llmtune validate``: the prompt, then each completion with trained tokens in ``«…»``.

    Args:
        row: a dataset row (``chosen_input_ids``, ``chosen_labels``, ``rejected_input_ids``,
            ``rejected_labels``, ``prompt_length``).
        tokenizer: the tokenizer that produced the ids.

    Returns:
        E.g. ``"<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n\\n[chosen]   «Hello<|im_end|>»\\n"
        "[rejected] «Go away<|im_end|>»"``.
    """
    p = int(row["prompt_length"])
    prompt = tokenizer.decode([int(i) for i in row["chosen_input_ids"][:p]], skip_special_tokens=False,
                              clean_up_tokenization_spaces=False)
    chosen = render_labels(row["chosen_input_ids"][p:], row["chosen_labels"][p:], tokenizer)
    rejected = render_labels(row["rejected_input_ids"][p:], row["rejected_labels"][p:], tokenizer)
    return f"{prompt}\n[chosen]   {chosen}\n[rejected] {rejected}"
