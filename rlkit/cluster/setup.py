"""Start the worker groups of a run on one placement group, and tear them down."""

from dataclasses import dataclass

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rlkit.cluster.placement import plan_placement
from rlkit.cluster.ray_cluster import connect, device_kind
from rlkit.cluster.roles import GenerationGroup, PolicyGroup
from rlkit.cluster.worker_group import WorkerGroup, rendezvous_address
from rlkit.config.schema import RootConfig


@dataclass
class Workers:
    policy: PolicyGroup
    generation: GenerationGroup
    placement_group: object
    started_cluster: bool

    def shutdown(self):
        for group in (self.policy.workers, self.generation.workers):
            group.kill()
        remove_placement_group(self.placement_group)
        if self.started_cluster:
            ray.shutdown()


def start_workers(cfg: RootConfig, model_dir: str) -> Workers:
    from rlkit.workers.generation.hf import HFGenerationWorker
    from rlkit.workers.policy.megatron import MegatronPolicyWorker

    started = connect(cfg.cluster)
    device = device_kind()
    placement = plan_placement(cfg.cluster.placement, cfg.policy.num_workers, cfg.generation.num_workers, device)
    pg = placement_group(placement.bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=cfg.cluster.call_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"the Ray cluster cannot fit {len(placement.bundles)} bundles of {placement.bundles[0]} "
                           f"for cluster.placement={cfg.cluster.placement}; it has {ray.cluster_resources()}. "
                           f"Lower policy.num_workers / generation.num_workers or raise cluster.num_cpus") from None
    master_addr, master_port = rendezvous_address(pg, placement.policy_bundles[0])
    c = cfg.cluster
    policy = WorkerGroup(
        "policy", MegatronPolicyWorker, pg, placement.policy_bundles, placement.share, device,
        lambda rank: dict(cfg=cfg.policy, model_dir=model_dir, rank=rank, world_size=cfg.policy.num_workers,
                          master_addr=master_addr, master_port=master_port, seed=cfg.run.seed,
                          threads=c.threads_per_worker, collective_timeout_s=c.collective_timeout_s),
        c.call_timeout_s)
    generation = WorkerGroup(
        "generation", HFGenerationWorker, pg, placement.generation_bundles, placement.share, device,
        lambda rank: dict(model_dir=model_dir, precision=cfg.generation.precision, threads=c.threads_per_worker,
                          rank=rank),
        c.call_timeout_s)
    return Workers(PolicyGroup(policy), GenerationGroup(generation), pg, started)
