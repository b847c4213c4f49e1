"""Refit transports: move the policy's packed buckets into every generation worker.

Every transport is driven by the same RefitPlan; only how bytes travel differs. The GPU
transports (cuda_ipc, nccl) are added with the vLLM backend.
"""

import time

from rlkit.cluster.roles import GenerationGroup, PolicyGroup
from rlkit.refit.plan import RefitPlan


def refit_via_object_store(policy: PolicyGroup, generation: GenerationGroup, plan: RefitPlan,
                           verify_checksums: bool) -> dict:
    """CPU transport: policy rank 0 streams buckets into Ray's object store as it exports them;
    the controller forwards each bucket's reference to every generation worker, so at most a
    few buckets are in flight and the controller never touches the bytes."""
    start = time.perf_counter()
    generation.call("begin_refit", plan, verify_checksums)
    streams = [actor.stream_refit_buckets.options(num_returns="streaming").remote(plan, verify_checksums)
               for actor in policy.workers.actors]
    loads, owners = [], []
    for bucket_ref in streams[0]:
        loads += [actor.load_bucket.remote(bucket_ref) for actor in generation.workers.actors]
        owners += range(len(generation.workers))
    for rank, stream in enumerate(streams[1:], start=1):  # other ranks only join the collectives
        policy.workers.wait(list(stream), "stream_refit_buckets", ranks=[rank])
    generation.workers.wait(loads, "load_bucket", ranks=owners)
    generation.call("end_refit")
    seconds = time.perf_counter() - start
    return {"refit/seconds": seconds, "refit/gbytes_per_s": plan.total_bytes / seconds / 1e9,
            "refit/buckets": len(plan.buckets)}


TRANSPORTS = {"cpu": refit_via_object_store}
