"""The async rollout schedule and pipeline (rlkit/algorithms/async_rollouts.py): which weights
generate each step, refits only between rollouts, errors raised to the step, and a checkpoint's
pending rollouts continuing exactly."""

import threading
import time

import pytest

from rlkit.algorithms.async_rollouts import Rollout, RolloutPipeline, generation_version


@pytest.mark.parametrize("k, versions", [
    (0, [0, 1, 2, 3, 4, 5, 6]),
    (1, [0, 0, 1, 2, 3, 4, 5]),
    (2, [0, 0, 1, 1, 3, 3, 5]),
    (3, [0, 0, 0, 2, 2, 2, 5]),
])
def test_generation_version_by_hand(k, versions):
    assert [generation_version(step, k) for step in range(1, 8)] == versions


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_staleness_is_at_most_k_and_reaches_it(k):
    staleness = [step - 1 - generation_version(step, k) for step in range(k + 2, 60)]
    assert set(staleness) == set(range(1, k + 1))


class FakeEngines:
    """Stands in for the generation workers and the trainer's weights (the pipeline is under test):
    a rollout records the version the engines hold; a refit copies the policy's version."""

    def __init__(self, rollout_seconds=0.0, fail_at=None):
        self.policy_version, self.engine_version = 0, None
        self.rollout_seconds, self.fail_at = rollout_seconds, fail_at
        self.busy = threading.Event()
        self.log = []

    def roll_out(self, rows, step):
        assert not self.busy.is_set()
        self.busy.set()
        time.sleep(self.rollout_seconds)
        self.log.append(("rollout", step, self.engine_version, rows))
        self.busy.clear()
        if step == self.fail_at:
            raise RuntimeError(f"engine died in step {step}")
        return Rollout(episodes=rows, metrics={"made_from": self.engine_version}, seconds={})

    def refit(self):
        assert not self.busy.is_set(), "a refit ran while a rollout was generating"
        self.log.append(("refit", self.policy_version))
        self.engine_version = self.policy_version
        return {"refit/buckets": 1}


def run(pipeline, engines, steps, first=1):
    rows = iter(range(100 * first, 1000))
    taken = {}
    for step in range(first, steps + 1):
        taken[step] = pipeline.take(step, engines.policy_version, rows)
        time.sleep(0.01)  # training: the engines may generate meanwhile
        engines.policy_version = step
    return taken


@pytest.mark.parametrize("k", [0, 1, 2])
def test_each_rollout_is_made_from_its_scheduled_version_and_refits_only_between_rollouts(k):
    engines = FakeEngines(rollout_seconds=0.02)
    pipeline = RolloutPipeline(k, 7, engines.roll_out, engines.refit)
    taken = run(pipeline, engines, 7)
    for step, rollout in taken.items():
        assert rollout.weight_version == rollout.metrics["made_from"] == generation_version(step, k)
    refits = [entry[1] for entry in engines.log if entry[0] == "refit"]
    assert refits == sorted(set(generation_version(step, k) for step in range(1, 8)))  # once per version
    assert [rollout.episodes for rollout in taken.values()] == list(range(100, 107))  # rows in step order
    pipeline.close()


def test_with_staleness_the_next_rollout_is_generated_while_the_step_trains():
    engines = FakeEngines(rollout_seconds=0.05)
    pipeline = RolloutPipeline(1, 3, engines.roll_out, engines.refit)
    rows = iter(range(10))
    pipeline.take(1, 0, rows)
    # step 1 "trains" (nothing more is asked of the pipeline); step 2's rollout (version 0) is
    # generated meanwhile. Waited for, not slept on: the suite runs this tier at idle priority
    deadline = time.monotonic() + 60
    while ("rollout", 2, 0, 1) not in engines.log and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ("rollout", 2, 0, 1) in engines.log
    pipeline.close()


def test_a_failed_rollout_is_raised_to_its_step():
    engines = FakeEngines(fail_at=2)
    pipeline = RolloutPipeline(1, 4, engines.roll_out, engines.refit)
    with pytest.raises(RuntimeError, match="engine died in step 2"):
        run(pipeline, engines, 4)
    pipeline.close()


@pytest.mark.parametrize("k", [1, 2])
def test_pending_rollouts_restored_continue_exactly(k):
    """A checkpoint after step 2 saves the rollouts launched ahead; a fresh pipeline restored
    from them gives the same rollouts for the remaining steps as the uninterrupted run."""
    engines = FakeEngines()
    uninterrupted = run(RolloutPipeline(k, 6, engines.roll_out, engines.refit), engines, 6)

    engines = FakeEngines()
    first = RolloutPipeline(k, 6, engines.roll_out, engines.refit)
    rows = iter(range(100, 1000))
    for step in (1, 2):
        first.take(step, engines.policy_version, rows)
        engines.policy_version = step
    pending = first.pending()
    assert sorted(pending) == [s for s in range(3, 7) if generation_version(s, k) <= 1]
    first.close()

    resumed = RolloutPipeline(k, 6, engines.roll_out, engines.refit)
    resumed.restore(pending, after_step=2)
    engines.engine_version = None  # a restarted run's engines hold no policy version
    rest = iter(range(100 + 2 + len(pending), 1000))  # the row stream's checkpointed state
    for step in range(3, 7):
        rollout = resumed.take(step, engines.policy_version, rest)
        engines.policy_version = step
        assert (rollout.episodes, rollout.weight_version) == (uninterrupted[step].episodes,
                                                              uninterrupted[step].weight_version)
    resumed.close()


def test_resumed_with_more_staleness_the_rollouts_never_need_weights_older_than_the_checkpoint():
    """A checkpoint saved on-policy (no pending rollouts) resumed with max_staleness=2: steps
    whose scheduled version predates the checkpoint are made from the checkpoint's weights."""
    engines = FakeEngines()
    engines.policy_version = 4
    pipeline = RolloutPipeline(2, 9, engines.roll_out, engines.refit)
    pipeline.restore({}, after_step=4)
    taken = run(pipeline, engines, 9, first=5)
    assert {step: r.weight_version for step, r in taken.items()} == {5: 4, 6: 4, 7: 5, 8: 5, 9: 7}
    pipeline.close()
