"""WorkerGroup: N Ray actors of one role placed on a placement group, with explicit dispatch."""

import socket
import time
from typing import Any, Callable

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlkit.data.batch import Batch


class WorkerError(RuntimeError):
    pass


# A worker killed inside a collective first shows up as its peers' errors ("connection closed by
# peer"); Ray reports the death itself a moment later. This long is given to see it.
DEATH_GRACE_S = 5.0


@ray.remote(num_cpus=0)
def _free_address() -> tuple[str, int]:
    """A TCP address for torch.distributed's rendezvous on the node of the worker's bundle."""
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), s.getsockname()[1]


def rendezvous_address(placement_group, bundle_index: int) -> tuple[str, int]:
    strategy = PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=bundle_index)
    return ray.get(_free_address.options(scheduling_strategy=strategy).remote())


class WorkerGroup:
    def __init__(self, role: str, actor_cls: type, placement_group, bundle_indices: list[int], share: float,
                 device: str, make_args: Callable[[int], dict], timeout_s: float):
        self.role, self.timeout_s = role, timeout_s
        remote_cls = ray.remote(actor_cls)
        self.actors = [
            remote_cls.options(
                num_cpus=share, num_gpus=share if device == "GPU" else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group,
                                                                     placement_group_bundle_index=bundle),
            ).remote(**make_args(rank))
            for rank, bundle in enumerate(bundle_indices)
        ]

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
                raise WorkerError(f"{self.role} worker {rank} died during '{what}': {e}") from None
            except RayTaskError as e:
                death = self._first_death(pending, owner, deadline)
                if death is not None:
                    dead_rank, cause = death
                    raise WorkerError(f"{self.role} worker {dead_rank} died during '{what}': {cause}\n"
                                      f"(worker {rank} then failed: {e.cause!r})") from None
                raise WorkerError(f"{self.role} worker {rank} failed in '{what}':\n{e}") from None
        return ray.get(list(refs))

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

    def submit(self, method: str, *args, ranks: list[int] | None = None, **kwargs) -> list:
        """Same arguments to every worker (or to `ranks`); returns object refs."""
        chosen = range(len(self.actors)) if ranks is None else ranks
        return [getattr(self.actors[r], method).remote(*args, **kwargs) for r in chosen]

    def call(self, method: str, *args, **kwargs) -> list:
        """Replicated call: every worker runs it; one result per worker."""
        return self.wait(self.submit(method, *args, **kwargs), method)

    def call_sharded(self, method: str, batch: Batch, shard_of_rank: list[int], output_ranks: list[int],
                     *args, **kwargs) -> list[Any]:
        """Split `batch` into one shard per data-parallel rank, give worker r the shard
        shard_of_rank[r] (one object ref per shard, shared by that shard's workers), and return
        the results of output_ranks in shard order."""
        shards = [ray.put(s) for s in batch.split(max(shard_of_rank) + 1)]
        refs = [getattr(actor, method).remote(shards[shard_of_rank[r]], *args, **kwargs)
                for r, actor in enumerate(self.actors)]
        results = self.wait(refs, method)
        return [results[r] for r in output_ranks]

    def kill(self):
        for actor in self.actors:
            ray.kill(actor)
