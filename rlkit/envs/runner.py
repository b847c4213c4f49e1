"""Environments in Ray actors: parallel, with a per-call timeout, and user bugs contained.

An exception, a timeout or a malformed return in user code becomes a recorded failure for that
sample (reward = env_runner.failure_reward), never a crashed or hung run. With
env_runner.fail_fast the first failure is raised instead, and so is the first fault an
environment answered anyway (EnvStep.faults: a tool that raised or hung), in one line. Each
worker's environment steps one call at a time: a batch of calls is spread over the workers
(EnvironmentPool.step), single calls of independent trajectories each take a free worker
(ConcurrentSteps).
"""

import asyncio
import logging
import os
import sys
import time
import traceback
from concurrent.futures import Executor, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import ray

from rlkit.config.schema import EnvRunnerConfig
from rlkit.envs.base import EnvStep, as_env_step, load_environment, start_services

log = logging.getLogger("rlkit")


@dataclass(frozen=True)
class StepOutcome:
    step: EnvStep | None  # None when the call failed
    failure: str | None = None  # "exception" | "timeout" | "malformed"
    detail: str = ""  # traceback or message
    seconds: float = 0.0  # how long step() ran (a timed-out call: the whole timeout)


def safe_step(env, messages: list[dict], metadata: dict, timeout_s: float,
              executor: Executor) -> tuple[StepOutcome, bool]:
    """Run env.step in `executor` with a timeout. Returns (outcome, executor_is_stuck)."""
    start = time.perf_counter()
    future = executor.submit(env.step, messages, metadata)
    try:
        value = future.result(timeout=timeout_s)
    except FutureTimeout:
        if future.done():  # step() raised TimeoutError itself (its own wait ran out, e.g. on a model server)
            return StepOutcome(None, "timeout", traceback.format_exc(), time.perf_counter() - start), False
        return StepOutcome(None, "timeout", f"step() did not return within {timeout_s}s "
                                            "(env_runner.timeout_s)", timeout_s), True
    except Exception:  # noqa: BLE001 - user code may raise anything
        return StepOutcome(None, "exception", traceback.format_exc(), time.perf_counter() - start), False
    seconds = time.perf_counter() - start
    try:
        return StepOutcome(as_env_step(value), seconds=seconds), False
    except TypeError as e:
        return StepOutcome(None, "malformed", str(e), seconds), False


@dataclass(frozen=True)
class Stepped:
    """One call's answer to its episode: the environment's step (a failed call's: failure_reward,
    done), the env/ failure counts it adds, and how long step() ran in its worker."""
    step: EnvStep
    counts: dict[str, int]
    seconds: float


# each failed call counts in env/failures and under its kind
FAILURE_COUNTS = {"timeout": "env/timeouts", "exception": "env/exceptions", "malformed": "env/malformed"}
NO_FAILURES = {"env/failures": 0, **{key: 0 for key in FAILURE_COUNTS.values()}}


class EnvWorker:
    """One environment instance in its own process. A call stuck in user code is abandoned
    (its thread cannot be killed); the controller replaces a worker that reports one. services:
    the pool's (Environment.start_services), for the environment's setup."""

    def __init__(self, target: str, kwargs: dict, timeout_s: float, python_path: str = "",
                 services: dict | None = None):
        if python_path:  # as the driver's: for this import, and for any Python the environment starts
            sys.path[:0] = [p for p in python_path.split(os.pathsep) if p not in sys.path]
            os.environ["PYTHONPATH"] = python_path
        self.env = load_environment(target, kwargs)
        self.env.services = services or {}
        self.env.setup()
        self.timeout_s = timeout_s

    def ready(self) -> bool:
        return True

    def step_many(self, items: list[tuple[list[dict], dict]]) -> tuple[list[StepOutcome], bool]:
        executor, stuck = ThreadPoolExecutor(max_workers=1), False
        outcomes = []
        for messages, metadata in items:
            outcome, executor_stuck = safe_step(self.env, messages, metadata, self.timeout_s, executor)
            outcomes.append(outcome)
            if executor_stuck:
                stuck = True
                executor = ThreadPoolExecutor(max_workers=1)
        return outcomes, stuck


class EnvironmentFailure(RuntimeError):
    pass


class EnvironmentPool:
    """The controller's handle on the environment workers (Ray actors, env_runner.num_workers)."""

    def __init__(self, env_cfg: dict, cfg: EnvRunnerConfig):
        self.target = env_cfg["_target_"]
        self.kwargs = {k: v for k, v in env_cfg.items() if k != "_target_"}
        self.cfg = cfg
        # user modules next to where rlkit was launched must import inside the actors too (set by
        # each actor rather than by a runtime_env, which costs each actor's start Ray's setup_worker.py)
        self.python_path = os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH", "")] if p)
        # num_cpus=0: environments are light, and the placement group may hold every CPU of the
        # cluster for policy and generation workers
        self._remote = ray.remote(num_cpus=0)(EnvWorker)
        self.services = start_services(self.target, self.kwargs)
        self.workers = [self._spawn() for _ in range(cfg.num_workers)]
        self._logged_failure = False
        # an environment that cannot start (e.g. the code sandbox without bubblewrap) stops the run
        # here, before any training, rather than failing every sample
        try:
            ray.get([worker.ready.remote() for worker in self.workers])
        except ray.exceptions.RayActorError as e:
            self.shutdown()
            raise EnvironmentFailure(f"environment {self.target} could not start: {e}") from e

    def _spawn(self):
        return self._remote.remote(self.target, self.kwargs, self.cfg.timeout_s, self.python_path, self.services)

    def step(self, items: list[tuple[list[dict], dict]]) -> list[Stepped]:
        """One step for each (messages, metadata), in order; failed calls get
        env_runner.failure_reward."""
        n = len(self.workers)
        chunks = [items[i::n] for i in range(n)]
        refs = [w.step_many.remote(chunk) for w, chunk in zip(self.workers, chunks)]
        outcomes: list[StepOutcome | None] = [None] * len(items)
        for i, (ref, chunk) in enumerate(zip(refs, chunks)):
            try:
                results, stuck = ray.get(ref, timeout=self._call_timeout(len(chunk)))
            except Exception as e:  # noqa: BLE001 - a dead or wedged worker fails its samples, not the run
                results, stuck = [self._worker_failed(i, e)] * len(chunk), True
            if stuck:
                self._replace(i)
            for j, outcome in enumerate(results):
                outcomes[i + j * n] = outcome
        return [self._resolve(outcome) for outcome in outcomes]

    def concurrent_steps(self) -> "ConcurrentSteps":
        """For one rollout whose trajectories step independently (env_runner.flow=per_trajectory)."""
        return ConcurrentSteps(self)

    def _call_timeout(self, calls: int) -> float:
        return self.cfg.timeout_s * (calls + 1) + 30

    @staticmethod
    def _worker_failed(i: int, error: Exception) -> StepOutcome:
        return StepOutcome(None, "exception", f"environment worker {i} failed: {error}")

    def _replace(self, i: int) -> None:
        ray.kill(self.workers[i])
        self.workers[i] = self._spawn()

    def _resolve(self, outcome: StepOutcome) -> Stepped:
        if outcome.step is not None:
            if self.cfg.fail_fast and outcome.step.faults:
                raise EnvironmentFailure(f"environment {self.target}: {outcome.step.faults[0]}; env_runner.fail_fast "
                                         f"is on: fix it, or set env_runner.fail_fast=false to answer such calls "
                                         f"with an error and count them (tools/*)")
            return Stepped(outcome.step, {}, outcome.seconds)
        if self.cfg.fail_fast:
            raise EnvironmentFailure(f"environment {self.target} failed ({outcome.failure}); "
                                     f"env_runner.fail_fast is on:\n{outcome.detail}")
        if not self._logged_failure:
            log.warning("environment %s failed (%s); scoring such samples %s and counting them in "
                        "env/failures. First failure:\n%s", self.target, outcome.failure,
                        self.cfg.failure_reward, outcome.detail)
            self._logged_failure = True
        return Stepped(EnvStep(reward=self.cfg.failure_reward, done=True),
                       {"env/failures": 1, FAILURE_COUNTS[outcome.failure]: 1}, outcome.seconds)

    def shutdown(self):
        for actor in [*self.workers, *self.services.values()]:
            ray.kill(actor)


class ConcurrentSteps:
    """Single step calls of one rollout's trajectories, each on the first free worker: calls run
    side by side on different workers, so a slow call holds up its own trajectory alone. Used
    within one event loop (one rollout); timeouts, failures and the replacement of a stuck
    worker are EnvironmentPool.step's."""

    def __init__(self, pool: EnvironmentPool):
        self.pool = pool
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for i in range(len(pool.workers)):
            self.free.put_nowait(i)

    async def step(self, messages: list[dict], metadata: dict) -> Stepped:
        i = await self.free.get()
        try:
            (outcome,), stuck = await asyncio.wait_for(self.pool.workers[i].step_many.remote([(messages, metadata)]),
                                                       self.pool._call_timeout(1))
        except Exception as e:  # noqa: BLE001 - a dead or wedged worker fails its call, not the run
            outcome, stuck = self.pool._worker_failed(i, e), True
        if stuck:
            self.pool._replace(i)
        self.free.put_nowait(i)
        return self.pool._resolve(outcome)
