"""A local Ray cluster for the whole integration session (loopback, no dashboard), and
configs that point at a session-private cache of tiny models."""

import pytest
import ray

from rlkit.launch.config import load_config
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
def ray_cluster():
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=512 * 1024 * 1024)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_qwen2(make_cfg):
    cfg, _ = make_cfg()
    return resolve_model_dir(cfg)
