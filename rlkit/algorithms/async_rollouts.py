"""Rollouts that run ahead of training (algorithm.max_staleness), on a fixed schedule.

Weight version v is the policy after v training steps. With max_staleness k the rollout of step
s is generated from version generation_version(s, k): the newest multiple-of-k boundary one step
behind, so the engines take a refit once every k steps and run up to k rollouts ahead of the
trainer (k = 0: version s - 1, today's on-policy step). Because the schedule is a function of the
step alone, a run is reproducible and resumes exactly whatever the timing.

Refits happen between requests: a rollout that needs a newer version is launched only once the
rollouts before it are done; the engines then take the policy's weights, which the trainer holds
still until then (under this schedule those earlier rollouts are the ones the trainer waits for
anyway). Rollouts run on one background thread in step order, so generation of step s + 1..s + k
overlaps training of step s. A checkpoint waits for the launched rollouts and saves them with it
(`pending_rollouts.pt`): they come from weights the checkpoint no longer has.
"""

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Iterator

PENDING_ROLLOUTS = "pending_rollouts.pt"


def generation_version(step: int, max_staleness: int) -> int:
    """The weight version that generates step `step`'s rollout (steps count from 1). Its
    staleness, step - 1 - version, is 0 for k = 0 and cycles through 1..k otherwise."""
    if max_staleness == 0:
        return step - 1
    return max(0, (step - 1) // max_staleness * max_staleness - 1)


@dataclass
class Rollout:
    """One step's episodes and what producing them measured; every sample in it was generated
    from weight_version (samples of one rollout never straddle a refit)."""

    episodes: object  # rlkit.algorithms.episodes.Episodes
    metrics: dict  # sampling metrics, the refit before it (if any), the engines' hand-over
    seconds: dict  # timing/<phase> of its generation, reward, refit and reclaim phases
    weight_version: int | None = None  # set by the pipeline that launched it


class RolloutPipeline:
    """Launches the rollouts whose weights exist, in step order, and hands each to its step.

    roll_out(rows, step) -> Rollout runs on the background thread; refit() -> dict moves the
    policy's current weights into the engines (called on the caller's thread, never while a
    rollout runs)."""

    def __init__(self, max_staleness: int, num_steps: int, roll_out: Callable[[list, int], Rollout],
                 refit: Callable[[], dict]):
        self.max_staleness, self.num_steps = max_staleness, num_steps
        self.roll_out, self.refit = roll_out, refit
        self.launched: dict[int, Future] = {}  # step -> its rollout, until the step takes it
        self.next_step = 1  # the first step whose rollout is not launched
        self.engine_version: int | None = None  # None: the engines do not hold any policy version
        self.oldest_version = 0  # after a resume, the checkpoint's: older weights are gone
        self.thread = _SerialThread()

    def take(self, step: int, trained_version: int, rows: Iterator[list]) -> Rollout:
        """Step `step`'s rollout, after launching every rollout whose weight version exists
        (<= trained_version, the policy's now); each launched step takes next(rows)."""
        while self.next_step <= self.num_steps and \
                (version := max(generation_version(self.next_step, self.max_staleness),
                                self.oldest_version)) <= trained_version:
            refit = {} if version == self.engine_version else self._refit(version, trained_version)
            self.launched[self.next_step] = self.thread.submit(self._roll_out, next(rows), self.next_step,
                                                               version, refit)
            self.next_step += 1
        return self.launched.pop(step).result()

    def engines_at_policy(self, trained_version: int) -> dict:
        """For generation outside the schedule (validation): every launched rollout done, then
        the engines at the policy's version; the refit's metrics ({} if they held it)."""
        self.drain()
        return {} if trained_version == self.engine_version else self._refit(trained_version, trained_version)

    def _refit(self, version: int, trained_version: int) -> dict:
        # the policy holds only its current weights: the schedule never asks for older ones
        assert version == trained_version, f"rollout needs weight version {version}, the policy is at {trained_version}"
        self.drain()
        start = time.perf_counter()
        metrics = self.refit()
        self.engine_version = version
        return {**metrics, "timing/refit": time.perf_counter() - start}

    def drain(self) -> None:
        """Wait for every launched rollout (their errors are raised to the step that takes them)."""
        for future in list(self.launched.values()):
            future.exception()

    def _roll_out(self, rows: list, step: int, version: int, refit: dict) -> Rollout:
        rollout = self.roll_out(rows, step)
        refit = dict(refit)
        rollout.seconds["timing/refit"] = rollout.seconds.get("timing/refit", 0.0) + refit.pop("timing/refit", 0.0)
        rollout.metrics.update(refit)
        rollout.weight_version = version
        return rollout

    def pending(self) -> dict[int, Rollout]:
        """The launched rollouts no step has taken yet, once done (what a checkpoint saves)."""
        self.drain()
        return {step: future.result() for step, future in self.launched.items()}

    def restore(self, pending: dict[int, Rollout], after_step: int) -> None:
        """Continue after `after_step` with a checkpoint's pending rollouts (steps after_step + 1
        on); the engines hold none of the policy's versions until the next refit. Resumed with
        the config it was saved with (the launch refuses another max_staleness or num_steps), no
        later rollout needs weights older than the checkpoint's; any that would is made from its weights."""
        self.drain()
        self.launched = {}
        for step, rollout in sorted(pending.items()):
            self.launched[step] = done = Future()
            done.set_result(rollout)
        self.next_step = after_step + 1 + len(pending)
        self.engine_version = None
        self.oldest_version = after_step

    def close(self) -> None:
        self.thread.close()


class _SerialThread:
    """Jobs run one at a time in submission order on a daemon thread, so a job stuck in a
    worker call never keeps the process from exiting once the run has ended."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, name="rlkit-rollouts", daemon=True).start()

    def submit(self, fn, *args) -> Future:
        future = Future()
        self.jobs.put((future, fn, args))
        return future

    def _run(self):
        while (job := self.jobs.get()) is not None:
            future, fn, args = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # handed to whoever waits for the rollout
                    future.set_exception(e)

    def close(self):
        self.jobs.put(None)
