"""The local cluster join_or_start_ray starts listens on loopback only and runs no dashboard, and so
does everything a whole run starts on it (workers, torch.distributed stores and gloo pairs,
environment workers); joining a cluster that does not answer fails within
cluster.connect_timeout_s, naming the address.

Each case runs in a subprocess of its own, so that neither the session's Ray cluster nor a cluster
started here is in the other's way; every Ray process the subprocess started is gone afterwards.
The whole run is the session's one `rlkit train` command (conftest.readme_environment_command)."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from ray._private.ray_constants import DEFAULT_DASHBOARD_AGENT_LISTEN_PORT
from process_tree import is_loopback

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

LISTENERS = r"""
import json, socket, time
import psutil, ray
from ray.experimental.internal_kv import _internal_kv_get
from rlkit.cluster.ray_runtime import join_or_start_ray
from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config


def processes(node):
    # this driver, what it started (the raylet starts the agents and workers), and any process of
    # the session that left the tree, each with its listening sockets
    pids = {psutil.Process().pid, *(p.pid for p in psutil.Process().children(recursive=True)),
            *(info.process.pid for infos in node.all_processes.values() for info in infos)}
    for p in psutil.process_iter():
        try:
            if node.get_session_dir_path() in " ".join(p.cmdline()):
                pids.add(p.pid)
        except psutil.Error:
            pass
    seen = []
    for pid in sorted(pids):
        try:
            p = psutil.Process(pid)
            sockets = [c for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN
                       or (c.type == socket.SOCK_DGRAM and c.laddr and c.laddr.port)]
            seen.append(dict(pid=pid, created=p.create_time(), name=p.name(), cmdline=" ".join(p.cmdline())[:300],
                             listening=sorted([c.laddr.ip, c.laddr.port, c.type.name] for c in sockets)))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):  # ended meanwhile: no sockets
            pass
    return seen


cfg, _ = load_config("grpo_tiny_cpu", ["cluster.num_cpus=1", "cluster.object_store_mb=128"])
start = time.monotonic()
try:
    assert join_or_start_ray(cfg.cluster, cfg.policy.bridge)
    start_s = time.monotonic() - start
    ray.get(ray.remote(lambda: 0).remote())  # a worker process, with a server of its own
    # the agents and workers open their ports while the node runs: wait until nothing changes for 3 s
    node = ray._private.worker._global_node
    seen, stable_since, deadline = processes(node), time.monotonic(), time.monotonic() + 30
    while time.monotonic() - stable_since < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
        now = processes(node)
        if now != seen:
            seen, stable_since = now, time.monotonic()
    # the dashboard agent's address as it registered it: [ip, http port (-1: none), grpc port]
    agent = _internal_kv_get(f"DASHBOARD_AGENT_ADDR_NODE_ID_PREFIX:{node.node_id}", namespace="dashboard")
    print(json.dumps(dict(start_s=start_s, processes=seen, agent=agent and json.loads(agent))))
finally:
    ray.shutdown()
"""

CONNECT = r"""
import sys, time
from rlkit.cluster.ray_runtime import join_or_start_ray
from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config

cfg, _ = load_config("grpo_tiny_cpu", sys.argv[1:])
start = time.monotonic()
try:
    join_or_start_ray(cfg.cluster, cfg.policy.bridge)
except ConfigError as e:
    print(f"{time.monotonic() - start:.2f} {e}")
"""


def run_python(script: str, *args: str, env: dict | None = None, timeout: float = 120) -> str:
    """The script's last line of output; RAY_ADDRESS is unset unless env sets it."""
    env = {**os.environ, "RAY_ADDRESS": "", **(env or {})}
    done = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def still_alive(processes: list[dict], grace_s: float = 15) -> list[str]:
    """The processes still alive grace_s after the subprocess's ray.shutdown(); each is then killed."""
    deadline = time.monotonic() + grace_s
    alive = [p for p in processes if same_process_alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in alive if same_process_alive(p)]
    for p in alive:
        psutil.Process(p["pid"]).kill()
    return [f"{p['pid']} {p['cmdline'][:80]}" for p in alive]


def same_process_alive(p: dict) -> bool:
    try:
        proc = psutil.Process(p["pid"])
        return proc.create_time() == p["created"] and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_local_cluster_listens_on_loopback_only_and_runs_no_dashboard():
    """... and its dashboard agent serves on a free port: Ray's fixed default (52365), held here as
    another cluster on the machine would hold it, would cost the start 3.4 s of retries and leave
    the agent without its HTTP service."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", DEFAULT_DASHBOARD_AGENT_LISTEN_PORT))
        held.listen()
        report = json.loads(run_python(LISTENERS))
    processes = report["processes"]
    try:
        listening = [(p["name"], ip, port, kind) for p in processes for ip, port, kind in p["listening"]]
        print(f"started in {report['start_s']:.1f} s; listening: {listening}")
        exposed = [entry for entry in listening if not is_loopback(entry[1])]
        assert not exposed, f"listening beyond loopback: {exposed}"
        names = {name for name, *_ in listening}
        assert {"gcs_server", "raylet"} <= names and len(listening) >= 5, listening
        dashboards = [p["cmdline"] for p in processes if "dashboard/dashboard.py" in p["cmdline"]]
        assert not dashboards, f"a dashboard runs: {dashboards}"
        agent = report["agent"] or [None, -1, -1]  # none registered while the run looked
        assert agent[0] == "127.0.0.1" and agent[1] not in (-1, DEFAULT_DASHBOARD_AGENT_LISTEN_PORT), agent
    finally:
        assert still_alive(processes) == []


TIMEOUT_S = 1  # the port is tried every 0.2 s (ray_runtime._wait_for_cluster): the limit, not the retries, ends it


@pytest.mark.parametrize("address", ["127.0.0.1:1", "ray://127.0.0.1:1"])
def test_joining_a_closed_port_fails_within_the_timeout(address):
    line = run_python(CONNECT, f"cluster.address={address}", f"cluster.connect_timeout_s={TIMEOUT_S}", timeout=30)
    elapsed, message = line.split(" ", 1)
    assert TIMEOUT_S <= float(elapsed) < TIMEOUT_S + 2, line
    assert message.startswith(f"cluster.address={address}: no Ray cluster answered within {TIMEOUT_S} s; "
                              f'start one with "ray start --head"'), line


def test_joining_a_closed_RAY_ADDRESS_fails_within_the_timeout():
    line = run_python(CONNECT, f"cluster.connect_timeout_s={TIMEOUT_S}", env={"RAY_ADDRESS": "127.0.0.1:1"},
                      timeout=30)
    elapsed, message = line.split(" ", 1)
    assert TIMEOUT_S <= float(elapsed) < TIMEOUT_S + 2, line
    assert message.startswith(f"RAY_ADDRESS=127.0.0.1:1: no Ray cluster answered within {TIMEOUT_S} s"), line


def test_everything_a_run_starts_listens_on_loopback_only(readme_environment_command):
    """A whole run (warm start, steps, validation, a checkpoint, environment workers) watched from
    outside: every socket any of its processes listens on, at any time, is on loopback. The policy
    ranks' store and gloo pairs are among them (torch's TCPStore alone binds every interface)."""
    command = readme_environment_command
    assert command.returncode == 0, command.stderr[-3000:]
    policy = [entry for entry in command.tree.listening if "MegatronModelWorker" in entry[0]]
    assert policy, f"no policy rank was seen listening: {sorted(command.tree.listening)}"
    assert command.tree.exposed() == [], f"listening beyond loopback: {command.tree.exposed()}"
    assert command.left_running == []
