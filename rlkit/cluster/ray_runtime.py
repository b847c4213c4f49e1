"""Join the Ray cluster named by cluster.address / RAY_ADDRESS, or start a local one."""

import logging
import os

import ray

from rlkit.config.schema import ClusterConfig

log = logging.getLogger(__name__)


def join_or_start_ray(cfg: ClusterConfig) -> bool:
    """Returns True if this call started a local cluster (the caller shuts it down)."""
    if ray.is_initialized():
        return False
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        log.info("joining Ray cluster at %s", address)
        ray.init(address=address, log_to_driver=True)
        return False
    # address="local" ignores a stale /tmp/ray/ray_current_cluster; loopback only, no dashboard.
    ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=False, _node_ip_address="127.0.0.1",
             object_store_memory=cfg.object_store_mb * 1024 * 1024, log_to_driver=True)
    log.info("started a local Ray cluster (%d logical CPUs, loopback only)", cfg.num_cpus)
    return True


def device_kind() -> str:
    return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"
