"""WorkerGroup: N Ray actors of one role placed on a placement group, with explicit dispatch.

Methods are named by the worker interface's own function (`group.every_rank(TrainingBackend.sleep)`),
never by a string, so an editor and a reader can follow a call to the code it runs."""

import re
import socket
import time
import weakref
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


Method = Callable  # a function of the worker's interface, e.g. TrainingBackend.sleep


class WorkerError(RuntimeError):
    pass


_LIVE_GROUPS: "weakref.WeakSet[WorkerGroup]" = weakref.WeakSet()  # to name a dead worker of another group


# A worker killed inside a collective first shows up as its peers' errors ("connection closed by
# peer"); Ray reports the death itself a moment later. This long is given to see it.
DEATH_GRACE_S = 5.0


def free_address() -> tuple[str, int]:
    """A free TCP port on the address of this process's Ray node, for a rendezvous there."""
    address = ray.util.get_node_ip_address()
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET) as s:
        s.bind((address, 0))
        return address, s.getsockname()[1]


_free_address_task = ray.remote(num_cpus=0)(free_address)


def rendezvous_address(placement_group, bundle_index: int) -> tuple[str, int]:
    """free_address on the node of a bundle of the placement group."""
    strategy = PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=bundle_index)
    return ray.get(_free_address_task.options(scheduling_strategy=strategy).remote())


@ray.remote(num_cpus=0)
def _gpu_id() -> str:
    return str(ray.get_gpu_ids()[0])


def bundle_gpu_ids(placement_group, bundle_indices: list[int]) -> list[str]:
    """The GPU (its id on its node, as CUDA_VISIBLE_DEVICES names it) of each bundle: for a
    process that spans several bundles' GPUs, which Ray's per-actor accounting cannot give it.
    The probe asks for a sliver of the GPU, which every bundle has left at start-up."""
    probes = [_gpu_id.options(num_gpus=0.01, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group, placement_group_bundle_index=bundle)).remote() for bundle in bundle_indices]
    return ray.get(probes)


class WorkerGroup:
    def __init__(self, role: str, actors: list, timeout_s: float):
        """A group of started actors (rank i: actors[i]); see start."""
        self.role, self.actors, self.timeout_s = role, list(actors), timeout_s
        _LIVE_GROUPS.add(self)

    @classmethod
    def start(cls, role: str, actor_cls: type, placement_group, bundle_indices: list[int], share: float,
              device: str, make_args: Callable[[int], dict], timeout_s: float,
              gpu_share: float | None = None) -> "WorkerGroup":
        """Actor i of actor_cls(**make_args(i)) on bundle bundle_indices[i], with share of its resources
        (gpu_share of a GPU where the bundle holds less than a whole one: Placement.gpu_share)."""
        remote_cls = ray.remote(actor_cls)
        return cls(role, [
            remote_cls.options(
                num_cpus=share, num_gpus=(share if gpu_share is None else gpu_share) if device == "GPU" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group,
                                                                     placement_group_bundle_index=bundle),
            ).remote(**make_args(rank))
            for rank, bundle in enumerate(bundle_indices)
        ], timeout_s)

    def __len__(self) -> int:
        return len(self.actors)

    def wait(self, refs: list, what: str, ranks: list[int] | None = None) -> list:
        """Results of refs (in order) within the group's timeout. The first worker to die or fail
        ends the wait, as one error naming it: peers blocked in a collective with it are not waited
        for, and a peer's death outranks the errors it causes in others (the error names the cause).
        ranks[i] is the worker refs[i] came from (default: one ref per worker)."""
        ranks = list(ranks or range(len(refs)))
        owner = {ref: rank for ref, rank in zip(refs, ranks)}
        deadline = time.monotonic() + self.timeout_s
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0.0))
            if not ready:
                late = sorted({owner[r] for r in pending})
                raise WorkerError(f"{self.role} worker(s) {late} did not finish '{what}' within "
                                  f"{self.timeout_s:.0f}s (cluster.call_timeout_s)")
            rank = owner[ready[0]]
            try:
                ray.get(ready[0])
            except RayActorError as e:
                raise WorkerError(f"{self._who_died(e, rank)} died during '{what}': {e}") from None
            except RayTaskError as e:
                death = self._first_death(pending, owner, deadline)
                if death is not None:
                    dead_rank, cause = death
                    raise WorkerError(f"{self.role} worker {dead_rank} died during '{what}': {cause}\n"
                                      f"(worker {rank} then failed: {e.cause!r})") from None
                raise WorkerError(f"{self.role} worker {rank} failed in '{what}':\n{e}") from None
        return ray.get(list(refs))

    def _who_died(self, error: RayActorError, rank: int) -> str:
        """Which worker the error is about: this group's worker `rank`, or, when that worker's call
        could not start because an input came from a worker that died (a refit bucket from a
        policy rank), the dead worker of the group it belongs to."""
        # the dead actor's id: the error's own, or the one of the input's error it quotes
        dead = {getattr(error, "actor_id", None), *re.findall(r"actor_id: ([0-9a-f]+)", str(error))}
        for group in list(_LIVE_GROUPS):
            for r, actor in enumerate(group.actors):
                if group is not self and actor._actor_id.hex() in dead:
                    return f"{group.role} worker {r} (whose result {self.role} worker {rank} needed)"
        return f"{self.role} worker {rank}"

    @staticmethod
    def _first_death(pending: list, owner: dict, deadline: float) -> tuple[int, RayActorError] | None:
        """The rank and error of the first pending worker found dead within DEATH_GRACE_S, or None."""
        grace_end = min(time.monotonic() + DEATH_GRACE_S, deadline)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(grace_end - time.monotonic(), 0.0))
            if not ready:
                return None
            try:
                ray.get(ready[0])
            except RayActorError as e:
                return owner[ready[0]], e
            except RayTaskError:
                pass  # another peer's consequence of the same failure
        return None

    def submit(self, method: Method, *args, ranks: list[int] | None = None, **kwargs) -> list:
        """Same arguments to every worker (or to `ranks`); returns object refs."""
        chosen = range(len(self.actors)) if ranks is None else ranks
        return [getattr(self.actors[r], method.__name__).remote(*args, **kwargs) for r in chosen]

    def every_rank(self, method: Method, *args, **kwargs) -> list:
        """Replicated call: every worker runs it; one result per worker."""
        return self.wait(self.submit(method, *args, **kwargs), method.__name__)

    def each(self, method: Method, args_per_rank: list[tuple]) -> list:
        """Worker r runs method(*args_per_rank[r]); one result per worker."""
        refs = [getattr(actor, method.__name__).remote(*args) for actor, args in zip(self.actors, args_per_rank)]
        return self.wait(refs, method.__name__)

    def only(self, ranks: list[int], method: Method, *args, **kwargs) -> list:
        """Call on `ranks` alone; their results, in that order."""
        return self.wait(self.submit(method, *args, ranks=ranks, **kwargs), method.__name__, ranks)

    def share(self, values: list) -> list:
        """Object refs to the values, each put into the object store once for any number of calls."""
        return [ray.put(value) for value in values]

    def per_shard(self, method: Method, shards: list, shard_of_rank: list[int], output_ranks: list[int],
                  *args, **kwargs) -> list[Any]:
        """Worker r gets shards[shard_of_rank[r]] (a Batch is put into the object store once and
        shared by that shard's workers; an object ref is passed on as is); returns the results
        of output_ranks, in shard order."""
        refs = [s if isinstance(s, ray.ObjectRef) else ray.put(s) for s in shards]
        calls = [getattr(actor, method.__name__).remote(refs[shard_of_rank[r]], *args, **kwargs)
                 for r, actor in enumerate(self.actors)]
        results = self.wait(calls, method.__name__)
        return [results[r] for r in output_ranks]

    def node_ips(self) -> list[str]:
        """The address of the Ray node each worker runs on."""
        refs = [actor.__ray_call__.remote(lambda _: ray.util.get_node_ip_address()) for actor in self.actors]
        return self.wait(refs, "node_ips")

    def kill(self):
        for actor in self.actors:
            ray.kill(actor)
