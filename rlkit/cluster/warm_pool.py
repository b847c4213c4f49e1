"""Worker processes kept between the runs of one driver process."""

from collections import defaultdict
from typing import Callable

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlkit.cluster.worker_group import WorkerGroup


class WarmPool:
    """Worker processes that outlive the runs of one driver process (a test session, a sweep run
    from one script): a run given the pool takes idle workers of the class it needs and sets them up
    again for its model, layout and rank (the worker's `reset`: its state goes, its process and
    imports stay), starting processes only for what the pool lacks, and gives them back when it
    ends. A worker's start-up (process, torch, transformers, megatron-core: 5-15 s of CPU each) is
    then paid once per pool instead of once per run.

    For CPU runs on this node: pooled workers are pinned to the driver's node, request no CPU and
    sit in no placement group (each run's placement group would die with the run)."""

    def __init__(self):
        self._idle: dict[tuple, list] = defaultdict(list)
        self._kind: dict = {}  # actor -> the key it was started under

    def take(self, role: str, actor_cls: type, variant: str, make_args: Callable[[int], dict], count: int,
             timeout_s: float) -> WorkerGroup:
        """count workers of actor_cls (variant: a setting whose imports differ, e.g. the bridge), rank r
        set up with make_args(r): idle ones reset, the rest started."""
        key = (actor_cls.__qualname__, variant)
        idle = self._idle[key]
        reused = [idle.pop() for _ in range(min(len(idle), count))]
        resets = [actor.reset.remote(make_args(rank)) for rank, actor in enumerate(reused)]
        on_this_node = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        started = [ray.remote(actor_cls).options(num_cpus=0, scheduling_strategy=on_this_node).remote(**make_args(rank))
                   for rank in range(len(reused), count)]
        for actor in started:
            self._kind[actor] = key
        group = WorkerGroup(role, reused + started, timeout_s)
        try:
            group.wait(resets, "reset", ranks=list(range(len(reused))))
        except BaseException:
            self.give_back(group, healthy=False)
            raise
        return group

    def give_back(self, group: WorkerGroup, healthy: bool = True) -> None:
        """The group's workers become idle; those of a run that failed are killed (a worker may have
        died or be stuck in a collective), and their successors start fresh."""
        for actor in group.actors:
            if healthy:
                self._idle[self._kind[actor]].append(actor)
            else:
                del self._kind[actor]
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
