"""A local cluster (cluster.fork_workers, the default) starts every Python worker through the fork
server: a worker is the server's child, whether or not it has a runtime_env of its own (where Ray
runs its setup_worker.py first), and neither it nor the driver keeps the client's settings; the
cluster's start does not wait for the server's imports; no process of the cluster's (Ray's, the server,
the workers) is in the driver's process group, whose signals are the driver's to handle."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

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


HELD_IMPORT = textwrap.dedent("""\
    import os, time
    from pathlib import Path
    deadline = time.monotonic() + 60
    while not Path(os.environ["RELEASE"]).exists():
        if time.monotonic() > deadline:  # what a start that waited for this import would come to
            Path(os.environ["RELEASE"] + ".timed_out").touch()
            break
        time.sleep(0.05)
""")

STARTS_BEFORE_THE_IMPORTS = textwrap.dedent("""\
    import os
    from pathlib import Path
    import psutil
    import ray
    from rlkit.cluster import fork_server, ray_runtime
    from rlkit.launch.config import load_config
    fork_server.preload_for = lambda bridge: ("held_import",)  # the server's imports, held until released
    def in_drivers_group(pid):
        try:
            return os.getpgid(pid) == os.getpgid(0)
        except ProcessLookupError:  # ended meanwhile
            return False
    cfg, _ = load_config("grpo_tiny_cpu", ["cluster.num_cpus=1", "cluster.object_store_mb=128"])
    server = fork_server.start_ahead(cfg.cluster, cfg.policy.bridge)  # as a command begins
    try:
        assert ray_runtime.join_or_start_ray(cfg.cluster, cfg.policy.bridge, server)
        print("started while the server imported:", not Path(os.environ["RELEASE"]).exists(), flush=True)
        Path(os.environ["RELEASE"]).touch()
        parent = ray.get(ray.remote(num_cpus=0)(lambda: os.getppid()).remote(), timeout=120)
        print("a worker is the server's child:", parent == ray_runtime._fork_server.process.pid, flush=True)
        started = psutil.Process().children(recursive=True)
        print("in the driver's process group:", [p.name() for p in started if in_drivers_group(p.pid)], flush=True)
    finally:
        ray_runtime.stop_local_ray(keep_logs=False)
""")


def test_a_local_cluster_starts_while_the_server_still_imports(tmp_path):
    """On a GPU the server imports vLLM for 15-20 s: the driver goes on with its own start-up (its
    tokenizer and data, the workers' placement) meanwhile, and the workers fork once it is done."""
    (tmp_path / "held_import.py").write_text(HELD_IMPORT)
    release = tmp_path / "release"
    env = {**os.environ, "RELEASE": str(release), "RAY_ADDRESS": "",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(Path(__file__).resolve().parents[2])])}
    ran = subprocess.run([sys.executable, "-c", STARTS_BEFORE_THE_IMPORTS], env=env, capture_output=True, text=True,
                         timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert not Path(f"{release}.timed_out").exists()
    said = [line for line in ran.stdout.splitlines() if line.startswith(("started", "a worker", "in the driver"))]
    assert said == ["started while the server imported: True", "a worker is the server's child: True",
                    "in the driver's process group: []"], ran.stdout
