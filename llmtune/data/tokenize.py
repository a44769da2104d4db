"""Tokenize canonical rows into ``input_ids`` + ``labels`` (-100 = not trained) with exact loss masks.

Chat rows (``train_on: assistant``): the conversation is rendered with the chat template; for each
assistant turn ``i``, ``messages[:i]`` is rendered with ``add_generation_prompt=True`` (ends where the
answer starts) and ``messages[:i+1]`` without (ends after the turn). Both must be prefixes of the full
rendering, else the row is dropped as "chat template is not prefix-consistent". The trained span is
``[len(prefix), len(prefix_through_turn))`` with trailing whitespace stripped, so the end-of-turn token
(ChatML ``<|im_end|>``, Llama ``</s>``) is trained and the newline after it is not. The rendered text is
split into alternating untrained/trained segments and **each segment is tokenized on its own**
(``add_special_tokens=False``) and the ids concatenated: the prompt tokens are exactly what inference
tokenizes, and span boundaries are exact even where BPE would merge across them in context (trl #598).
Labels come from segment positions, never from comparing ids (pad == EOS keeps the EOS label, trl #976).

BOS: if the tokenizer adds a BOS by itself and the rendered text does not start with the BOS text, one
BOS id is prepended (untrained); a template that renders its BOS never gets a second one (trl #1400).
Text rows: text + exactly one EOS, all trained (trl #1623). Prompt/completion rows: the raw prompt
(untrained) + completion + EOS (trained), no chat template.

Every kept row has at least one trained label at a position >= 1 (the label at position 0 is never
predicted by a causal LM); otherwise the row is dropped with a reason (LLaMA-Factory #3995).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from llmtune.data.errors import DataError, RowError

IGNORE_INDEX = -100
CHARS_PER_TOKEN_CAPS = (6, 24)  # texts longer than (tokens needed + margin) x this are cut before tokenizing
CUT_MARGIN_TOKENS = 256


@dataclass
class Tokenized:
    """One tokenized row: ``input_ids`` and ``labels`` of equal length (T,), ``labels`` -100 where not trained."""

    input_ids: list[int]
    labels: list[int]
    truncated: bool = False


def tokenizer_adds_bos(tokenizer) -> bool:
    """True when ``tokenizer(text)`` prepends the BOS id by itself (as Llama tokenizers do)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("x").input_ids
    return bool(ids) and ids[0] == bos


def bos_prefix(tokenizer, add_bos: bool, text: str) -> list[int]:
    """``[bos_id]`` when the tokenizer adds a BOS by itself and ``text`` does not start with the BOS text, else ``[]``.

    Texts are tokenized with ``add_special_tokens=False``, so this is the only place a BOS id is added:
    a row gets exactly one BOS when the tokenizer uses one, never two (trl #1400).
    """
    return [tokenizer.bos_token_id] if add_bos and not text.startswith(tokenizer.bos_token) else []


def encode_text(tokenizer, text: str, need: int | None = None) -> list[int]:
    """Token ids of ``text`` alone (``add_special_tokens=False``).

    With ``need``, only the first ``need`` ids are guaranteed (the list may stop early): a text far longer
    than needed is cut before tokenizing (at ``CHARS_PER_TOKEN_CAPS`` chars per token for ``need`` +
    ``CUT_MARGIN_TOKENS`` tokens); a cut changes only tokens near it, which lie beyond the margin. If a cut
    text yields too few tokens, a longer cut (finally the whole text) is tokenized.
    """
    if need is not None:
        for chars_per_token in CHARS_PER_TOKEN_CAPS:
            cap = (need + CUT_MARGIN_TOKENS) * chars_per_token
            if len(text) <= cap:
                break
            ids = tokenizer(text[:cap], add_special_tokens=False)["input_ids"]
            if len(ids) >= need + CUT_MARGIN_TOKENS:
                return ids[:need]
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    """``messages`` rendered as text with the tokenizer's chat template.

    Raises:
        RowError: the template fails on these messages (jinja errors, ``raise_exception()`` in templates).
    """
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja2 errors, raise_exception() in templates
        raise RowError("chat template error", f"chat template error: {type(exc).__name__}: {exc}") from None


def assistant_span(tokenizer, messages: list[dict], i: int) -> tuple[str, str]:
    """Where assistant turn ``i`` sits when rendered: ``(prefix, through)``.

    ``prefix`` renders ``messages[:i]`` with the generation prompt (it ends where the answer starts),
    ``through`` renders ``messages[:i+1]``. The trained text of the turn is
    ``through[len(prefix):len(through.rstrip())]``: the answer plus the template's end-of-turn (ChatML
    ``<|im_end|>``, Llama ``</s>``), without the whitespace after it.

    Raises:
        RowError: ``through`` does not start with ``prefix`` (template not prefix-consistent), or the
            template fails.
    """
    prefix = render_chat(tokenizer, messages[:i], generation_prompt=True)
    through = render_chat(tokenizer, messages[: i + 1])
    if not through.startswith(prefix):
        raise not_prefix_consistent(i)
    return prefix, through


def not_prefix_consistent(i: int) -> RowError:
    """The row error for a template that renders earlier turns differently once assistant turn ``i`` exists."""
    return RowError(
        "chat template is not prefix-consistent",
        f"chat template is not prefix-consistent at assistant turn {i}: rendering the turns before it "
        "(with the generation prompt) or through it is not a prefix of the whole conversation. Use a "
        "template that renders earlier turns identically (e.g. data.chat_template: chatml)",
    )


class SFTTokenizer:
    """Turn canonical rows into :class:`Tokenized` rows (picklable, so it can run in worker processes).

    Args:
        tokenizer: a Hugging Face (fast) tokenizer; its ``chat_template`` is used for chat rows.
        max_length: maximum tokens per row.
        truncation: ``truncate`` (keep the first ``max_length`` tokens) or ``drop``.
        train_on: ``assistant`` (assistant turns / completion / text) or ``all`` (every token).
    """

    result_type = Tokenized

    def __init__(self, tokenizer, max_length: int, truncation: str = "truncate", train_on: str = "assistant"):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation = truncation
        self.train_on = train_on
        self.add_bos = tokenizer_adds_bos(tokenizer)

    def __call__(self, row: dict) -> Tokenized:
        """Tokenize one canonical row.

        Raises:
            RowError: the row cannot be trained (template not prefix-consistent, no trained tokens, too long
                with ``truncation: drop``); ``err.bad`` tells malformed data from policy drops.
            DataError: the tokenizer lacks an EOS token for text / prompt-completion rows.
        """
        if "messages" in row:
            text = render_chat(self.tokenizer, row["messages"])
            pieces = self._chat_pieces(row["messages"], text)
            eos = []
        else:
            text, pieces = self._plain_pieces(row)
            eos = [self.tokenizer.eos_token_id]
        input_ids = bos_prefix(self.tokenizer, self.add_bos, text)
        labels = list(input_ids) if self.train_on == "all" else [IGNORE_INDEX] * len(input_ids)
        limit = self.max_length + 1  # enough tokens to know that a row is too long
        for piece, trained in pieces:
            if len(input_ids) >= limit:
                break  # the rest would be truncated away: do not render or tokenize it
            ids = encode_text(self.tokenizer, piece, limit - len(input_ids))
            input_ids += ids
            labels += ids if trained or self.train_on == "all" else [IGNORE_INDEX] * len(ids)
        input_ids += eos
        labels += eos
        return self._truncate(input_ids, labels)

    def _chat_pieces(self, messages: list[dict], full: str) -> Iterator[tuple[str, bool]]:
        """Yield the ``(text, trained)`` segments of the rendered conversation ``full`` in order (lazily)."""
        if self.train_on == "all":
            yield full, True
            return
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix, through = assistant_span(self.tokenizer, messages, i)
            start, end = len(prefix), len(through.rstrip())
            if not full.startswith(through) or start < cursor or end < start:
                raise not_prefix_consistent(i)
            if end == start:
                raise RowError("no trained tokens", f"assistant turn {i} renders no text")
            if start > cursor:
                yield full[cursor:start], False
            yield full[start:end], True
            cursor = end
        if cursor < len(full):
            yield full[cursor:], False

    def _plain_pieces(self, row: dict) -> tuple[str, list[tuple[str, bool]]]:
        eos = self.tokenizer.eos_token
        if eos is None or self.tokenizer.eos_token_id is None:
            raise DataError(
                "the tokenizer has no EOS token, needed to end text and prompt/completion rows; set its eos_token."
            )
        if "text" in row:
            text = row["text"].removesuffix(eos)
            return text, [(text, True)]
        completion = row["completion"].removesuffix(eos)
        pieces = [(row["prompt"], False), (completion, True)]
        return row["prompt"] + completion, [p for p in pieces if p[0]]

    def _truncate(self, input_ids: list[int], labels: list[int]) -> Tokenized:
        truncated = False
        if len(input_ids) > self.max_length:
            if self.truncation == "drop":
                raise RowError(
                    "longer than max_length",
                    f"more than data.max_length={self.max_length} tokens (data.truncation: drop)",
                    bad=False,
                )
            input_ids, labels, truncated = input_ids[: self.max_length], labels[: self.max_length], True
        if all(label == IGNORE_INDEX for label in labels[1:]):
            if truncated:
                raise RowError(
                    "no trained tokens after truncation",
                    f"no trained tokens in the first {self.max_length} tokens (data.max_length); raise max_length "
                    "or shorten the prompt",
                    bad=False,
                )
            raise RowError("no trained tokens", "the row has no trained tokens")
        return Tokenized(input_ids, labels, truncated)


def _map_batch(batch: dict, fn) -> dict:
    out: dict[str, list] = {"result": [], "kind": [], "reason": [], "bad": []}
    for row in batch["row"]:
        try:
            values = (json.dumps(asdict(fn(json.loads(row)))), "", "", False)
        except RowError as err:
            values = ("", err.kind, err.reason, err.bad)
        for key, value in zip(out, values):
            out[key].append(value)
    return out


PROGRESS_MIN_ROWS = 2000  # a progress bar (stderr) while tokenizing at least this many rows


def tokenize_rows(rows: list[dict], fn, num_proc: int | None = None) -> list:
    """Tokenize canonical rows; failures are returned (not raised) as :class:`RowError` in their place.

    Args:
        rows: canonical rows.
        fn: the row tokenizer (:class:`SFTTokenizer` or the preference pair tokenizer): a picklable callable
            returning a dataclass of type ``fn.result_type`` or raising :class:`RowError`.
        num_proc: worker processes (``datasets.map``); None or 1 tokenizes in this process.

    Returns:
        One ``fn.result_type`` or :class:`RowError` per row, in order.
    """
    if not num_proc or num_proc <= 1 or len(rows) < 2 * num_proc:
        from tqdm.auto import tqdm

        from llmtune.utils import is_main_process

        out: list = []
        quiet = len(rows) < PROGRESS_MIN_ROWS or not is_main_process()
        for row in tqdm(rows, desc="tokenizing", unit="row", leave=False, disable=quiet, mininterval=1.0):
            try:
                out.append(fn(row))
            except RowError as err:
                out.append(err)
        return out
    import datasets

    table = datasets.Dataset.from_dict({"row": [json.dumps(r) for r in rows]})
    mapped = table.map(
        _map_batch, batched=True, num_proc=num_proc, fn_kwargs={"fn": fn}, remove_columns=["row"],
        desc=f"tokenizing ({num_proc} processes)",
        keep_in_memory=True, load_from_cache_file=False, new_fingerprint=uuid.uuid4().hex,
    )
    return [
        RowError(r["kind"], r["reason"], bad=r["bad"]) if r["kind"] else fn.result_type(**json.loads(r["result"]))
        for r in mapped
    ]


def render_labels(input_ids, labels, tokenizer) -> str:
    """Decode a row with its trained tokens wrapped in ``«…»`` (for ``llmtune validate``).

    Args:
        input_ids: (T,) token ids (list or 1-D tensor; padding included is shown as untrained).
        labels: (T,) labels, -100 where not trained.
        tokenizer: the tokenizer that produced the ids.

    Returns:
        The decoded text, e.g. ``"<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n«Hello<|im_end|>»\\n"``.
    """
    ids = [int(i) for i in input_ids]
    labs = [int(label) for label in labels]
    out, run, run_trained = [], [], None
    for tok, label in zip(ids, labs):
        trained = label != IGNORE_INDEX
        if run and trained != run_trained:
            out.append(_decode_run(run, run_trained, tokenizer))
            run = []
        run.append(tok)
        run_trained = trained
    if run:
        out.append(_decode_run(run, run_trained, tokenizer))
    return "".join(out)


def _decode_run(ids: list[int], trained: bool, tokenizer) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    return f"«{text}»" if trained else text
