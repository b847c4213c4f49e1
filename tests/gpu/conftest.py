"""GPU tests: real vLLM, Megatron on NCCL, CUDA IPC and NCCL refit. Skipped without a GPU."""

import pytest
import ray
import torch

from rlkit.cluster.ray_runtime import join_or_start_ray
from rlkit.launch.config import load_config


def pytest_collection_modifyitems(items):
    """Every test here is marked gpu and skipped without a GPU; @pytest.mark.gpus(n) also skips
    it on machines with fewer than n GPUs."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if "tests/gpu/" not in str(item.fspath):
            continue
        item.add_marker(pytest.mark.gpu)
        needed = max([1, *(m.args[0] for m in item.iter_markers("gpus"))])
        if available < needed:
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s), found {available}"))


@pytest.fixture(scope="session")
def ray_cluster(make_cfg):
    """The loopback-only local cluster a run starts (rlkit/cluster/ray_runtime.py), 8 CPUs."""
    cfg, _ = make_cfg("cluster.num_cpus=8", "cluster.object_store_mb=8192")
    join_or_start_ray(cfg.cluster, cfg.policy.bridge)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def make_cfg(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    outputs = tmp_path_factory.mktemp("outputs")

    def make(*overrides: str):
        # a failing peer must fail the test in minutes, not hang it
        return load_config("grpo_tiny_gpu", [f"run.cache_dir={cache}", f"run.output_dir={outputs}",
                                             "cluster.call_timeout_s=180", "cluster.collective_timeout_s=180",
                                             *overrides])

    return make
