"""The OpenAI-compatible endpoint an agent program talks to during rollouts: ``POST /v1/chat/completions`` (and
``GET /v1/models``) in front of the rollout engine, one :class:`Session` per rollout.

Each rollout has its own key (``secrets.token_urlsafe``: 192 random bits). A request names its rollout by the key,
as the bearer token (``Authorization: Bearer <key>``, what every OpenAI client sends as its API key) or in the path
(``/r/<key>/v1/...``: the base URL each rollout is given, for frameworks that send a fixed key); a request without a
known key is refused (401), on every address, so the requests of one rollout are known to belong together and
nothing else reaches the engine. The server listens on loopback unless ``agent.openai.host`` says otherwise (then it
warns: the keys are then all that protects it). A rollout's key is revoked when its agent returns.

A request is checked (:mod:`llmtune.rl.openai_api`), rendered and joined by ids (:mod:`llmtune.rl.recorder`),
sampled through the :class:`llmtune.rl.batcher.RequestBatcher` (every request of every rollout in batches, each with
a seed of its own: the built-in loop's seed of that turn (:func:`llmtune.rl.agent.turn_seed` of the batch's seed, the
rollout and the request's number), so the engines that seed per prompt (hf, vLLM) draw what the built-in loop draws
for the same ids, whatever shares the batch), read for tool calls with the run's parser and answered in OpenAI's
format. The engine's failure is answered 500 and reported to the rollout side,
which stops the run with it.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import secrets
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from llmtune.rl.agent import turn_seed
from llmtune.rl.openai_api import (APIError, Choice, assistant_message, completion_body, finish_reason, message_key,
                                   parse_request, stream_events)
from llmtune.rl.recorder import Recorder
from llmtune.rl.types import STOP, SamplingParams
from llmtune.utils import get_logger

log = get_logger("rl")
MAX_BODY_BYTES = 32 << 20  # a request body above this is refused (413) before it is read


@dataclass
class Reader:
    """How a sampled turn is read: the tokenizer (decoding), the tool-call parser family and whether the tokenizer's
    response template parses it (:func:`llmtune.rl.tool_calls.resolve_tool_parser`)."""

    tokenizer: object
    parser: str | None
    response_template: bool = False

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def cut_at_stop(self, ids: list[int], text: str, stop: list[str]) -> tuple[list[int], str] | None:
        """``(ids up to the token that completes the first stop string, the text before it)``, or None when no
        stop string occurs in ``text`` (the decoded ``ids``)."""
        hits = [(text.find(s), s) for s in stop if s in text]
        if not hits:
            return None
        at, _ = min(hits)
        for k in range(1, len(ids) + 1):
            if any(s in self.decode(ids[:k]) for s in stop):
                return ids[:k], text[:at]
        return ids, text[:at]

    def read(self, completion, stop: list[str], tools: list[dict] | None, tool_choice: str
             ) -> tuple[list[int], dict, dict, str, int, dict[str, int]]:
        """A sampled turn as ``(ids kept, OpenAI message, template message, finish reason, calls, errors)``: cut at
        the first stop string (the tokens after it were sampled but are not part of the turn), its tool calls read
        when it ended (on its stop token or a stop string) and ``tool_choice`` is not ``none``; a turn cut by its
        token limit is its text, without calls. ``errors``: ``{"malformed": n, "unknown_tool": n}``."""
        from llmtune.rl.tool_calls import parse_tool_calls

        ids = list(completion.token_ids)
        ended = completion.finish_reason == STOP
        text = self.decode(ids[:-1] if ended else ids)
        cut = self.cut_at_stop(ids, text, stop) if stop else None
        if cut is not None:
            ids, text, ended = cut[0], cut[1], True
        if not ended or tool_choice == "none":
            wire, template = assistant_message(text, [], [], tool_choice)
            return ids, wire, template, "length" if not ended else "stop", 0, {}
        template_tok = self.tokenizer if self.response_template else None
        content, calls = parse_tool_calls(text, self.parser, template_tok, tools=tools if template_tok else None)
        good = [c for c in calls if c.error is None]
        names = {t["function"]["name"] for t in tools or []}
        errors = {"malformed": len(calls) - len(good), "unknown_tool": sum(c.name not in names for c in good)}
        wire, template = assistant_message(content, good, [c.raw for c in calls if c.error is not None], tool_choice)
        return ids, wire, template, finish_reason(STOP, wire), len(calls), {k: v for k, v in errors.items() if v}


class Session:
    """One rollout behind the endpoint: its recorder, how its requests are sampled, its seeds.

    Args:
        recorder: the rollout's :class:`~llmtune.rl.recorder.Recorder`. submit: the batcher's ``submit``.
        sampling: the run's sampling settings (the rollout's). version: the policy version to sample with. group:
            the rollout's group (its requests go to one server). seed: the rollout batch's seed; rollout: this
            rollout's index in the batch: request k's seed is :func:`llmtune.rl.agent.turn_seed` (seed, rollout,
            k - 1), the seed of the built-in loop's turn k (a choice i > 0 of ``n``: a hash of that and i).
            reader: :class:`Reader`.
        on_engine_error: called with the engine's exception (the rollout side stops the run with it).
    """

    def __init__(self, recorder: Recorder, submit: Callable, sampling: SamplingParams, version: int | None,
                 group: int, seed: int, rollout: int, reader: Reader,
                 on_engine_error: Callable[[BaseException], None]):
        self.recorder, self.submit, self.sampling, self.version = recorder, submit, sampling, version
        self.group, self.seed, self.rollout, self.reader = group, seed, rollout, reader
        self.on_engine_error = on_engine_error

    def complete(self, body) -> tuple[dict | None, list[bytes] | None]:
        """Answer one chat-completions request: ``(JSON body, None)`` or ``(None, server-sent events)``.

        Raises:
            APIError: the request is refused (400 with the field), or the engine failed (500).
        """
        s = self.sampling
        request = parse_request(body, 0.0 if s.greedy else s.temperature, 1.0 if s.greedy else s.top_p)
        prepared = self.recorder.prepare(request)
        seed = turn_seed(self.seed, self.rollout, prepared.number - 1)  # the built-in loop's turn: the same draws
        futures = [self.submit(prepared.prompt_ids, s, budget=prepared.room, key=self.group, version=self.version,
                               seed=seed if i == 0 else turn_seed(seed, -1, i))
                   for i in range(request.n)]
        try:
            completions = [f.result() for f in futures]
        except BaseException as exc:  # noqa: BLE001 - the engine's failure ends the run; the agent gets a 500
            self.on_engine_error(exc)
            raise APIError(500, f"the rollout engine failed: {type(exc).__name__}: {exc}") from None
        choices = []
        for exchange, completion in zip(prepared.exchanges, completions):
            ids, wire, template, finish, calls, errors = self.reader.read(completion, request.stop, request.tools,
                                                                         request.tool_choice)
            self.recorder.record(exchange, completion, ids, template, message_key(template), calls, errors)
            logprobs = None
            if request.logprobs and completion.logprobs is not None:
                logprobs = [(self.reader.decode([t]), float(lp)) for t, lp in zip(ids, completion.logprobs)]
            choices.append(Choice(wire, finish, len(ids), logprobs))
        if request.stream:
            return None, stream_events(request, choices, len(prepared.prompt_ids))
        return completion_body(request, choices, len(prepared.prompt_ids)), None


class Endpoint:
    """The HTTP server (a thread of its own) and the rollouts it serves.

    Args:
        host, port: where it listens (port 0: a free one).

    Attributes:
        port: the port it listens on. host: the host in the base URLs it gives (loopback for a wildcard address).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self._sessions: dict[bytes, Session] = {}
        self._lock = threading.Lock()
        import socket

        attributes = {"request_queue_size": 256}  # many agents connect at once (socketserver's default backlog: 5)
        if ":" in host:
            attributes["address_family"] = socket.AF_INET6
        server = type("EndpointServer", (ThreadingHTTPServer,), attributes)
        self.httpd = server((host, port), _handler(self))
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        wildcard = host in ("", "0.0.0.0", "::")
        self.host = ("::1" if ":" in host else "127.0.0.1") if wildcard else host
        if not _loopback(host):
            log.warning("the agent endpoint listens on %s:%d, beyond this host: every request still needs its "
                        "rollout's key (refused with 401 otherwise), but anyone who can reach the port can try",
                        host or "*", self.port)
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="llmtune-endpoint", daemon=True)
        self._thread.start()

    def base_url(self, key: str) -> str:
        """The base URL of the rollout of ``key`` (its key in the path; its API key is ``key`` too)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/r/{key}/v1"

    def register(self, session: Session) -> str:
        """Serve ``session`` under a new key; returns the key."""
        key = secrets.token_urlsafe(24)
        with self._lock:
            self._sessions[_digest(key)] = session
        return key

    def revoke(self, key: str) -> None:
        """Refuse the key's requests from now on (401)."""
        with self._lock:
            self._sessions.pop(_digest(key), None)

    def revoke_all(self) -> None:
        """Refuse every key's requests from now on (401): the engine failed, every running agent stops fast."""
        with self._lock:
            self._sessions.clear()

    def session(self, key: str | None) -> Session | None:
        """The rollout a request's key belongs to, or None (no key, an unknown or revoked one: the caller answers
        401)."""
        if not key:
            return None
        with self._lock:
            return self._sessions.get(_digest(key))

    def close(self) -> None:
        """Stop serving and free the port (waits up to 10 s for the server thread)."""
        self.httpd.shutdown()
        self.httpd.server_close()
        self._thread.join(10)


def _digest(key: str) -> bytes:
    """Sessions are found by the key's SHA-256 (a dict lookup's timing says nothing about the key itself)."""
    return hashlib.sha256(key.encode()).digest()


def _loopback(host: str) -> bool:
    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _route(path: str) -> tuple[str | None, str]:
    """``(key in the path or None, the route: chat | models | other)`` of a request path."""
    path = path.split("?", 1)[0]
    key = None
    if path.startswith("/r/"):
        key, _, rest = path[3:].partition("/")
        path = "/" + rest
    path = path.removeprefix("/v1")
    route = {"/chat/completions": "chat", "/models": "models"}.get(path.rstrip("/"), "other")
    return key or None, route


def _handler(endpoint: Endpoint):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "llmtune-endpoint"

        def log_message(self, fmt, *args):  # the keys are in the paths: never logged
            pass

        def _send(self, status: int, payload: dict | None = None, events: list[bytes] | None = None) -> None:
            body = b"".join(events) if events is not None else json.dumps(payload, ensure_ascii=False).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream" if events is not None else "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _error(self, exc: APIError) -> None:
            self._send(exc.status, exc.body())

        def _session(self, path_key: str | None) -> Session | None:
            """The rollout the request belongs to (its key in the path and/or as the bearer token); else a 401."""
            auth = self.headers.get("Authorization", "")
            bearer = auth[7:].strip() if auth[:7].lower() == "bearer " else None
            keys = {k for k in (path_key, bearer) if k}
            session = endpoint.session(path_key or bearer)
            # two different keys, one of them not this rollout's: refused (a key names its rollout, never another)
            if session is None or any(endpoint.session(k) is not session for k in keys):
                self._error(APIError(401, "unknown or missing key: each rollout's agent gets its own base URL and "
                                     "API key (OPENAI_BASE_URL, OPENAI_API_KEY); a finished rollout's key is revoked",
                                     code="invalid_api_key"))
                return None
            return session

        def _body(self):
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                raise APIError(413, f"request body of {length} bytes, more than {MAX_BODY_BYTES}")
            try:
                return json.loads(self.rfile.read(length) or b"null")
            except ValueError as exc:
                raise APIError(400, f"the body is not JSON ({exc})") from None

        def do_GET(self):
            key, route = _route(self.path)
            if route != "models":
                return self._error(APIError(404, f"no route GET {self.path.split('?')[0]}"))
            if self._session(key) is not None:
                self._send(200, {"object": "list", "data": [{"id": "policy", "object": "model", "created": 0,
                                                             "owned_by": "llmtune"}]})

        def do_POST(self):
            key, route = _route(self.path)
            try:
                body = self._body()
            except APIError as exc:
                return self._error(exc)
            if route != "chat":
                return self._error(APIError(404, "only /v1/chat/completions is served (chat completions)"))
            session = self._session(key)
            if session is None:
                return None
            try:
                payload, events = session.complete(body)
            except APIError as exc:
                return self._error(exc)
            except Exception as exc:  # noqa: BLE001 - a bug must not kill the server thread silently
                log.exception("the agent endpoint failed on a request")
                return self._error(APIError(500, f"{type(exc).__name__}: {exc}"))
            self._send(200, payload, events)

    return Handler
