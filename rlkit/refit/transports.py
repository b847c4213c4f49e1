"""Refit transports: move the policy's packed buckets into every generation worker.

Every transport is driven by the same RefitPlan; only how bytes travel differs:
  cpu       Ray object store (CPU runs)
  cuda_ipc  colocated: each policy rank packs into two slots on its GPU that the generation
            worker on that GPU maps through CUDA IPC handles; the slots alternate
  nccl      disaggregated: policy rank 0 broadcasts each bucket to every generation worker on a
            dedicated communicator, packing bucket k+1 while bucket k is on the wire
"""

import time

from rlkit.cluster.roles import GenerationGroup, PolicyGroup
from rlkit.cluster.worker_group import rendezvous_address
from rlkit.refit.plan import RefitPlan


def _metrics(plan: RefitPlan, start: float, policy: PolicyGroup, received: list[dict]) -> dict:
    """Time and throughput of the whole refit, the sender's share of it (policy rank 0's host
    seconds in the export and in packing; the rest is transport and loading), whether the sender
    copied parameter rows directly, and what the first generation worker reports of its side."""
    seconds = time.perf_counter() - start
    sender = policy.rank0("export_stats")
    return {"refit/seconds": seconds, "refit/gbytes_per_s": plan.total_bytes / seconds / 1e9,
            "refit/buckets": len(plan.buckets), "timing/refit_export_host": sender["export"],
            "timing/refit_pack_host": sender["pack"], "refit/direct_export": float(sender["direct"]),
            **received[0]}


class ObjectStoreTransport:
    """Policy rank 0 streams buckets into Ray's object store as it exports them; the controller
    forwards each bucket's reference to every generation worker, so at most a few buckets are in
    flight and the controller never touches the bytes."""

    def __init__(self, policy: PolicyGroup, generation: GenerationGroup, placement_group):
        self.policy, self.generation = policy, generation

    def __call__(self, plan: RefitPlan, verify_checksums: bool) -> dict:
        start = time.perf_counter()
        self.generation.call("begin_refit", plan, verify_checksums)
        streams = [actor.stream_refit_buckets.options(num_returns="streaming").remote(plan, verify_checksums)
                   for actor in self.policy.workers.actors]
        loads, owners = [], []
        for bucket_ref in streams[0]:
            loads += [actor.load_bucket.remote(bucket_ref) for actor in self.generation.workers.actors]
            owners += range(len(self.generation.workers))
        for rank, stream in enumerate(streams[1:], start=1):  # other ranks only join the collectives
            self.policy.workers.wait(list(stream), "stream_refit_buckets", ranks=[rank])
        self.generation.workers.wait(loads, "load_bucket", ranks=owners)
        return _metrics(plan, start, self.policy, self.generation.call("end_refit"))


class CudaIpcTransport:
    """Generation worker i shares a GPU with policy rank i (colocated placement). One call per
    side moves the whole plan: policy rank i packs into two IPC-shared slots on its GPU while
    generation worker i loads from the other (rlkit/refit/cuda_ipc.py)."""

    def __init__(self, policy: PolicyGroup, generation: GenerationGroup, placement_group):
        self.policy, self.generation = policy, generation
        self.addresses = policy.call("open_ipc_channel")

    def __call__(self, plan: RefitPlan, verify_checksums: bool) -> dict:
        start = time.perf_counter()
        sends = self.policy.workers.submit("send_ipc_refit", plan, verify_checksums)
        receives = [actor.receive_ipc_refit.remote(plan, verify_checksums, self.addresses[i])
                    for i, actor in enumerate(self.generation.workers.actors)]
        self.policy.workers.wait(sends, "send_ipc_refit")
        return _metrics(plan, start, self.policy, self.generation.workers.wait(receives, "receive_ipc_refit"))


class NcclTransport:
    """A communicator of policy rank 0 (rank 0 in it) and every generation worker, made once.
    One call per side moves the whole plan: the sender packs bucket k+1 while bucket k is on the
    wire, each receiver loads bucket k while bucket k+1 arrives. Every wait is bounded by
    cluster.call_timeout_s, so a dead peer is an error naming it."""

    def __init__(self, policy: PolicyGroup, generation: GenerationGroup, placement_group):
        self.policy, self.generation = policy, generation
        host, port = rendezvous_address(placement_group, 0)
        world = 1 + len(generation.workers)
        refs = policy.workers.submit("init_refit_group", host, port, 0, world, ranks=[0])
        refs += generation.workers.submit("init_refit_group", host, port, world)
        policy.workers.wait(refs[:1], "init_refit_group", ranks=[0])
        generation.workers.wait(refs[1:], "init_refit_group")

    def __call__(self, plan: RefitPlan, verify_checksums: bool) -> dict:
        start = time.perf_counter()
        sends = self.policy.workers.submit("broadcast_refit", plan, verify_checksums)
        receives = self.generation.workers.submit("receive_nccl_refit", plan, verify_checksums)
        self.policy.workers.wait(sends, "broadcast_refit")
        return _metrics(plan, start, self.policy, self.generation.workers.wait(receives, "receive_nccl_refit"))


TRANSPORTS = {"cpu": ObjectStoreTransport, "cuda_ipc": CudaIpcTransport, "nccl": NcclTransport}
