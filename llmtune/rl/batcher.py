"""One rollout engine, many callers: requests for single completions, from any thread, sampled in batches.

A multi-turn rollout advances on its own when its tool calls return (issue 40), and an agent program talks to the
policy through an OpenAI-compatible endpoint whenever it likes (issue 41): neither waits for the other rollouts of
the batch. Both ask for one completion at a time; an engine samples best many at a time (``generate`` on a batch).
:class:`RequestBatcher` sits between them: callers :meth:`~RequestBatcher.submit` a request and get a
``concurrent.futures.Future``; one engine thread takes whatever is pending when the engine is free and samples it as
one ``engine.generate`` call (requests that share their sampling settings and policy version; others wait for the
next call). While the engine samples, new requests queue, so the batch size follows the load: one trajectory whose
tool returned early is sampled at once, the ones whose tools return while it samples go together next.

The engine is only ever called from the batcher's threads: one call at a time by default (the ``hf`` engine samples
with the training model; vLLM's server batches concurrent HTTP requests itself, and gets them as one request here),
or ``workers`` calls at once for an engine in another process (several vLLM servers: a call waits for its slowest
server). Asyncio callers wrap the future: ``await asyncio.wrap_future(batcher.submit(...))``.

Seeds: a request may carry its own ``seed``; an engine that samples each prompt from its own seed
(:attr:`~llmtune.rl.engines.base.RolloutEngine.seeds_per_prompt`) then draws the same completion whatever else
shares the batch (batch composition follows timing; the draws do not). Requests without a seed are sampled as the
engine samples a batch (``sampling.seed``, else torch's global RNG). With ``session=True`` the engine is in one
:meth:`~llmtune.rl.engines.base.RolloutEngine.session` while the batcher runs (hf: the adapter merged once; a
colocated vLLM engine stays awake between calls): only while the policy does not change, as during a rollout batch.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from llmtune.rl.engines.base import RolloutEngine
from llmtune.rl.types import Completion, SamplingParams


@dataclass
class Request:
    """One completion asked of the engine.

    Attributes:
        prompt_ids: the token ids to continue. sampling: how (its ``max_new_tokens`` is the default budget).
        budget: this prompt's own token limit (a multi-turn rollout's remaining budget), None = the sampling's.
        key: requests of one key go to one server (an engine over several servers). version: the policy version
            to sample with (None = the engine's current one).
        future: resolved with the :class:`~llmtune.rl.types.Completion`, or with the engine's exception.
        submitted: ``time.monotonic()`` at submission. seed: this prompt's own seed (engines that take one per
            prompt), None = the engine's batch seeding.
    """

    prompt_ids: list[int]
    sampling: SamplingParams
    budget: int | None = None
    key: int | None = None
    version: int | None = None
    future: Future = field(default_factory=Future)
    submitted: float = field(default_factory=time.monotonic)
    seed: int | None = None


class RequestBatcher:
    """Thread-safe front of one :class:`~llmtune.rl.engines.base.RolloutEngine` (see the module docstring).

    Args:
        engine: the engine; only this batcher's thread calls its ``generate`` while the batcher runs.
        max_batch: most requests per ``generate`` call (None: all that are pending and compatible).
        linger_s: after the first request arrives at an idle engine, wait this long for more before sampling (0:
            sample at once; the batches still grow while the engine is busy).
        linger_max_s: with it, ``linger_s`` is a quiet gap instead: an idle engine samples once no request has come
            for ``linger_s``, or ``linger_max_s`` after the first (requests that trickle in, a few milliseconds
            apart, go together). None: ``linger_s`` after the first, as without.
        workers: engine calls in flight at once (threads); more than 1 only for an engine in another process
            (:class:`~llmtune.rl.engines.base.BackgroundEngine`: several vLLM servers).
        session: hold the engine's ``session()`` from :meth:`start` to :meth:`close`. Only while nothing trains
            the policy in between (the hf engine keeps the adapter merged into the weights for the session).

    Attributes:
        calls: ``generate`` calls made. sizes: the size of each (for metrics and tests). busy_s: seconds the engine
            spent in ``generate`` calls (summed over workers).

    Raises:
        ValueError: ``workers`` > 1 for an engine that samples in this process (the hf engine: one model).
    """

    def __init__(self, engine, max_batch: int | None = None, linger_s: float = 0.0, workers: int = 1,
                 linger_max_s: float | None = None, session: bool = False):
        from llmtune.rl.engines.base import BackgroundEngine

        if workers < 1 or (workers > 1 and not isinstance(engine, BackgroundEngine)):
            raise ValueError(f"workers must be 1 for an engine in this process (got {workers} for "
                             f"{type(engine).__name__}); several calls at once need an engine in another process")
        self.engine, self.max_batch, self.linger_s, self.workers = engine, max_batch, linger_s, workers
        self.linger_max_s = linger_s if linger_max_s is None else max(linger_max_s, linger_s)
        self.session = session
        self._pending: deque[Request] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._held = 0  # held() blocks open: no new engine call starts
        self._threads: list[threading.Thread] = []
        self._session: contextlib.AbstractContextManager | None = None
        self.calls = 0
        self.sizes: list[int] = []
        self.busy_s = 0.0

    def __enter__(self) -> RequestBatcher:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the engine threads (idempotent), in the engine's session with ``session``."""
        with self._cond:
            if self._threads:
                return
            self._closed = False
            if self.session and isinstance(self.engine, RolloutEngine):
                self._session = self.engine.session()
                self._session.__enter__()
            self._threads = [threading.Thread(target=self._run, name=f"llmtune-engine-{i}", daemon=True)
                             for i in range(self.workers)]
            for thread in self._threads:
                thread.start()

    def close(self) -> None:
        """Finish the requests already submitted, then stop the threads (and leave the engine's session); later
        submissions raise."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join()
        session, self._session = self._session, None
        if session is not None:
            session.__exit__(None, None, None)

    @contextlib.contextmanager
    def held(self):
        """While inside, the engine threads start no new call (requests queue; a call already running goes on): many
        callers submit, each on its own (the first turns of many rollouts), and an idle engine samples them as
        one batch when the block ends."""
        with self._cond:
            self._held += 1
        try:
            yield self
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    def submit(self, prompt_ids: list[int], sampling: SamplingParams, budget: int | None = None,
               key: int | None = None, version: int | None = None, seed: int | None = None) -> Future:
        """Queue one request; returns a future of its :class:`~llmtune.rl.types.Completion`.

        Raises:
            RuntimeError: the batcher is closed (or was never started).
        """
        return self.submit_many([prompt_ids], sampling, None if budget is None else [budget],
                                None if key is None else [key], version, None if seed is None else [seed])[0]

    def submit_many(self, prompts: list[list[int]], sampling: SamplingParams, budgets: list[int] | None = None,
                    keys: list[int] | None = None, version: int | None = None, seeds: list[int] | None = None
                    ) -> list[Future]:
        """Queue several requests at once (the arguments as ``engine.generate`` takes them; one per prompt): an idle
        engine samples them as one batch (their order kept), never some alone because the engine thread woke
        between two submissions.

        Raises:
            RuntimeError: the batcher is closed (or was never started).
        """
        requests = [Request([int(i) for i in p], sampling, None if budgets is None else budgets[b],
                            None if keys is None else keys[b], version,
                            seed=None if seeds is None else seeds[b]) for b, p in enumerate(prompts)]
        with self._cond:
            if self._closed or not self._threads:
                raise RuntimeError("the request batcher is not running")
            self._pending.extend(requests)
            self._cond.notify_all()
        return [r.future for r in requests]

    def generate(self, prompt_ids: list[int], sampling: SamplingParams, budget: int | None = None,
                 key: int | None = None, version: int | None = None, seed: int | None = None) -> Completion:
        """:meth:`submit` and wait for the completion (re-raises the engine's exception)."""
        return self.submit(prompt_ids, sampling, budget, key, version, seed).result()

    def _take(self) -> list[Request] | None:
        """The next batch: the oldest pending request and every pending one with its sampling and version (in
        submission order, at most ``max_batch``); None when closed and nothing is pending."""
        with self._cond:
            while True:
                while not self._pending or (self._held and not self._closed):
                    if self._closed and not self._pending:
                        return None
                    self._cond.wait()
                if self.linger_s > 0:
                    first = self._pending[0].submitted
                    while self._pending and not self._closed and (
                            self.max_batch is None or len(self._pending) < self.max_batch):
                        deadline = min(self._pending[-1].submitted + self.linger_s, first + self.linger_max_s)
                        if time.monotonic() >= deadline:
                            break
                        self._cond.wait(timeout=deadline - time.monotonic())
                if self._pending:  # (another worker may have taken them while this one lingered)
                    break
            first = self._pending[0]
            batch, rest = [], deque()
            for r in self._pending:
                same = r.sampling == first.sampling and r.version == first.version
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
                seeded = any(r.seed is not None for r in batch) and isinstance(self.engine, RolloutEngine) \
                    and self.engine.seeds_per_prompt
                extra = {"seeds": [r.seed for r in batch]} if seeded else {}
                completions = self.engine.generate([r.prompt_ids for r in batch], batch[0].sampling, budgets,
                                                   keys=keys, version=batch[0].version, **extra)
            except BaseException as exc:  # noqa: BLE001 - the callers get the engine's error, the thread goes on
                for r in batch:
                    r.future.set_exception(exc)
                continue
            finally:
                with self._cond:
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
