"""One rollout's requests to the OpenAI-compatible endpoint, recorded as token ids and joined into training rows.

Every request is rendered by llmtune with the chat template (its tools included) and sampled by the engine; what it
sampled is recorded as token ids, the engine's log-probs and the policy version. How a request becomes ids:

- **join** (token-in/token-out): the request's messages extend an earlier exchange of the rollout, compared as
  messages (:func:`llmtune.rl.openai_api.message_key`: that exchange's messages, then the assistant message llmtune
  answered, then anything new). Its prompt ids are that exchange's prompt ids + the ids it sampled (+ the template's
  end of turn, as context, when that turn was cut by ``max_tokens`` or a stop string) + the template's ids of the new
  messages and the next assistant header (the text after the answer's end of turn in a render of the conversation),
  never a decoded and re-encoded history. When that exchange is the last of its segment, the request continues the
  segment (one row, as the built-in loop builds it); when it was already continued (``n`` > 1, or the agent asked
  twice from the same point), the request starts a new segment whose context is those exact ids.
- **split**: anything else (the agent rewrote its history: dropped reasoning, summarised memory, changed the system
  prompt or the tools, or a template that renders an earlier turn differently once more follow) is rendered afresh
  and starts a new segment.

The rollout is then one training row per segment (:class:`llmtune.rl.types.Segment`), each trained with its own
context; every token the policy sampled is in exactly one of them (loss mask 1), everything else is context (0). The
budget (``rollout.max_new_tokens``) counts the tokens after a segment's first prompt, as the built-in loop counts a
rollout's; a request that has no token left, or comes after ``agent.max_turns`` answers, is refused (400, counted as
the rollout being cut: ``length`` / ``turns``).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

from llmtune.rl.openai_api import APIError, ChatRequest
from llmtune.rl.types import ERROR, LENGTH, STOP, TURNS, Completion, Outcome, Segment, Trajectory


@dataclass
class Exchange:
    """One sampled answer to one request (one choice of it).

    Attributes:
        keys: the request's message keys. tools_key: its tools (canonical JSON). messages: its template messages.
        prompt_ids: the ids the engine was given. segment: the training row it belongs to.
        sampled, logps, finish: what the engine sampled (cut at a stop string), its log-probs (or None), ``stop`` /
            ``length``; None while it is being sampled. reply_key, reply: the answer as a comparable key and as the
            template's message. continued: a later request continued its segment from here.
    """

    keys: list[tuple]
    tools_key: str
    messages: list[dict]
    tools: list[dict] | None
    prompt_ids: list[int]
    segment: int
    sampled: list[int] = field(default_factory=list)
    logps: list[float] | None = None
    finish: str | None = None
    ended_on_stop_token: bool = False
    reply_key: tuple | None = None
    reply: dict | None = None
    continued: bool = False
    order: int = 0


@dataclass
class Prepared:
    """What a request is sampled from: its prompt ids, how many tokens it may sample, the exchanges (one per choice)
    it will fill, whether it was joined, and its number in the rollout."""

    prompt_ids: list[int]
    room: int
    exchanges: list[Exchange]
    joined: bool
    number: int  # the request's number in the rollout (1, 2, ...): its seeds


class Recorder:
    """The exchanges of one rollout (thread-safe: an agent may send several requests at once).

    Args:
        renderer: the run's :class:`Renderer`. budget: tokens after a segment's first prompt (the rollout's
            ``max_new_tokens``). model_len: prompt + completion at most (the engine's). max_turns: requests at most.
    """

    def __init__(self, renderer: Renderer, budget: int, model_len: int, max_turns: int):
        self.renderer, self.budget, self.model_len, self.max_turns = renderer, budget, model_len, max_turns
        self.exchanges: list[Exchange] = []
        self.segments: list[list[int]] = []  # per segment, its exchanges in order
        self.lock = threading.Lock()
        self.joins = self.splits = self.requests = self.overridden = 0
        self.cut: str | None = None  # LENGTH / TURNS when a request was refused for the rollout's limits
        self.refused: str | None = None  # why, the first time
        self.tool_calls, self.tool_errors = 0, {}
        self.version: int | None = None  # the policy version its answers were sampled with

    # ---- a request ---------------------------------------------------------------------------------------------
    def prepare(self, request: ChatRequest) -> Prepared:
        """Decide how ``request`` becomes ids (join or split; module docstring) and reserve its exchanges.

        Raises:
            APIError: 400 ``rollout_turn_limit`` after ``max_turns`` requests; 400 ``context_length_exceeded`` when
                the segment's budget or the model length leaves no token to sample (the rollout is then cut).
        """
        with self.lock:
            if self.requests >= self.max_turns:
                raise self._refuse(TURNS, APIError(400, f"this rollout has had its {self.max_turns} requests "
                                                   "(agent.max_turns): no more requests in this rollout", "messages",
                                                   "rollout_turn_limit"))
            parent = self._parent(request)
            prompt_ids, segment = None, None
            if parent is not None:
                extra = self.renderer.continuation_ids(parent, request.messages[len(parent.keys) + 1:],
                                                       request.tools)
                if extra is not None:
                    prompt_ids = parent.prompt_ids + parent.sampled + extra
                    segment = None if parent.continued else parent.segment
            if prompt_ids is None:
                prompt_ids = self.renderer.prompt_ids(request.messages, request.tools)
            joined = segment is not None
            start = self.segments[segment] if joined else None
            used = len(prompt_ids) - len(self.exchanges[start[0]].prompt_ids) if joined else 0
            room = min(self.budget - used, self.model_len - len(prompt_ids))
            if request.max_tokens is not None:
                room = min(room, request.max_tokens)
            if room < 1:
                raise self._refuse(LENGTH, APIError(
                    400, f"this rollout's budget is used up: {len(prompt_ids)} prompt tokens, {used} of "
                    f"rollout.max_new_tokens {self.budget} spent in this conversation (model length {self.model_len})",
                    "messages", "context_length_exceeded"))
            self.requests += 1
            self.overridden += bool(request.overridden)
            if joined:
                parent.continued = True
                self.joins += 1
            elif self.exchanges:
                self.splits += 1
            out = []
            for i in range(request.n):
                if i > 0 or not joined:
                    self.segments.append([])
                    seg = len(self.segments) - 1
                else:
                    seg = segment
                exchange = Exchange(request.keys, request.tools_key, request.messages, request.tools, prompt_ids,
                                    seg, order=len(self.exchanges))
                self.segments[seg].append(len(self.exchanges))
                self.exchanges.append(exchange)
                out.append(exchange)
            return Prepared(prompt_ids, room, out, joined, self.requests)

    def _refuse(self, finish: str, error: APIError) -> APIError:
        """Note a refusal for the rollout's own limits (the rollout is then cut: ``finish``)."""
        self.cut = self.cut or finish
        self.refused = self.refused or error.message
        return error

    def _parent(self, request: ChatRequest) -> Exchange | None:
        """The answered exchange this request extends (its messages, then its answer, then new ones), the one with
        the most messages (the latest on a tie); None."""
        best = None
        for e in self.exchanges:
            k = len(e.keys)
            if (e.reply_key is not None and e.tools_key == request.tools_key and len(request.keys) > k
                    and request.keys[:k] == e.keys and request.keys[k] == e.reply_key):
                if best is None or k >= len(best.keys):
                    best = e
        return best

    def record(self, exchange: Exchange, completion: Completion, ids: list[int], reply: dict, reply_key: tuple,
               calls: int, errors: dict[str, int]) -> None:
        """Fill a reserved exchange with what was sampled (``ids``: the completion's ids, cut at a stop string)."""
        with self.lock:
            exchange.sampled = list(ids)
            exchange.logps = None if completion.logprobs is None else list(completion.logprobs[:len(ids)])
            exchange.ended_on_stop_token = completion.finish_reason == STOP and len(ids) == len(completion.token_ids)
            exchange.finish = STOP if completion.finish_reason == STOP or len(ids) < len(completion.token_ids) \
                else LENGTH
            exchange.reply, exchange.reply_key = reply, reply_key
            self.version = completion.version if self.version is None else self.version
            self.tool_calls += calls
            for kind, count in errors.items():
                self.tool_errors[kind] = self.tool_errors.get(kind, 0) + count

    # ---- the rollout -------------------------------------------------------------------------------------------
    def trajectory(self, row: dict, group: int, version: int | None, failure: str | None,
                   agent_reward: float | None) -> Trajectory:
        """The rollout as a :class:`~llmtune.rl.types.Trajectory`: its segments (the last one, the segment of its
        last answer, is the trajectory's own ids), the final conversation (the last request's messages and its
        answer), its finish reason (``error`` with ``failure``; ``length`` / ``turns`` when a request was refused
        for the rollout's limits; else how its last answer ended), the agent's reward."""
        with self.lock:
            done = [e for e in self.exchanges if e.finish is not None]
            if not done and failure is None:  # nothing to train on: not the model's doing
                failure = (f"no request of the agent was answered: {self.refused}" if self.refused
                           else "the agent made no request to the endpoint")
            rows = []
            for seg in self.segments:
                segment = self._row([self.exchanges[i] for i in seg if self.exchanges[i].finish is not None])
                if segment is not None:
                    rows.append((max(self.exchanges[i].order for i in seg), segment))
            rows = [r for _, r in sorted(rows, key=lambda x: x[0])]
            last = max(done, key=lambda e: e.order) if done else None
            messages = [*last.messages, last.reply] if last is not None else list(_prompt_messages(row))
            finish = ERROR if failure is not None else (self.cut or (last.finish if last else LENGTH))
            outcome = Outcome(messages, None, self.tool_calls, dict(self.tool_errors), 0, failure, [],
                              joins=self.joins, splits=self.splits, agent_reward=agent_reward,
                              sampling_overridden=self.overridden, requests=self.requests)
            own = rows[-1] if rows else Segment(list(row.get("input_ids") or []), [], [], None)
            with_logps = all(r.engine_logps is not None for r in rows) and bool(rows)
            return Trajectory(row, own.prompt_ids, own.completion_ids, own.loss_mask,
                              own.engine_logps if with_logps else None,
                              self.version if self.version is not None else version, finish, len(done), group, outcome,
                              rows if len(rows) > 1 else [])

    @staticmethod
    def _row(exchanges: list[Exchange]) -> Segment | None:
        """One segment's training row: its first prompt, then each answer (1) and what came between them (0)."""
        if not exchanges:
            return None
        ids, mask, logps = [], [], []
        with_logps = all(e.logps is not None for e in exchanges)
        prompt = exchanges[0].prompt_ids
        end = len(prompt)
        for e in exchanges:
            if e.prompt_ids[:end] != prompt + ids:
                raise RuntimeError("a joined request's prompt does not extend its segment: a bug")
            between = e.prompt_ids[end:]
            ids += between + e.sampled
            mask += [0] * len(between) + [1] * len(e.sampled)
            logps += [math.nan] * len(between) + (list(e.logps) if e.logps is not None else [math.nan] * len(e.sampled))
            end = len(e.prompt_ids) + len(e.sampled)
        return Segment(list(prompt), ids, mask, logps if with_logps else None)


def _prompt_messages(row: dict) -> list[dict]:
    import json

    messages = row.get("messages")
    return json.loads(messages) if isinstance(messages, str) else list(messages or [])


class Renderer:
    """The run's chat template, as the endpoint renders requests (tools included).

    Args:
        tokenizer: the policy's tokenizer (``data.chat_template`` applied). stop_token_ids: the run's stop set.
    """

    def __init__(self, tokenizer, stop_token_ids):
        from llmtune.rl.chat import ToolTurns

        self.tokenizer = tokenizer
        self.turns = ToolTurns(tokenizer, [], stop_token_ids)  # turn_end, encode, the end-of-turn text
        base = self.turns.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
        at = base.rfind("Hello") + len("Hello")
        self.end_of_turn = self.turns.encode(base[at:self.turns.turn_end(base, at)])

    def render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool) -> str:
        """``messages`` as the template renders them with ``tools``.

        Raises:
            APIError: 400, the template cannot render them (its error shown).
        """
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                      add_generation_prompt=generation_prompt)
        except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception() in templates
            raise APIError(400, f"the model's chat template cannot render these messages ({type(exc).__name__}: "
                           f"{exc})", "messages") from None

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        """A fresh render of a request, as prompt rows are rendered (:func:`llmtune.data.prompts.prompt_ids`)."""
        from llmtune.data.prompts import prompt_ids

        try:
            return prompt_ids(self.tokenizer, messages, tools=tools)
        except Exception as exc:  # noqa: BLE001 - RowError: the template fails on these messages
            raise APIError(400, f"the model's chat template cannot render these messages ({exc})", "messages") from None

    def continuation_ids(self, parent: Exchange, new: list[dict], tools: list[dict] | None) -> list[int] | None:
        """The ids that follow ``parent``'s sampled answer when ``new`` messages come after it: the end-of-turn
        token when the answer did not end on one (context), the template's text after the answer's end of turn,
        ``new`` as rendered after that conversation, and the next assistant header. None when the template renders
        the conversation so far differently once the answer or the new messages follow (it rewrites history): then
        the request cannot be joined."""
        history = parent.messages
        before = self.render(history, tools, True)
        through = self.render([*history, parent.reply], tools, False)
        full = self.render([*history, parent.reply, *new], tools, True)
        if not through.startswith(before) or not full.startswith(through):
            return None
        try:
            end = self.turns.turn_end(through, len(before))
        except Exception:  # noqa: BLE001 - no end of turn after the answer: cannot tell where it ends
            return None
        eot = [] if parent.ended_on_stop_token else list(self.end_of_turn)
        return eot + self.turns.encode(through[end:] + full[len(through):])
