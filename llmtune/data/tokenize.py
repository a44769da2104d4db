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

Tool conversations (:mod:`llmtune.data.toolchat`): every render gets the row's ``tools`` (JSON schemas; the template
puts them in the system turn), an assistant turn with ``tool_calls`` is trained as the template renders it (its text
and its tool-call markup, e.g. ``<tool_call>{...}</tool_call>``, through its end-of-turn token), and the tool
results, the tools block and the template's text around them are not: they are outside every assistant span. A row
with tools longer than ``max_length`` is dropped (counted), never cut: a cut would remove the tools block.

BOS: if the tokenizer adds a BOS by itself and the rendered text does not start with the BOS text, one
BOS id is prepended (untrained); a template that renders its BOS never gets a second one (trl #1400).
Text rows: text + exactly one EOS, all trained (trl #1623). Prompt/completion rows: the raw prompt
(untrained) + completion + EOS (trained), no chat template.

Every kept row has at least one trained label at a position >= 1 (the label at position 0 is never
predicted by a causal LM); otherwise the row is dropped with a reason (LLaMA-Factory #3995).

Truncation keeps the response: an over-long row's context (before its last trained span) is cut first, from the
left by default, then the response at its end (:class:`SFTTokenizer`); :func:`prompt_head`, :func:`prompt_cut` and
:func:`apply_cut` are the one cut that SFT rows, preference-pair prompts and PPO prompts share
(``data.max_prompt_length``, ``truncation_mode``, ``truncation_keep_system``). Cut tokens are counted per row.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from llmtune.data.errors import DataError, RowError

IGNORE_INDEX = -100
CHARS_PER_TOKEN_CAPS = (6, 24)  # texts longer than (tokens needed + margin) x this are cut before tokenizing
CUT_MARGIN_TOKENS = 256


@dataclass
class Tokenized:
    """One tokenized row: ``input_ids`` and ``labels`` of equal length (T,), ``labels`` -100 where not trained.

    ``prompt_tokens_cut`` / ``response_tokens_cut``: tokens removed from the context (before the last trained span)
    and from the response (the last trained span and what follows it) when the row was longer than max_length.
    """

    input_ids: list[int]
    labels: list[int]
    truncated: bool = False
    prompt_tokens_cut: int = 0
    response_tokens_cut: int = 0


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


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool = False, tools: list[dict] | None = None
                ) -> str:
    """``messages`` rendered as text with the tokenizer's chat template (with ``tools``: their JSON schemas, as
    multi-turn agent rollouts render prompts).

    Raises:
        RowError: the template fails on these messages (jinja errors, ``raise_exception()`` in templates).
    """
    try:
        if tools:
            return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                 add_generation_prompt=generation_prompt)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as exc:  # jinja2 errors, raise_exception() in templates
        raise RowError("chat template error", f"chat template error: {type(exc).__name__}: {exc}") from None


def assistant_span(tokenizer, messages: list[dict], i: int, tools: list[dict] | None = None) -> tuple[str, str]:
    """Where assistant turn ``i`` sits when rendered: ``(prefix, through)``.

    ``prefix`` renders ``messages[:i]`` with the generation prompt (it ends where the answer starts),
    ``through`` renders ``messages[:i+1]``. The trained text of the turn is
    ``through[len(prefix):len(through.rstrip())]``: the answer plus the template's end-of-turn (ChatML
    ``<|im_end|>``, Llama ``</s>``), without the whitespace after it. For a turn with ``tool_calls`` that is its
    text and its calls as the template renders them (``chatml_tools``: ``<tool_call>`` blocks); tool results are
    never inside a span (they are turns of their own). ``tools`` (the row's JSON schemas) is passed to every render.

    Raises:
        RowError: ``through`` does not start with ``prefix`` (template not prefix-consistent), or the
            template fails.
    """
    prefix = render_chat(tokenizer, messages[:i], generation_prompt=True, tools=tools)
    through = render_chat(tokenizer, messages[: i + 1], tools=tools)
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


def generation_prompt_length(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> int:
    """Number of trailing tokens that the generation prompt adds to ``messages`` rendered (0 if it adds no text).

    A token that straddles the end of the conversation and the start of the generation prompt counts as
    generation prompt (fast tokenizers: by character offsets; slow ones: by tokenizing the generation prompt
    alone). The generation prompt starts where the renderings with and without it first differ.
    """
    with_gen = render_chat(tokenizer, messages, generation_prompt=True, tools=tools)
    without = render_chat(tokenizer, messages, tools=tools)
    start = next((i for i, (a, b) in enumerate(zip(with_gen, without)) if a != b), min(len(with_gen), len(without)))
    if start == len(with_gen):
        return 0
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(with_gen, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return sum(1 for _, end in offsets if end > start)
    return len(encode_text(tokenizer, with_gen[start:]))


def prompt_head(tokenizer, ids: list[int], messages: list[dict] | None, keep_system: bool) -> int:
    """Leading tokens of prompt ``ids`` that a ``keep_end`` cut keeps: the BOS (when ``ids`` start with it) and, with
    ``keep_system``, the system message (``data.truncation_keep_system``) as the template renders it on its own.

    Args:
        ids: (T,) prompt ids (rendered ``messages``, tokenized as the row tokenizers do).
        messages: the prompt conversation, or None for a raw-text prompt (no system message).

    Raises:
        RowError: (policy drop) ``keep_system`` but the template does not render the system message as a prefix of
            the conversation on its own tokens (e.g. llama2 folds it into the first user turn).
    """
    bos = tokenizer.bos_token_id
    head = int(bos is not None and bool(ids) and ids[0] == bos)
    if not (keep_system and messages and messages[0]["role"] == "system"):
        return head
    problem = RowError(
        "system message cannot be kept",
        "data.truncation_keep_system: the chat template does not render the system message on its own in front of "
        "the conversation, so it cannot be kept when the prompt is cut; set data.truncation_keep_system: false",
        bad=False,
    )
    try:
        text = render_chat(tokenizer, messages[:1])
    except RowError:
        raise problem from None
    sys_ids = encode_text(tokenizer, text)
    start = 0 if sys_ids[:1] == [bos] else head  # a template that renders the BOS itself
    if not text.strip() or messages[0]["content"].strip() not in text or ids[start : start + len(sys_ids)] != sys_ids:
        raise problem
    return start + len(sys_ids)


def prompt_cut(length: int, n: int, mode: str, head: int = 0, tail: int = 0) -> tuple[int, int]:
    """Where a prompt of ``length`` tokens is cut to ``n`` tokens: keep its first ``a`` and its last ``b`` (a + b = n).

    ``keep_end`` keeps the ``head`` first tokens (:func:`prompt_head`: BOS, system message) and the last
    ``n - head``; ``keep_start`` keeps the first ``n - tail`` and the ``tail`` last (the generation prompt, so the
    response still follows the assistant header). Apply with :func:`apply_cut`.

    Raises:
        RowError: (policy drop) the kept head or tail alone takes ``n`` tokens or more.
    """
    keep = head if mode == "keep_end" else tail
    if keep >= n:
        what = "the BOS and system message" if mode == "keep_end" else "the generation prompt"
        raise RowError("prompt cannot be cut", f"the prompt has {length} tokens and must be cut to {n}, but {what} "
                       f"alone take {keep} (truncation_mode: {mode}); raise data.max_prompt_length / max_length",
                       bad=False)
    return (head, n - head) if mode == "keep_end" else (n - tail, tail)


def apply_cut(seq: list, a: int, b: int) -> list:
    """``seq`` without its middle: the first ``a`` and the last ``b`` items."""
    return seq[:a] + seq[len(seq) - b :] if b else seq[:a]


class SFTTokenizer:
    """Turn canonical rows into :class:`Tokenized` rows (picklable, so it can run in worker processes).

    Truncation of a row longer than ``max_length`` (L) under ``truncation: truncate``: the row splits into its
    context (everything before the last trained span: system, earlier turns, the last user turn and the generation
    prompt; a ``prompt_completion`` prompt) and its response (the last assistant turn / the completion, with what
    follows it). The context is cut to at most P tokens, P = ``max_prompt_length``, or when that is None
    ``L - min(response tokens, L // 2)`` (the response keeps all its tokens or at least half of L), keeping its end
    (``truncation_mode: keep_end``: the oldest tokens go first; the BOS and, with ``keep_system``, the system
    message stay in front) or its start (``keep_start``: the generation prompt stays at its end); then the response
    is cut at its end to fit L. Tokens of earlier assistant turns that stay keep their labels. Rows with nothing
    before their trained text (``text`` rows) and ``train_on: all`` rows keep their first L tokens. Rows with a
    ``tools`` column are never cut (dropped when longer than L).

    Args:
        tokenizer: a Hugging Face (fast) tokenizer; its ``chat_template`` is used for chat rows.
        max_length: maximum tokens per row (L).
        truncation: ``truncate`` (as above) or ``drop``.
        train_on: ``assistant`` (assistant turns / completion / text) or ``all`` (every token).
        max_prompt_length: P, at most this many context tokens in a cut row (None: see above).
        truncation_mode: ``keep_end`` or ``keep_start``: which end of a cut context is kept.
        keep_system: ``keep_end`` keeps the system message in front (``data.truncation_keep_system``).

    Raises:
        DataError: ``max_prompt_length >= max_length``.
    """

    result_type = Tokenized

    def __init__(self, tokenizer, max_length: int, truncation: str = "truncate", train_on: str = "assistant",
                 max_prompt_length: int | None = None, truncation_mode: str = "keep_end", keep_system: bool = False):
        if max_prompt_length is not None and max_prompt_length >= max_length:
            raise DataError(
                f"data.max_prompt_length={max_prompt_length} must be below data.max_length={max_length} so that at "
                "least one response token fits; lower max_prompt_length or raise max_length."
            )
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation = truncation
        self.train_on = train_on
        self.max_prompt_length = max_prompt_length
        self.truncation_mode = truncation_mode
        self.keep_system = keep_system
        self.add_bos = tokenizer_adds_bos(tokenizer)

    def __call__(self, row: dict) -> Tokenized:
        """Tokenize one canonical row.

        Raises:
            RowError: the row cannot be trained (template not prefix-consistent, no trained tokens, too long
                with ``truncation: drop`` or with tools, a context that cannot be cut); ``err.bad`` tells malformed
                data from policy drops.
            DataError: the tokenizer lacks an EOS token for text / prompt-completion rows.
        """
        messages, tools = row.get("messages"), row.get("tools")
        if messages is not None:
            text = render_chat(self.tokenizer, messages, tools=tools)
            plain = None
            eos = []
        else:
            text, plain = self._plain_pieces(row)
            eos = [self.tokenizer.eos_token_id]

        def pieces():
            return self._chat_pieces(messages, text, tools) if plain is None else iter(plain)

        bos = bos_prefix(self.tokenizer, self.add_bos, text)
        input_ids, labels, _ = self._encode(bos, pieces(), self.max_length + 1)  # enough to know it is too long
        if len(input_ids) + len(eos) <= self.max_length:
            return self._checked(input_ids + eos, labels + eos)
        if self.truncation == "drop" or tools:
            why = ("with tools, rows are never cut: a cut would remove the tools block the calls refer to"
                   if tools else "data.truncation: drop")
            raise RowError(
                "longer than max_length",
                f"more than data.max_length={self.max_length} tokens ({why})",
                bad=False,
            )
        input_ids, labels, split = self._encode(bos, pieces(), None)  # the whole row: its end may be kept
        return self._cut(input_ids + eos, labels + eos, split, messages)

    def _encode(self, input_ids: list[int], pieces, limit: int | None) -> tuple[list[int], list[int], int | None]:
        """Token ids and labels of the pieces after ``input_ids`` (the BOS), and where the last trained piece starts.

        With ``limit``, pieces are tokenized only until ``limit`` ids are known (the rest would be cut anyway).
        """
        input_ids = list(input_ids)
        labels = list(input_ids) if self.train_on == "all" else [IGNORE_INDEX] * len(input_ids)
        split = None
        for piece, trained in pieces:
            if limit is not None and len(input_ids) >= limit:
                break  # the rest would be truncated away: do not render or tokenize it
            ids = encode_text(self.tokenizer, piece, None if limit is None else limit - len(input_ids))
            if trained and self.train_on != "all":
                split = len(input_ids)
            input_ids += ids
            labels += ids if trained or self.train_on == "all" else [IGNORE_INDEX] * len(ids)
        return input_ids, labels, split

    def _cut(self, input_ids: list[int], labels: list[int], split: int | None,
             messages: list[dict] | None) -> Tokenized:
        """Cut a row longer than max_length: its context before ``split`` (the last trained piece), then its response
        (see the class docstring)."""
        L = self.max_length
        if not split:  # nothing before the trained text: keep the start
            return self._checked(input_ids[:L], labels[:L], True, 0, len(input_ids) - L)
        response = len(input_ids) - split
        P = self.max_prompt_length or L - min(response, L // 2)
        a, b = split, 0
        if split > P:
            head = tail = 0
            if self.truncation_mode == "keep_end":
                head = prompt_head(self.tokenizer, input_ids[:split], messages, self.keep_system)
            elif messages is not None:  # keep_start: the assistant header in front of the response stays
                last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
                tail = generation_prompt_length(self.tokenizer, messages[:last])
            a, b = prompt_cut(split, P, self.truncation_mode, head, tail)
        room = L - (a + b)
        ids = apply_cut(input_ids[:split], a, b) + input_ids[split : split + room]
        labs = apply_cut(labels[:split], a, b) + labels[split : split + room]
        return self._checked(ids, labs, True, split - (a + b), max(0, response - room))

    def _checked(self, input_ids: list[int], labels: list[int], truncated: bool = False, prompt_cut_tokens: int = 0,
                 response_cut_tokens: int = 0) -> Tokenized:
        if all(label == IGNORE_INDEX for label in labels[1:]):
            if truncated:
                raise RowError(
                    "no trained tokens after truncation",
                    f"no trained tokens in the first {self.max_length} tokens (data.max_length); raise max_length "
                    "or shorten the prompt",
                    bad=False,
                )
            raise RowError("no trained tokens", "the row has no trained tokens")
        return Tokenized(input_ids, labels, truncated, prompt_cut_tokens, response_cut_tokens)

    def _chat_pieces(self, messages: list[dict], full: str, tools: list[dict] | None = None
                     ) -> Iterator[tuple[str, bool]]:
        """Yield the ``(text, trained)`` segments of the rendered conversation ``full`` (rendered with the row's
        ``tools``) in order (lazily)."""
        if self.train_on == "all":
            yield full, True
            return
        cursor = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix, through = assistant_span(self.tokenizer, messages, i, tools)
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


_WORKER_FN = None  # the row tokenizer of a tokenization worker process


def _init_worker(fn) -> None:
    """Tokenization worker start-up: keep ``fn``, and (Linux) be killed when the parent dies, so a ``kill -9`` of
    ``llmtune`` leaves no worker running (``PR_SET_PDEATHSIG``)."""
    global _WORKER_FN
    _WORKER_FN = fn
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() == 1:  # the parent died before the call above
            os._exit(1)


def _tokenize_chunk(rows: list[dict]) -> list:
    """Worker side of :meth:`RowTokenizer.map`: results (or :class:`RowError`) of a chunk of rows, in order."""
    out: list = []
    for row in rows:
        try:
            out.append(_WORKER_FN(row))
        except RowError as err:
            out.append(err.detached())
    return out


PROGRESS_MIN_ROWS = 2000  # a progress bar (stderr) while tokenizing at least this many rows
AUTO_PROC_MIN_ROWS = 2000  # data.num_proc null: worker processes only from this many rows (start-up ~1 s each)
AUTO_PROC_MAX = 8
WORKER_CHUNK_ROWS = 256  # rows per task sent to a tokenization worker


def auto_num_proc(n_rows: int) -> int:
    """Tokenization processes for ``data.num_proc: null``: the CPU cores this process may use, divided by the ranks
    launched on this machine (``LOCAL_WORLD_SIZE``), at most 8; one for fewer than 2,000 rows."""
    if n_rows < AUTO_PROC_MIN_ROWS:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(AUTO_PROC_MAX, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))


class RowTokenizer:
    """Tokenize canonical rows chunk after chunk with one set of worker processes (a context manager); failures are
    returned (not raised) as :class:`RowError` in their place, and a progress bar (stderr, main process, from
    ``PROGRESS_MIN_ROWS`` rows) counts every row of every chunk.

    Args:
        fn: the row tokenizer (:class:`SFTTokenizer`, the pair/prompt/unpaired tokenizers): a picklable callable
            returning a result or raising :class:`RowError`.
        num_proc: worker processes (a ``multiprocessing`` pool, forked where the platform allows, started at the
            first chunk big enough to share; rows and results are pickled; workers die with their parent);
            1 tokenizes in this process; None: :func:`auto_num_proc` of ``total``.
        total: rows expected over all chunks (the progress bar's total and the auto process count).
    """

    def __init__(self, fn, num_proc: int | None = None, total: int = 0):
        self.fn = fn
        self.num_proc = auto_num_proc(total) if num_proc is None else num_proc
        self.total = total
        self._pool = None
        self._bar = None

    def __enter__(self) -> RowTokenizer:
        from tqdm.auto import tqdm

        from llmtune.utils import is_main_process

        desc = "tokenizing" + (f" ({self.num_proc} processes)" if self.num_proc > 1 else "")
        quiet = self.total < PROGRESS_MIN_ROWS or not is_main_process()
        self._bar = tqdm(total=self.total or None, desc=desc, unit="row", leave=False, disable=quiet, mininterval=1.0)
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.terminate() if exc[0] is not None else self._pool.close()
            self._pool.join()
            self._pool = None
        self._bar.close()

    def map(self, rows: list[dict]) -> Iterator:
        """One result (or :class:`RowError`) per row, in order, yielded as they come (workers go on with the rest of
        ``rows`` while the caller stores each result)."""
        if self.num_proc <= 1 or len(rows) < 2 * self.num_proc:
            for row in rows:
                try:
                    yield self.fn(row)
                except RowError as err:
                    yield err.detached()
                self._bar.update(1)
            return
        if self._pool is None:
            import multiprocessing

            context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods()
                                                  else "spawn")
            self._pool = context.Pool(self.num_proc, initializer=_init_worker, initargs=(self.fn,))
        chunk = max(1, min(WORKER_CHUNK_ROWS, len(rows) // (4 * self.num_proc)))
        for results in self._pool.imap(_tokenize_chunk, [rows[i : i + chunk] for i in range(0, len(rows), chunk)]):
            yield from results
            self._bar.update(len(results))


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
