"""Refit transports: move the policy's packed buckets into every generation worker.

Every transport is driven by the same RefitPlan; only how bytes travel differs:
  cpu       Ray object store (CPU runs)
  cuda_ipc  colocated: each policy rank packs into two slots on its GPU that the generation
            worker on that GPU maps through CUDA IPC handles; the slots alternate
  nccl      disaggregated: policy rank 0 broadcasts each bucket to every generation worker on a
            dedicated communicator, packing bucket k+1 while bucket k is on the wire

The GPU transports set up, once, a standing receiver in each generation worker's processes
(rlkit/refit/channel.py); a refit is then one call to the policy, which starts it on its
channel and returns every receiver's report. Waits inside a refit are bounded by half of
cluster.call_timeout_s, so a dead or stuck peer is named by the side that waited for it before
the controller's own wait for the call runs out.
"""

import time

from rlkit.cluster.roles import GenerationGroup, PolicyGroup
from rlkit.cluster.worker_group import rendezvous_address
from rlkit.refit.plan import RefitPlan


def _metrics(plan: RefitPlan, seconds: float, sender: dict, received: list[dict]) -> dict:
    """Time and throughput of the whole refit, the sender's share of it (policy rank 0's host
    seconds in the export and in packing; the rest is transport and loading), whether the sender
    copied parameter rows directly, and the generation workers' reports of their side (each
    figure the lowest any of them gave, e.g. the share of its load that was replayed)."""
    return {"refit/seconds": seconds, "refit/gbytes_per_s": plan.total_bytes / seconds / 1e9,
            "refit/buckets": len(plan.buckets), "timing/refit_export_host": sender["export"],
            "timing/refit_pack_host": sender["pack"], "refit/direct_export": float(sender["direct"]),
            **{key: min(report[key] for report in received) for key in received[0]}}


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
        received = self.generation.call("end_refit")
        return _metrics(plan, time.perf_counter() - start, self.policy.rank0("export_stats"), received)


class _StandingTransport:
    """A refit is one call to the policy (`send` on every rank); the generation workers are
    told their weights change in parallel, which costs the refit nothing."""
    send = ""

    def __call__(self, plan: RefitPlan, verify_checksums: bool) -> dict:
        start = time.perf_counter()
        sends = self.policy.workers.submit(self.send, plan, verify_checksums)
        marks = self.generation.workers.submit("weights_changing")
        sent = self.policy.workers.wait(sends, self.send)
        seconds = time.perf_counter() - start
        self.generation.workers.wait(marks, "weights_changing")
        return _metrics(plan, seconds, sent[0], [r for rank in sent for r in rank.get("received", [])])


class CudaIpcTransport(_StandingTransport):
    """Generation worker i shares a GPU with policy rank i (colocated placement), and receives
    from it alone (rlkit/refit/cuda_ipc.py)."""
    send = "send_ipc_refit"

    def __init__(self, policy: PolicyGroup, generation: GenerationGroup, placement_group):
        self.policy, self.generation = policy, generation
        timeout_s = policy.workers.timeout_s / 2
        addresses = policy.call("open_refit_channel", 1, timeout_s)
        generation.workers.wait([actor.start_refit_receiver.remote("cuda_ipc", addresses[i], timeout_s)
                                 for i, actor in enumerate(generation.workers.actors)], "start_refit_receiver")


class NcclTransport(_StandingTransport):
    """A communicator of policy rank 0 (rank 0 in it) and every generation worker, made once;
    rank 0's channel reaches every generation worker's receiver."""
    send = "broadcast_refit"

    def __init__(self, policy: PolicyGroup, generation: GenerationGroup, placement_group):
        self.policy, self.generation = policy, generation
        timeout_s = policy.workers.timeout_s / 2
        host, port = rendezvous_address(placement_group, 0)
        world = 1 + len(generation.workers)
        refs = policy.workers.submit("init_refit_group", host, port, 0, world, timeout_s, ranks=[0])
        refs += generation.workers.submit("init_refit_group", host, port, world, timeout_s)
        policy.workers.wait(refs[:1], "init_refit_group", ranks=[0])
        generation.workers.wait(refs[1:], "init_refit_group")
        address, = policy.workers.wait(policy.workers.submit("open_refit_channel", len(generation.workers), timeout_s,
                                                             ranks=[0]), "open_refit_channel", ranks=[0])
        generation.workers.wait(generation.workers.submit("start_refit_receiver", "nccl", address, timeout_s),
                                "start_refit_receiver")


TRANSPORTS = {"cpu": ObjectStoreTransport, "cuda_ipc": CudaIpcTransport, "nccl": NcclTransport}
