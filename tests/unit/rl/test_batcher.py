"""The request batcher (llmtune.rl.batcher) in front of the real hf engine on a tiny model: requests from many
threads are sampled in batches, each caller gets the completion of its own prompt (the one a direct engine call
gives), batches never mix sampling settings or policy versions, and the engine's errors reach every caller."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmtune.rl.batcher import RequestBatcher
from llmtune.rl.types import SamplingParams
from tests.unit.rl.test_hf_generation import engine_for, prompt_ids, tok, trained_policy  # noqa: F401 - fixture

TEXTS = ["What is 2 + 3?", "Hi", "Tell me a long story about the sea, please.", "Why?", "Hello! How are you?",
         "What is 12 * 7?", "Write a poem about the sea.", "Natalia sold clips."]


@pytest.fixture(scope="module")
def engine(tok):
    return engine_for(trained_policy(tok), tok)


def greedy(tok, n=12):
    return SamplingParams(max_new_tokens=n, stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),), greedy=True)


def test_concurrent_requests_are_batched_and_each_gets_its_own_completion(tok, engine):
    prompts = prompt_ids(tok, TEXTS)
    direct = [c.token_ids for c in engine.generate(prompts, greedy(tok))]
    with RequestBatcher(engine) as batcher:
        barrier = threading.Barrier(len(prompts))

        def ask(i):
            barrier.wait()  # all at once: most of them queue while the first call samples
            return batcher.generate(prompts[i], greedy(tok)).token_ids

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(ask, range(len(prompts))))
    assert answers == direct
    assert sum(batcher.sizes) == len(prompts)
    assert batcher.calls < len(prompts) and max(batcher.sizes) > 1  # batched, not one call per request


def test_linger_gathers_requests_into_one_call(tok, engine):
    prompts = prompt_ids(tok, TEXTS[:4])
    with RequestBatcher(engine, linger_s=2.0) as batcher:
        futures = [batcher.submit(p, greedy(tok)) for p in prompts]
        [f.result() for f in futures]
    assert batcher.sizes == [4]


def test_batches_never_mix_sampling_settings_or_versions(tok, engine):
    prompts = prompt_ids(tok, TEXTS[:4])
    short, longer = greedy(tok, 4), greedy(tok, 12)
    with RequestBatcher(engine, linger_s=1.0) as batcher:
        futures = [batcher.submit(prompts[0], short), batcher.submit(prompts[1], longer),
                   batcher.submit(prompts[2], short), batcher.submit(prompts[3], short, version=0)]
        results = [f.result() for f in futures]
    assert sorted(batcher.sizes) == [1, 1, 2]
    assert all(len(r.token_ids) <= 4 for r in (results[0], results[2], results[3]))
    assert results[1].token_ids == engine.generate([prompts[1]], longer)[0].token_ids


def test_a_per_request_budget_is_the_engines(tok, engine):
    prompts = prompt_ids(tok, TEXTS[:2])
    with RequestBatcher(engine, linger_s=1.0) as batcher:
        a, b = batcher.submit(prompts[0], greedy(tok, 12), budget=3), batcher.submit(prompts[1], greedy(tok, 12))
        assert len(a.result().token_ids) <= 3
        assert b.result().token_ids == engine.generate([prompts[1]], greedy(tok, 12))[0].token_ids


def test_the_engines_error_reaches_every_caller_and_the_batcher_goes_on(tok, engine):
    prompts = prompt_ids(tok, TEXTS[:2])
    with RequestBatcher(engine, linger_s=1.0) as batcher:
        bad = [batcher.submit([10**9], greedy(tok)), batcher.submit([10**9 + 1], greedy(tok))]  # ids beyond the vocab
        for future in bad:
            with pytest.raises(Exception):
                future.result()
        assert batcher.generate(prompts[0], greedy(tok)).token_ids == \
            engine.generate([prompts[0]], greedy(tok))[0].token_ids
    with pytest.raises(RuntimeError, match="not running"):
        batcher.submit(prompts[0], greedy(tok))


class _Recorder:
    """An engine that records each call's prompts and seeds, and answers each prompt with its last id."""

    def __init__(self):
        self.calls = []

    def generate(self, prompts, sampling, budgets=None, keys=None, version=None, **extra):
        from llmtune.rl.types import Completion

        self.calls.append(([p[-1] for p in prompts], extra.get("seeds")))
        return [Completion([p[-1]], None, "length", 0) for p in prompts]


def test_requests_with_their_own_seeds_batch_together_and_pass_them_on():
    engine = _Recorder()
    sampling = SamplingParams(max_new_tokens=2, stop_token_ids=(0,), seed=5)
    with RequestBatcher(engine, linger_s=1.0) as batcher:
        futures = [batcher.submit([1], sampling, seed=11), batcher.submit([2], sampling),
                   batcher.submit([3], sampling, seed=33), batcher.submit([4], sampling)]
        assert [f.result().token_ids for f in futures] == [[1], [2], [3], [4]]
    # seeded and unseeded requests are never mixed; an engine gets seeds= only for seeded requests (old engines that
    # do not take the argument keep working for unseeded ones)
    assert sorted(engine.calls) == [([1, 3], [11, 33]), ([2, 4], None)]


def test_expect_samples_as_soon_as_every_caller_is_waiting_and_lingers_at_most_linger_s():
    """``expect``: callers that run in step are one engine call (no waiting beyond the last of them); one that does
    not come holds the others back ``linger_s`` at most; ``wake`` re-checks when fewer are expected."""
    import time

    engine = _Recorder()
    sampling = SamplingParams(max_new_tokens=2, stop_token_ids=(0,))
    expected = [3]
    with RequestBatcher(engine, linger_s=30.0, expect=lambda: expected[0]) as batcher:
        start = time.monotonic()
        futures = [batcher.submit([i], sampling) for i in (1, 2, 3)]
        [f.result() for f in futures]
        assert time.monotonic() - start < 10  # all three were there: no lingering to 30 s
        future = batcher.submit([4], sampling)  # one of three: waits for the others ...
        time.sleep(0.3)
        assert not future.done()
        expected[0] = 1  # ... until they are no longer expected
        batcher.wake()
        future.result(timeout=10)
    assert [calls for calls, _ in engine.calls] == [[1, 2, 3], [4]]
    with RequestBatcher(engine, linger_s=0.2, expect=lambda: 5) as batcher:
        start = time.monotonic()
        batcher.submit([5], sampling).result(timeout=10)
        assert 0.15 < time.monotonic() - start < 10  # never more than linger_s
