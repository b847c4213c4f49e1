"""Worker processes kept between the runs of one driver process."""

from collections import defaultdict
from typing import Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlkit.cluster.worker_group import WorkerError, WorkerGroup


class WarmPool:
    """Worker processes that outlive the runs of one driver process (a test session, a sweep run
    from one script): a run given the pool takes idle workers of the class it needs and sets them up
    again for its model, layout and rank (the worker's `reset`: its state goes, its process and
    imports stay), starting processes only for what the pool lacks, and gives them back when it
    ends. A worker's start-up (process, torch, transformers, megatron-core: 5-15 s of CPU each) is
    then paid once per pool instead of once per run.

    For CPU runs on this node: pooled workers are pinned to the driver's node, request no CPU and
    sit in no placement group (each run's placement group would die with the run). They have
    names (warm-pool-...), which a run's own workers have not."""

    def __init__(self):
        self._idle: dict[tuple, list] = defaultdict(list)
        self._kind: dict = {}  # actor -> the key it was started under
        self._class: dict = {}  # actor -> its class
        self._started = 0

    def take(self, role: str, actor_cls: type, variant: str, make_args: Callable[[int], dict], count: int,
             timeout_s: float) -> WorkerGroup:
        """count workers of actor_cls (variant: a setting whose imports differ, e.g. the bridge), rank r
        set up with make_args(r): idle ones reset, the rest started. An idle worker found dead is
        replaced by a new process."""
        key = (actor_cls.__qualname__, variant)
        idle = self._idle[key]
        workers = [idle.pop() for _ in range(min(len(idle), count))]
        resets = [actor.reset.remote(make_args(rank)) for rank, actor in enumerate(workers)]
        for rank, reset in enumerate(resets):
            try:
                ray.get(reset, timeout=timeout_s)
            except ray.exceptions.RayActorError:
                del self._kind[workers[rank]], self._class[workers[rank]]
                workers[rank] = None
            except (ray.exceptions.RayTaskError, ray.exceptions.GetTimeoutError) as e:
                self.give_back(WorkerGroup(role, [w for w in workers if w is not None], timeout_s), healthy=False)
                raise WorkerError(f"{role} worker {rank} (pooled) failed in 'reset' within {timeout_s:.0f}s "
                                  f"(cluster.call_timeout_s):\n{e}") from None
        workers += [None] * (count - len(workers))
        on_this_node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        for rank, actor in enumerate(workers):
            if actor is None:
                # a name tells pooled workers from a run's own (in `ray list actors`, and to tests)
                self._started += 1
                workers[rank] = ray.remote(actor_cls).options(
                    num_cpus=0, scheduling_strategy=on_this_node, name=f"warm-pool-{id(self):x}-{self._started}",
                ).remote(**make_args(rank))
                self._kind[workers[rank]], self._class[workers[rank]] = key, actor_cls
        return WorkerGroup(role, workers, timeout_s)

    def give_back(self, group: WorkerGroup, healthy: bool = True) -> None:
        """The group's workers become idle, each first letting go of what its run set up where its
        class can (`release`: a Megatron worker's process groups and model); those of a run that
        failed, or that fail to release, are killed (a worker may have died or be stuck in a
        collective), and their successors start fresh."""
        if healthy:
            releases = [actor.release.remote() for actor in group.actors if hasattr(self._class[actor], "release")]
            try:
                ray.get(releases, timeout=group.timeout_s)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
                healthy = False  # a rank that cannot let go leaves the whole group suspect, as a failed run does
        for actor in group.actors:
            if healthy:
                self._idle[self._kind[actor]].append(actor)
            else:
                del self._kind[actor], self._class[actor]
                ray.kill(actor)

    @property
    def size(self) -> int:
        """Worker processes the pool holds, idle or taken."""
        return len(self._kind)

    def shutdown(self) -> None:
        for actor in self._kind:
            ray.kill(actor)
        self._idle.clear()
        self._kind.clear()
        self._class.clear()
