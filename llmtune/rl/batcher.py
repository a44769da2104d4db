"""One rollout engine, many callers: requests for single completions, from any thread, sampled in batches.

A multi-turn rollout advances on its own when its tool calls return (issue 40), and an agent program talks to the
policy through an OpenAI-compatible endpoint whenever it likes (issue 41): neither waits for the other rollouts of
the batch. Both ask for one completion at a time; an engine samples best many at a time (``generate`` on a batch).
:class:`RequestBatcher` sits between them: callers :meth:`~RequestBatcher.submit` a request and get a
``concurrent.futures.Future``; one engine thread takes whatever is pending when the engine is free and samples it as
one ``engine.generate`` call (requests that share their sampling settings and policy version; others wait for the
next call). While the engine samples, new requests queue, so the batch size follows the load: one trajectory whose
tool returned early is sampled at once, the ones whose tools return while it samples go together next.

The engine is only ever called from the batcher's thread, one call at a time (the ``hf`` engine samples with the
training model; vLLM's server batches concurrent HTTP requests itself, and gets them as one request here). Asyncio
callers wrap the future: ``await asyncio.wrap_future(batcher.submit(...))``.

Seeds: a request may carry its own seed (``submit(..., seed=)``), so that what it samples does not depend on which
other requests it happened to be batched with (an engine that seeds per prompt, vLLM, then gets ``seeds=``; the
``hf`` engine draws every prompt of a batch from torch's one RNG and ignores them). Requests with seeds and requests
without are never batched together; within a batch, the sampling settings' own ``seed`` is the first request's (all
equal, like every other setting).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

from llmtune.rl.types import Completion, SamplingParams


@dataclass
class Request:
    """One completion asked of the engine.

    Attributes:
        prompt_ids: the token ids to continue. sampling: how (its ``max_new_tokens`` is the default budget).
        budget: this prompt's own token limit (a multi-turn rollout's remaining budget), None = the sampling's.
        key: requests of one key go to one server (an engine over several servers). version: the policy version
            to sample with (None = the engine's current one). seed: this request's own seed (None = the engine
            draws one: from ``sampling.seed`` and the request's position in its batch, or from torch's RNG).
        future: resolved with the :class:`~llmtune.rl.types.Completion`, or with the engine's exception.
    """

    prompt_ids: list[int]
    sampling: SamplingParams
    budget: int | None = None
    key: int | None = None
    version: int | None = None
    seed: int | None = None
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)


class RequestBatcher:
    """Thread-safe front of one :class:`~llmtune.rl.engines.base.RolloutEngine` (see the module docstring).

    Args:
        engine: the engine; only this batcher's thread calls its ``generate`` while the batcher runs.
        max_batch: most requests per ``generate`` call (None: all that are pending and compatible).
        linger_s: after the first request arrives at an idle engine, wait this long for more before sampling (0:
            sample at once; the batches still grow while the engine is busy).
        expect: ``fn() -> int``, how many requests the callers will have pending when they are all waiting (e.g.
            the rollouts still running): once that many are pending the batch is sampled without lingering further,
            so callers that run in step (their requests come back together, their tools return together) are one
            ``generate`` call, and a slow one delays the others by ``linger_s`` at most. None: linger the whole
            ``linger_s``. Call :meth:`wake` when it drops.

    Attributes:
        calls: ``generate`` calls made. sizes: the size of each (for metrics and tests).
    """

    def __init__(self, engine, max_batch: int | None = None, linger_s: float = 0.0,
                 expect: Callable[[], int] | None = None):
        self.engine, self.max_batch, self.linger_s, self.expect = engine, max_batch, linger_s, expect
        self._pending: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.calls = 0
        self.sizes: list[int] = []
        self.busy_s = 0.0

    def __enter__(self) -> RequestBatcher:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        with self._cond:
            if self._thread is not None:
                return
            self._closed = False
            self._thread = threading.Thread(target=self._run, name="llmtune-engine", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Re-check a lingering batch now (``expect`` dropped: a caller finished)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Finish the requests already submitted, then stop the thread; later submissions raise."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, budget: int | None = None,
               key: int | None = None, version: int | None = None, seed: int | None = None) -> Future:
        """Queue one request; returns a future of its :class:`~llmtune.rl.types.Completion`.

        Raises:
            RuntimeError: the batcher is closed (or was never started).
        """
        request = Request([int(i) for i in prompt_ids], sampling, budget, key, version,
                          None if seed is None else int(seed))
        with self._cond:
            if self._closed or self._thread is None:
                raise RuntimeError("the request batcher is not running")
            self._pending.append(request)
            self._cond.notify_all()
        return request.future

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, budget: int | None = None,
                 key: int | None = None, version: int | None = None, seed: int | None = None) -> Completion:
        """:meth:`submit` and wait for the completion (re-raises the engine's exception)."""
        return self.submit(prompt_ids, sampling, budget, key, version, seed).result()

    def _take(self) -> list[Request] | None:
        """The next batch: the oldest pending request and every pending one with its sampling and version, and a
        seed of its own when it has one (in submission order, at most ``max_batch``); None when closed and nothing
        is pending."""
        with self._cond:
            while not self._pending:
                if self._closed:
                    return None
                self._cond.wait()
            if self.linger_s > 0:
                deadline = self._pending[0].submitted + self.linger_s
                while not self._closed and time.monotonic() < deadline and (
                        self.max_batch is None or len(self._pending) < self.max_batch) and (
                        self.expect is None or len(self._pending) < self.expect()):
                    self._cond.wait(timeout=max(deadline - time.monotonic(), 0.0))
            first = self._pending[0]
            batch, rest = [], deque()
            for r in self._pending:
                same = (r.sampling == first.sampling and r.version == first.version
                        and (r.seed is None) == (first.seed is None))
                if same and (self.max_batch is None or len(batch) < self.max_batch):
                    batch.append(r)
                else:
                    rest.append(r)
            self._pending = rest
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            batch = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            start = time.monotonic()
            try:
                budgets = [r.budget if r.budget is not None else r.sampling.max_new_tokens for r in batch]
                keys = [r.key if r.key is not None else i for i, r in enumerate(batch)]
                seeded = {"seeds": [r.seed for r in batch]} if batch[0].seed is not None else {}
                completions = self.engine.generate([r.prompt_ids for r in batch], batch[0].sampling, budgets,
                                                   keys=keys, version=batch[0].version, **seeded)
            except BaseException as exc:  # noqa: BLE001 - the callers get the engine's error, the thread goes on
                for r in batch:
                    r.future.set_exception(exc)
                continue
            finally:
                self.busy_s += time.monotonic() - start
                self.calls += 1
                self.sizes.append(len(batch))
            if len(completions) != len(batch):
                error = RuntimeError(f"the engine answered {len(completions)} completions for {len(batch)} prompts")
                for r in batch:
                    r.future.set_exception(error)
                continue
            for r, completion in zip(batch, completions):
                r.future.set_result(completion)
