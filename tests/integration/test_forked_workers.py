"""A local cluster (cluster.fork_workers, the default) starts every Python worker through the fork
server: a worker is the server's child, whether or not it has a runtime_env of its own (where Ray
runs its setup_worker.py first), and neither it nor the driver keeps the client's settings."""

import os

import pytest
import ray

from rlkit.cluster.fork_client import SOCKET_ENV, WORKER_ENV

pytestmark = pytest.mark.integration


def test_workers_fork_from_the_server_with_and_without_a_runtime_env(ray_cluster, tmp_path):
    class Probe:  # defined here, it travels by value: workers cannot import test modules
        def seen(self):
            import psutil

            return (" ".join(psutil.Process(os.getppid()).cmdline()), os.environ.get("PROBE"),
                    [os.environ.get(SOCKET_ENV), os.environ.get(WORKER_ENV)])

    plain = ray.remote(num_cpus=0)(Probe).remote()
    own_env = ray.remote(num_cpus=0, runtime_env={"env_vars": {"PROBE": "its own"}})(Probe).remote()
    try:
        for actor, probe in [(plain, None), (own_env, "its own")]:
            parent, env, client_env = ray.get(actor.seen.remote(), timeout=120)
            assert "-m rlkit.cluster.fork_server" in parent and env == probe and client_env == [None, None]
    finally:
        for actor in (plain, own_env):
            ray.kill(actor)
    assert SOCKET_ENV not in os.environ and WORKER_ENV not in os.environ
