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
from rlkit.cluster.warm_pool import WarmPool
from rlkit.cluster.worker_group import WorkerGroup, bundle_gpu_ids, free_address, rendezvous_address
from rlkit.config.schema import RootConfig
from rlkit.envs.reward_models.server import shared_gpus
from rlkit.observability.startup import StartupClock
from rlkit.workers.generation.base import GenerationWorker as Engine
from rlkit.workers.policy.backends import training_backend, worker_class
from rlkit.workers.policy.base import TrainingBackend

log = logging.getLogger("rlkit")


@dataclass
class RunWorkers:
    """Every worker of a run, on one placement group (or taken from a WarmPool)."""

    policy: ModelWorkers
    generation: GenerationWorkers | None  # None for runs without rollouts
    placement_group: object  # None for pooled workers
    started_cluster: bool
    placement: Placement
    device: str
    critic: ModelWorkers | None = None  # PPO: added by start_critic
    pool: WarmPool | None = None

    def shutdown(self, failed: bool = False):
        """failed: the run ends on an error; pooled workers are killed rather than given back, and
        the logs of a cluster this run started are kept."""
        if self.generation is not None:
            self.generation.close()
        for group in (self.policy, self.generation, self.critic):
            if group is None:
                continue
            if self.pool is None:
                group.workers.kill()
            else:
                self.pool.give_back(group.workers, healthy=not failed)
        if self.placement_group is not None:
            remove_placement_group(self.placement_group)
        if self.started_cluster:
            stop_local_ray(keep_logs=failed)


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
                  with_critic: bool = False, clock: StartupClock | None = None,
                  pool: WarmPool | None = None, started_cluster: bool | None = None,
                  policy_head: str = "lm") -> RunWorkers:
    """Policy (and generation) workers on a new placement group; with_critic reserves room on the
    policy's bundles for the critic that start_critic adds later. policy_head: the head of the
    policy's model ("lm"; "reward": a reward model in its place). clock: where the
    phases' seconds go. pool: take the workers from it instead (CPU, this node), no placement
    group. started_cluster: the caller has joined or started Ray already (True: started a local
    cluster, which the workers' shutdown then stops); None: joined or started here. Workers that
    fail to start (or a signal meanwhile) stop such a cluster: its logs are kept on an error."""
    clock = clock or StartupClock()
    if started_cluster is None:
        with clock.phase("ray"):
            started_cluster = join_or_start_ray(cfg.cluster, cfg.policy.bridge)
    try:
        return _start_workers(cfg, model_dir, with_generation, with_critic, clock, pool, started_cluster, policy_head)
    except BaseException as error:
        if started_cluster:
            stop_local_ray(keep_logs=not isinstance(error, KeyboardInterrupt))
        raise


def _start_workers(cfg: RootConfig, model_dir: str, with_generation: bool, with_critic: bool, clock: StartupClock,
                   pool: WarmPool | None, started_cluster: bool, policy_head: str) -> RunWorkers:
    device = device_kind()
    missing = training_backend(cfg.policy).optional_kernels_missing()
    if missing:
        log.info("%s not installed: Megatron uses its PyTorch fallbacks for fused kernels (fine on CPU; slower on GPU)",
                 " and ".join(missing))
    num_generation = cfg.generation.num_workers if with_generation else 0
    placement = plan_placement(cfg.cluster.placement, cfg.policy.num_workers, num_generation, device, with_critic,
                               engine_gpus(cfg), shared_gpus(cfg.env) if device == "GPU" else 0.0)
    if pool is not None:
        if device != "CPU":
            raise ValueError(f"a WarmPool holds CPU workers only; this node has {device}s: start the run without one")
        return _start_groups(cfg, model_dir, None, placement, device, started_cluster, with_generation, clock,
                             policy_head, pool)
    pg = placement_group(placement.bundles, strategy="PACK")
    try:
        ray.get(pg.ready(), timeout=cfg.cluster.call_timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"the Ray cluster cannot fit {len(placement.bundles)} bundles of {placement.bundles[0]} "
                           f"for cluster.placement={cfg.cluster.placement}; it has {ray.cluster_resources()}. "
                           f"Lower policy.num_workers / generation.num_workers or raise cluster.num_cpus") from None
    try:
        return _start_groups(cfg, model_dir, pg, placement, device, started_cluster, with_generation, clock,
                             policy_head)
    except BaseException:
        # a worker that failed to start must not leave its bundles reserved for the next attempt
        remove_placement_group(pg)
        raise


def _start_groups(cfg, model_dir, pg, placement, device, started, with_generation, clock, policy_head: str,
                  pool: WarmPool | None = None) -> RunWorkers:
    c = cfg.cluster
    # Generation first: vLLM sizes its KV cache from the free memory it measures at start-up,
    # which a policy allocating on the same GPU at the same time would falsify.
    # The policy's processes start and import meanwhile; they build once the engines are up.
    generation = None
    created = time.time()
    if with_generation:
        generation_cls, generation_args = _generation_worker(cfg, model_dir, pg, placement, device)
        with clock.phase("generation_workers"):
            if pool is None:
                generation = GenerationWorkers(WorkerGroup.start("generation", generation_cls, pg,
                                                                 placement.generation_bundles, placement.share,
                                                                 device, generation_args, c.call_timeout_s,
                                                                 placement.gpu_share))
            else:
                generation = GenerationWorkers(pool.take("generation", generation_cls, "", generation_args,
                                                         len(placement.generation_bundles), c.call_timeout_s))
            policy = _model_group("policy", cfg, cfg.policy, model_dir, pg, placement, device, policy_head, pool)
            generation.sleep()  # also waits until every engine is up
        clock.add_workers("generation_workers", created, generation.workers.every_rank(Engine.startup_phases))
    else:
        policy = _model_group("policy", cfg, cfg.policy, model_dir, pg, placement, device, policy_head, pool)
    with clock.phase("policy_workers"):
        _set_up(policy, pg, placement)
    clock.add_workers("policy_workers", created, policy.every_rank(TrainingBackend.startup_phases))
    _log_nodes(policy, generation.workers if generation else None)
    return RunWorkers(ModelWorkers(policy), generation, pg, started, placement, device, pool=pool)


def _log_nodes(policy: WorkerGroup, generation: WorkerGroup | None) -> None:
    """Where the workers run, when that is more than one node."""
    nodes = {"policy ranks": policy.node_ips(), "generation workers": generation.node_ips() if generation else []}
    if len({ip for ips in nodes.values() for ip in ips}) > 1:
        log.info("nodes: " + "; ".join(f"{role} on {', '.join(ips)}" for role, ips in nodes.items() if ips))


def start_critic(cfg: RootConfig, workers: RunWorkers, model_dir: str) -> ModelWorkers:
    """PPO's critic: the policy's layout and optimizer settings (learning rate algorithm.critic.lr),
    a value head on the trunk of the checkpoint at model_dir, on the policy's bundles."""
    critic = _model_group("critic", cfg, critic_config(cfg), model_dir, workers.placement_group, workers.placement,
                             workers.device, "value", workers.pool)
    _set_up(critic, workers.placement_group, workers.placement)
    workers.critic = ModelWorkers(critic)
    return workers.critic


def critic_config(cfg: RootConfig):
    """The critic's model settings: the policy's, with the learning rate algorithm.critic.lr."""
    return replace(cfg.policy, optimizer=replace(cfg.policy.optimizer, lr=cfg.algorithm.critic.lr))


def _model_group(role: str, cfg: RootConfig, model_cfg, model_dir: str, pg, placement, device: str,
                 head: str, pool: WarmPool | None) -> WorkerGroup:
    """The model's worker processes (policy.backend's class), started and importing (or reset, from
    the pool); _set_up builds them."""
    args = model_worker_args(cfg, model_cfg, model_dir, head)
    actor_cls = worker_class(model_cfg)
    if pool is not None:
        # processes whose imports differ (e.g. Megatron's bridge) are pooled apart
        return pool.take(role, actor_cls, training_backend(model_cfg).imports(model_cfg), args,
                         len(placement.policy_bundles), cfg.cluster.call_timeout_s)
    return WorkerGroup.start(role, actor_cls, pg, placement.policy_bundles, placement.share, device, args,
                             cfg.cluster.call_timeout_s, placement.gpu_share)


def model_worker_args(cfg: RootConfig, model_cfg, model_dir: str, head: str) -> Callable[[int], dict]:
    """Rank r's worker arguments, for a model of model_cfg's layout (cfg.policy or the critic's)."""
    c = cfg.cluster
    staged = cfg.checkpoint.save_format == "dist" and cfg.checkpoint.background
    return lambda rank: dict(cfg=model_cfg, model_dir=model_dir, rank=rank, world_size=model_cfg.num_workers,
                             seed=cfg.run.seed, threads=c.threads_per_worker,
                             collective_timeout_s=c.collective_timeout_s, head=head, stage_checkpoints=staged)


def _set_up(group: WorkerGroup, pg, placement: Placement) -> None:
    """A model's ranks join one process group (a port free now, on the first rank's node), build
    the model and load its weights."""
    # pooled workers (no placement group) are on this process's node
    master_addr, master_port = free_address() if pg is None else rendezvous_address(pg, placement.policy_bundles[0])
    group.every_rank(TrainingBackend.setup, master_addr, master_port)
