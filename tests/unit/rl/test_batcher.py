"""The request batcher (llmtune.rl.batcher) in front of the real hf engine on a tiny model: requests from many
threads are sampled in batches, each caller gets the completion of its own prompt (the one a direct engine call
gives), batches never mix sampling settings or policy versions, and the engine's errors reach every caller; a request
with its own seed draws the same completion whatever shares its batch, and the engine stays in one session while the
batcher runs."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from llmtune.rl.batcher import RequestBatcher
from llmtune.rl.engines.base import BackgroundEngine, RolloutEngine
from llmtune.rl.types import Completion, SamplingParams
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


def sampled(tok, n=12):
    return SamplingParams(max_new_tokens=n, stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),), temperature=0.9)


def test_a_seeded_request_draws_the_same_completion_whatever_shares_its_batch(tok, engine):
    """Batches form as requests arrive (timing); a request with its own seed is sampled from that seed only: alone,
    or in the middle of a batch of others, it gets the same completion (hf: one generator per prompt)."""
    prompts = prompt_ids(tok, TEXTS[:4])
    with RequestBatcher(engine) as batcher:
        alone = batcher.generate(prompts[0], sampled(tok), seed=7).token_ids
        futures = batcher.submit_many([prompts[1], prompts[0], prompts[2]], sampled(tok), seeds=[1, 7, 2])
        together = [f.result().token_ids for f in futures]
        other = batcher.generate(prompts[0], sampled(tok), seed=8).token_ids
    assert batcher.sizes == [1, 3, 1]  # submit_many queues its requests at once: one batch
    assert together[1] == alone and other != alone


class SessionEngine(RolloutEngine):
    """Records the order of session enter/exit and generate calls."""

    def __init__(self):
        self.events = []

    @contextlib.contextmanager
    def session(self):
        self.events.append("enter")
        yield
        self.events.append("exit")

    def generate(self, prompts, sampling, budgets=None, keys=None, version=None, seeds=None):
        self.events.append(("generate", len(prompts), seeds))
        return [Completion([1], None, "stop", 0) for _ in prompts]

    def sync(self, version):
        pass

    def close(self):
        pass


def test_the_engine_stays_in_one_session_while_the_batcher_runs(tok):
    """A colocated vLLM engine that sleeps between rollout batches must not sleep between the many calls of one
    multi-turn batch: with session=True the batcher holds the engine's session from start to close (never without
    it). Seeds reach an engine that takes them (and a batch without any goes without)."""
    engine = SessionEngine()
    engine.seeds_per_prompt = True
    with RequestBatcher(engine, linger_s=0.5, session=True) as batcher:
        batcher.submit_many([[1], [2]], greedy(tok), seeds=[3, None])[1].result()
        batcher.generate([1], greedy(tok))
    assert engine.events == ["enter", ("generate", 2, [3, None]), ("generate", 1, None), "exit"]
    engine.events.clear()
    with RequestBatcher(engine) as batcher:  # no session unless asked: a batcher may outlive a policy update
        batcher.generate([1], greedy(tok))
    assert engine.events == [("generate", 1, None)]


def test_several_calls_in_flight_only_for_an_engine_in_another_process(tok, engine):
    with pytest.raises(ValueError, match="workers must be 1 for an engine in this process"):
        RequestBatcher(engine, workers=2)


def test_the_hf_engine_merges_its_adapter_once_per_session(tok, engine, monkeypatch):
    """Inside the batcher's session the LoRA adapter is merged once (not once per call): the same completions as
    calls outside, and the frozen base weights put back bit for bit at the end."""
    import torch

    from llmtune.rl.engines import hf

    merges = []
    real = hf.merged_lora
    monkeypatch.setattr(hf, "merged_lora", lambda *a: merges.append(1) or real(*a))
    prompts = prompt_ids(tok, TEXTS[:3])
    alone = [engine.generate([p], sampled(tok), seeds=[5])[0].token_ids for p in prompts]
    merges.clear()
    weights = {n: p.detach().clone() for n, p in engine.policy.model.named_parameters() if "base_layer" in n}
    with RequestBatcher(engine, session=True) as batcher:
        got = [batcher.generate(p, sampled(tok), seed=5).token_ids for p in prompts]  # three calls
    assert got == alone and merges == [1] and batcher.calls == 3
    assert all(torch.equal(p, weights[n]) for n, p in engine.policy.model.named_parameters() if n in weights)


def test_a_quiet_gap_gathers_requests_that_trickle_in(tok):
    """linger_max_s makes linger_s a quiet gap: requests 0.4 s apart (a wave of tool results coming back one by one)
    go together although the wave lasts longer than linger_s; linger_max_s still bounds the wait."""
    def trickle(batcher, n):
        futures = []
        for i in range(n):
            futures.append(batcher.submit([i + 1], greedy(tok)))
            time.sleep(0.4)
        return [f.result() for f in futures]

    with RequestBatcher(SessionEngine(), linger_s=1.0, linger_max_s=30.0) as batcher:
        trickle(batcher, 4)
    assert batcher.sizes == [4]
    with RequestBatcher(SessionEngine(), linger_s=1.0, linger_max_s=1.4) as batcher:
        trickle(batcher, 6)  # 2.0 s of requests, at most 1.4 s of waiting
    assert batcher.sizes[0] in (3, 4) and sum(batcher.sizes) == 6


class SlowServer(SessionEngine, BackgroundEngine):
    """An engine in another process (a stand-in): each call takes 0.3 s; records how many run at once."""

    def __init__(self):
        super().__init__()
        self.lock, self.running, self.most = threading.Lock(), 0, 0

    def generate(self, prompts, sampling, budgets=None, keys=None, version=None, seeds=None):
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        time.sleep(0.3)
        with self.lock:
            self.running -= 1
        return super().generate(prompts, sampling, budgets, keys, version, seeds)

    def snapshot(self, version):
        raise NotImplementedError

    def push(self, snapshot):
        raise NotImplementedError


def test_several_workers_keep_several_calls_in_flight(tok):
    """workers=2 on an engine in another process: two calls (versions 0 and 1: never one batch) run at once, each
    caller gets its own completion; with a linger, a worker that finds the requests taken by the other goes back
    to waiting."""
    engine = SlowServer()
    with RequestBatcher(engine, workers=2, linger_s=0.05, linger_max_s=0.2) as batcher:
        futures = [batcher.submit([1], greedy(tok), version=v) for v in (0, 1, 0, 1)]
        assert [f.result().token_ids for f in futures] == [[1]] * 4
        more = batcher.submit_many([[2]] * 3, greedy(tok))
        assert [f.result().token_ids for f in more] == [[1]] * 3
    assert engine.most == 2 and sorted(batcher.sizes) == [2, 2, 3]
