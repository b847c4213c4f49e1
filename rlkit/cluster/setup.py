"""Start the worker groups of a run on one placement group, and tear them down."""

import logging
import time
from dataclasses import dataclass, replace
from typing import Callable

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from rlkit.cluster.groups import GenerationWorkers, ModelWorkers
from rlkit.cluster.placement import Placement, plan_placement
from rlkit.cluster.ray_runtime import device_kind, join_or_start_ray, stop_local_ray
from rlkit.cluster.worker_group import WorkerGroup, bundle_gpu_ids, rendezvous_address
from rlkit.config.schema import RootConfig
from rlkit.observability.startup import StartupClock
from rlkit.workers.generation.base import GenerationWorker as Engine
from rlkit.workers.policy.megatron import MegatronModelWorker as Model, optional_kernels_missing

log = logging.getLogger("rlkit")


@dataclass
class RunWorkers:
    """Every worker of a run, on one placement group."""

    policy: ModelWorkers
    generation: GenerationWorkers | None  # None for runs without rollouts
    placement_group: object
    started_cluster: bool
    placement: Placement
    device: str
    critic: ModelWorkers | None = None  # PPO: added by start_critic

    def shutdown(self, keep_ray_logs: bool = False):
        if self.generation is not None:
            self.generation.close()
        for group in (self.policy, self.generation, self.critic):
            if group is not None:
                group.workers.kill()
        remove_placement_group(self.placement_group)
        if self.started_cluster:
            stop_local_ray(keep_ray_logs)


def engine_gpus(cfg: RootConfig) -> int:
    """GPUs per generation worker: a vLLM engine's tensor-parallel size; 1 otherwise."""
    g = cfg.generation  # None for algorithms without rollouts (SFT, DPO)
    return g.vllm.tensor_parallel_size if g is not None and g.backend == "vllm" else 1


def _generation_worker(cfg: RootConfig, model_dir: str, pg, placement: Placement,
                       device: str) -> tuple[type, Callable[[int], dict]]:
    # refit.peft=adapter: the workers load model_dir's real weights, with LoRA of their own for the refits to set
    adapter = cfg.policy.peft if cfg.refit.peft == "adapter" else None
    if cfg.generation.backend == "vllm":
        from rlkit.workers.generation.vllm import VLLMGenerationWorker
        # an engine of several GPUs sees all of its bundles' GPUs (Ray gives an actor those of one bundle)
        spans = device == "GPU" and engine_gpus(cfg) > 1
        visible = [",".join(bundle_gpu_ids(pg, bundles)) if spans else None for bundles in placement.engine_bundles]
        return VLLMGenerationWorker, lambda rank: dict(model_dir=model_dir, cfg=cfg.generation, seed=cfg.run.seed,
                                                       rank=rank, sleep_mode=cfg.cluster.placement == "colocated",
                                                       fp32_lm_head=cfg.policy.fp32_lm_head, adapter=adapter,
                                                       visible_devices=visible[rank])
    from rlkit.workers.generation.hf import HFGenerationWorker
    return HFGenerationWorker, lambda rank: dict(model_dir=model_dir, precision=cfg.generation.precision,
                                                 threads=cfg.cluster.threads_per_worker, rank=rank, adapter=adapter)


def start_workers(cfg: RootConfig, model_dir: str, with_generation: bool = True,
                  with_critic: bool = False, clock: StartupClock | None = None) -> RunWorkers:
    """Policy (and generation) workers on a new placement group; with_critic reserves room on the
    policy's bundles for the critic that start_critic adds later. clock: where the phases' seconds go."""
    clock = clock or StartupClock()
    with clock.phase("ray"):
        started = join_or_start_ray(cfg.cluster)
    device = device_kind()
    missing = optional_kernels_missing()
    if missing:
        log.info("%s not installed: Megatron uses its PyTorch fallbacks for fused kernels (fine on CPU; slower on GPU)",
                 " and ".join(missing))
    num_generation = cfg.generation.num_workers if with_generation else 0
    placement = plan_placement(cfg.cluster.placement, cfg.policy.num_workers, num_generation, device, with_critic,
                               engine_gpus(cfg))
    pg = placement_group(placement.bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=cfg.cluster.call_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"the Ray cluster cannot fit {len(placement.bundles)} bundles of {placement.bundles[0]} "
                           f"for cluster.placement={cfg.cluster.placement}; it has {ray.cluster_resources()}. "
                           f"Lower policy.num_workers / generation.num_workers or raise cluster.num_cpus") from None
    try:
        return _start_groups(cfg, model_dir, pg, placement, device, started, with_generation, clock)
    except BaseException:
        # a worker that failed to start must not leave its bundles reserved for the next attempt
        remove_placement_group(pg)
        raise


def _start_groups(cfg, model_dir, pg, placement, device, started, with_generation, clock) -> RunWorkers:
    c = cfg.cluster
    # Generation first: vLLM sizes its KV cache from the free memory it measures at start-up,
    # which a policy allocating on the same GPU at the same time would falsify.
    # The policy's processes start and import meanwhile; they build once the engines are up.
    generation = None
    created = time.time()
    if with_generation:
        generation_cls, generation_args = _generation_worker(cfg, model_dir, pg, placement, device)
        with clock.phase("generation_workers"):
            generation = GenerationWorkers(WorkerGroup.start("generation", generation_cls, pg,
                                                             placement.generation_bundles, placement.share, device,
                                                             generation_args, c.call_timeout_s))
            policy = _megatron_group("policy", cfg, cfg.policy, model_dir, pg, placement, device, head="lm")
            generation.sleep()  # also waits until every engine is up
        clock.add_workers("generation_workers", created, generation.workers.every_rank(Engine.startup_phases))
    else:
        policy = _megatron_group("policy", cfg, cfg.policy, model_dir, pg, placement, device, head="lm")
    with clock.phase("policy_workers"):
        _set_up(policy, pg, placement)
    clock.add_workers("policy_workers", created, policy.every_rank(Model.startup_phases))
    _log_nodes(policy, generation.workers if generation else None)
    return RunWorkers(ModelWorkers(policy), generation, pg, started, placement, device)


def _log_nodes(policy: WorkerGroup, generation: WorkerGroup | None) -> None:
    """Where the workers run, when that is more than one node."""
    nodes = {"policy ranks": policy.node_ips(), "generation workers": generation.node_ips() if generation else []}
    if len({ip for ips in nodes.values() for ip in ips}) > 1:
        log.info("nodes: " + "; ".join(f"{role} on {', '.join(ips)}" for role, ips in nodes.items() if ips))


def start_critic(cfg: RootConfig, workers: RunWorkers, model_dir: str) -> ModelWorkers:
    """PPO's critic: the policy's layout and optimizer settings (learning rate algorithm.critic.lr),
    a value head on the trunk of the checkpoint at model_dir, on the policy's bundles."""
    critic = _megatron_group("critic", cfg, critic_config(cfg), model_dir, workers.placement_group, workers.placement,
                             workers.device, head="value")
    _set_up(critic, workers.placement_group, workers.placement)
    workers.critic = ModelWorkers(critic)
    return workers.critic


def critic_config(cfg: RootConfig):
    """The critic's model settings: the policy's, with the learning rate algorithm.critic.lr."""
    return replace(cfg.policy, optimizer=replace(cfg.policy.optimizer, lr=cfg.algorithm.critic.lr))


def _megatron_group(role: str, cfg: RootConfig, model_cfg, model_dir: str, pg, placement, device: str,
                    head: str) -> WorkerGroup:
    """The model's worker processes, started and importing; _set_up builds them."""
    return WorkerGroup.start(role, Model, pg, placement.policy_bundles, placement.share, device,
                             model_worker_args(cfg, model_cfg, model_dir, head), cfg.cluster.call_timeout_s)


def model_worker_args(cfg: RootConfig, model_cfg, model_dir: str, head: str) -> Callable[[int], dict]:
    """Rank r's MegatronModelWorker arguments, for a model of model_cfg's layout (cfg.policy or the critic's)."""
    c = cfg.cluster
    return lambda rank: dict(cfg=model_cfg, model_dir=model_dir, rank=rank, world_size=model_cfg.num_workers,
                             seed=cfg.run.seed, threads=c.threads_per_worker,
                             collective_timeout_s=c.collective_timeout_s, head=head)


def _set_up(group: WorkerGroup, pg, placement: Placement) -> None:
    """A model's ranks join one process group (a port free now, on the first rank's node), build
    the model and load its weights."""
    master_addr, master_port = rendezvous_address(pg, placement.policy_bundles[0])
    group.every_rank(Model.setup, master_addr, master_port)
