"""Several trainer ranks and several rollout servers, over real HTTP against the server's own handler
(tests/unit/rl/stand_in_server.py): requests that arrive while the engine is busy run as one batch; an engine over
several servers sends every key to one server always (the turns of one trajectory, the prompts of one group) and
pushes each version to all; a rank that does not upload waits for the version rank 0 uploads, and a rank whose
adapter differs from the one served is refused."""

import threading
import time

import pytest

from llmtune.rl.engines import Policy
from llmtune.rl.engines.vllm_client import RolloutEngineError, VLLMClient
from llmtune.rl.engines.vllm_engine import VLLMEngine, VLLMSettings
from llmtune.rl.types import SamplingParams
from tests.unit.rl.stand_in_server import SECRET, RecordingCore, serve

SAMPLING = SamplingParams(4, (99,), temperature=1.0, seed=123)


@pytest.fixture(scope="module")
def policy():
    from peft import LoraConfig, get_peft_model

    from llmtune.models.tiny import make_tiny_llama

    return get_peft_model(make_tiny_llama(), LoraConfig(r=4, target_modules="all-linear"))


def engine(ports, policy, version=0, **kwargs):
    clients = [VLLMClient(f"http://127.0.0.1:{p}", 10, secret=SECRET) for p in ports]
    return VLLMEngine(clients, Policy(policy, "default", lambda: version), VLLMSettings(request_timeout_s=10),
                      **kwargs)


def test_requests_arriving_while_the_engine_runs_are_one_batch_and_fail_alone(policy):
    gate = threading.Event()
    with serve(RecordingCore(gate), max_adapter_bytes=16 << 20) as (port, core):
        e = engine([port], policy)
        e.sync(0)
        answers = {}

        def ask(name, prompts, version=0):
            try:
                if version == 0:
                    answers[name] = [c.token_ids for c in e.generate(prompts, SAMPLING)]
                else:  # straight to the server: a version it does not hold
                    request = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": 4, "stop_token_ids": [99],
                               "seeds": [1] * len(prompts)}
                    answers[name] = e.client.generate(prompts, version, request, adapter_id=e.adapter["adapter_id"])
            except RolloutEngineError as exc:
                answers[name] = str(exc)

        first = threading.Thread(target=ask, args=("first", [[1, 2]]))
        first.start()
        time.sleep(0.3)  # the engine is busy with "first" (the gate is closed)
        queued = [threading.Thread(target=ask, args=(n, p, v)) for n, p, v in
                  (("second", [[3], [4]], 0), ("stale", [[7]], 5), ("third", [[5]], 0))]
        for t in queued:
            t.start()
        time.sleep(0.3)
        gate.set()
        for t in [first, *queued]:
            t.join(10)
    assert answers["first"] == [[2]] and answers["second"] == [[3], [4]] and answers["third"] == [[5]]
    assert "stale rollout weights: not holding" in answers["stale"]  # the server's 409, for this request only
    # one engine call for "first", then ONE for everything that queued behind it (the stale request alone failed)
    assert len(core.generated) == 2 and core.generated[0] == [[1, 2]]
    assert sorted(map(tuple, core.generated[1])) == [(3,), (4,), (5,)]


@pytest.mark.parametrize("rank", [0, 1])
def test_an_engine_over_two_servers_sends_each_key_to_one_server(policy, rank):
    with serve(max_adapter_bytes=16 << 20) as (p0, core0), serve(max_adapter_bytes=16 << 20) as (p1, core1):
        e = engine([p0, p1], policy, rank=rank)
        e.sync(0)
        assert [a for _, a, _ in core0.loaded] == [a for _, a, _ in core1.loaded] == [e.adapter["adapter_id"]]
        prompts = [[10 + b] for b in range(6)]
        keys = [0, 0, 1, 1, 2, 3]
        for _ in range(2):  # the same keys go to the same servers on every call (every turn)
            out = e.generate(prompts, SAMPLING, keys=keys)
            assert [c.token_ids for c in out] == [[10 + b] for b in range(6)]  # answers back in order
        want0 = [[10 + b] for b in range(6) if (keys[b] + rank) % 2 == 0]
        want1 = [[10 + b] for b in range(6) if (keys[b] + rank) % 2 == 1]
        assert core0.generated == [want0, want0] and core1.generated == [want1, want1]


def test_a_rank_that_does_not_upload_waits_for_rank_0_and_checks_its_bytes(policy):
    with serve(max_adapter_bytes=16 << 20) as (port, core):
        rank0 = engine([port], policy)
        rank1 = engine([port], policy, pushes=False, rank=1)
        rank1.token = rank0.token  # shared_token: one identity per version for the ranks of one run
        snapshot = rank0.snapshot(0)
        rank1.push(snapshot)  # records the identity, uploads nothing
        assert core.loaded == []
        late = threading.Timer(0.5, rank0.push, args=(snapshot,))
        late.start()
        start = time.monotonic()
        out = rank1.generate([[1, 2]], SAMPLING)  # 409 until rank 0's upload arrives, then served
        late.join()
        assert time.monotonic() - start >= 0.4 and [c.token_ids for c in out] == [[2]]
        assert len(core.loaded) == 1  # one upload for both ranks
        # a rank whose adapter differs from the one rank 0 uploaded (diverged policies) is refused
        rank1.adapter = {**rank1.adapter, "sha256": "0" * 64}
        with pytest.raises(RolloutEngineError, match="the ranks' policies diverged"):
            rank1.generate([[1, 2]], SAMPLING)


def test_seeds_given_per_prompt_reach_the_server_as_they_are(policy):
    """A prompt's own seed (a request of the batcher with a seed: issue 41's endpoint) is the one the server samples
    it with, whatever it is batched with; without seeds they are drawn from ``sampling.seed``, by position."""
    with serve(max_adapter_bytes=16 << 20) as (port, core):
        e = engine([port], policy)
        e.sync(0)
        e.generate([[1], [2]], SAMPLING, seeds=[11, 22])
        e.generate([[2]], SAMPLING, seeds=[22])
        e.generate([[1], [2]], SAMPLING)
        e.generate([[2], [1]], SAMPLING)
    assert core.seeds[:2] == [[11, 22], [22]]
    drawn = core.seeds[2:]
    assert drawn[0] == drawn[1] and drawn[0] != [11, 22]  # by position from sampling.seed: not the prompt's own
