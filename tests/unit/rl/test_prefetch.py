"""The background sampler of asynchronous rollouts (llmtune.rl.prefetch): what is submitted with which adapter, what a
checkpoint keeps and restores, and the staleness guard the trainer applies to every rollout. The real engine and the
whole loop: tests/integration/test_async_rollouts.py."""

import threading
from types import SimpleNamespace

import pytest

from llmtune.rl.prefetch import RolloutPrefetcher, load_snapshots, save_snapshots
from llmtune.rl.rollouts import Rollouts
from llmtune.rl.types import AdapterSnapshot, RolloutBatch, SamplingParams, Trajectory


def snap(version):
    weights = bytes([version]) * 8
    import hashlib

    return AdapterSnapshot(version, {"peft_type": "LORA", "r": 4}, weights, hashlib.sha256(weights).hexdigest())


class Engine:
    """Records pushes; sampling (the prefetcher's sample function below) records the version it samples with."""

    def __init__(self):
        self.pushed, self.background = [], False

    def push(self, snapshot):
        self.pushed.append(snapshot.version)


def test_batches_are_sampled_ahead_with_the_adapter_of_the_step_they_were_submitted_at():
    engine, sampled = Engine(), []
    release = threading.Event()

    def sample(rows, groups, sampling, version):
        release.wait(5)
        sampled.append((rows[0], version, sampling.seed))
        return [Trajectory({"i": rows[0]}, [1], [2], [1], [-0.1], version, "stop")]

    plan = lambda j: ([j], [0], SamplingParams(4, (2,), seed=100 + j))  # noqa: E731
    p = RolloutPrefetcher(engine, sample, lookahead=1, iterations=3)
    assert engine.background  # an engine sampling in the background never sleeps
    snapshots = []
    p.schedule(0, plan, lambda: snapshots.append(0) or snap(0))  # iterations 0 and 1, from the policy of step 0
    assert sorted(p.untaken()) == [0, 1] and snapshots == [0]  # one snapshot for both
    release.set()
    got, waited = p.take(0)
    assert (got.iteration, got.version, waited >= 0) == (0, 0, True)
    p.schedule(1, plan, lambda: snap(1))  # iteration 1 already submitted; iteration 2 from the policy of step 1
    assert {j: s.version for j, s in p.untaken().items()} == {1: 0, 2: 1}
    p.schedule(2, plan, lambda: pytest.fail("nothing past the last iteration"))  # (iteration 3 does not exist)
    assert p.take(1)[0].version == 0 and p.take(2)[0].version == 1
    assert sampled == [(0, 0, 100), (1, 0, 101), (2, 1, 102)] and engine.pushed == [0, 0, 1]
    p.close()


def test_a_sampling_error_is_raised_when_its_batch_is_taken():
    def sample(rows, groups, sampling, version):
        raise RuntimeError("the server went away")

    p = RolloutPrefetcher(Engine(), sample, lookahead=1, iterations=2)
    p.schedule(0, lambda j: ([j], [0], SamplingParams(4, (2,), seed=j)), lambda: snap(0))
    p.drain()  # waits, does not raise
    with pytest.raises(RuntimeError, match="went away"):
        p.take(0)
    p.close()


def test_a_checkpoint_keeps_the_adapters_of_the_batches_in_flight_and_a_resumed_run_uses_them(tmp_path):
    save_snapshots(tmp_path, {3: snap(2), 4: snap(3), 5: snap(3)})
    assert len(list((tmp_path / "rollout_snapshots").glob("v*"))) == 2  # one adapter per version
    restored = load_snapshots(tmp_path)
    assert {j: s.version for j, s in restored.items()} == {3: 2, 4: 3, 5: 3} and restored[3] == snap(2)
    engine, versions = Engine(), []
    p = RolloutPrefetcher(engine, lambda rows, groups, sampling, version: versions.append(version) or [],
                          lookahead=2, iterations=10)
    p.restore(restored)
    p.schedule(3, lambda j: ([j], [0], SamplingParams(4, (2,), seed=j)), lambda: snap(9))
    for j in (3, 4, 5):
        p.take(j)
    assert versions == [2, 3, 3]  # sampled again from the adapters they were first sampled with, not the current
    p.close()
    # a damaged snapshot is refused, naming it
    weights = tmp_path / "rollout_snapshots" / "v2" / "adapter_model.safetensors"
    weights.write_bytes(b"x" * 8)
    with pytest.raises(ValueError, match="the checkpoint is damaged"):
        load_snapshots(tmp_path)
    assert load_snapshots(tmp_path / "elsewhere") == {}  # a synchronous run's checkpoint


def test_rollouts_beyond_the_bound_are_never_trained_on():
    def batch(versions):
        trajectories = [Trajectory({}, [1], [2, 3], [1, 1], None, v, "stop") for v in versions]
        return RolloutBatch.from_trajectories(trajectories, 0)

    rollouts = SimpleNamespace(prefetch=object(), max_staleness=2)
    stale = Rollouts.too_stale(rollouts, batch([5, 4, 3, 2, None]), step=5)
    assert stale.tolist() == [False, False, False, True, True]  # 3 steps stale, and an unknown version
    rollouts.prefetch = None  # synchronous: every rollout is of the current policy
    assert Rollouts.too_stale(rollouts, batch([5, 0]), step=5).tolist() == [False, False]
