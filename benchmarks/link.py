"""Two Ray nodes on one machine (127.0.0.2 and 127.0.0.3, each started with `ray start`), and a
bandwidth cap on what reaches one of them: a network between nodes, measurable on one machine.

The cap is Linux traffic control on the loopback interface: an htb class at the given rate for
packets to the capped address, every other packet unlimited. It needs root (CAP_NET_ADMIN) and
the kernel's htb and u32 modules; on a machine without them, link_cap says so and changes nothing."""

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

NODES = ("127.0.0.2", "127.0.0.3")


def _stop(process: subprocess.Popen) -> None:
    """`ray start --block` leads its node's processes in a session of their own: end the group."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            pass


def token_env() -> dict:
    """This process's environment with Ray's token authentication on and a new token, as a real
    cluster runs it: the nodes and every driver that joins them need it (Ray reads it on import)."""
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": secrets.token_hex(32)}


@contextmanager
def two_local_nodes(env: dict, log_dir: Path, cpus_per_node: int = 1, dashboard_ports: tuple[int, ...] = (),
                    gpus_per_node: int = 0):
    """Yields the head's GCS address; the nodes run with `env` (token_env()) and log to
    log_dir/head.log and worker.log; both stop on exit, by process group. dashboard_ports: three
    unused ports, for Ray's dashboard on the head (its job API: `ray job submit --address
    http://<head>:<first port>`) and each node's dashboard agent (by default both agents would
    take Ray's one default port). gpus_per_node: the host's GPUs split between the nodes, the
    head taking the first ones (each node sees only its own, as on two machines)."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    ray_dir = tempfile.mkdtemp(prefix="rlkit-2n-", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    common = ["--block", f"--num-cpus={cpus_per_node}", "--disable-usage-stats", f"--num-gpus={gpus_per_node}"]
    # at SIGTERM `ray start --block` drains its node first, for up to 30 s (the head's drain waits on
    # a GCS the same signal stops): _stop's SIGKILL ended each node 5 s later, before Ray's own
    # cleanup. These nodes serve nothing to drain.
    env = {**env, "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    node_envs = [{**env, "CUDA_VISIBLE_DEVICES": ",".join(str(n * gpus_per_node + g) for g in range(gpus_per_node))}
                 if gpus_per_node else env for n in range(2)]
    nodes = []
    try:
        # port 0: the head binds a free port itself (a port chosen here could be taken before it binds)
        # and writes its address to ray_current_cluster
        with open(log_dir / "head.log", "w") as log:
            nodes.append(subprocess.Popen(
                [ray_cli, "start", "--head", f"--node-ip-address={NODES[0]}", "--port=0",
                 *([f"--dashboard-host={NODES[0]}", f"--dashboard-port={dashboard_ports[0]}",
                    f"--dashboard-agent-listen-port={dashboard_ports[1]}"] if dashboard_ports else
                   ["--include-dashboard=false"]),
                 f"--temp-dir={ray_dir}", *common], stdout=log, stderr=subprocess.STDOUT, env=node_envs[0],
                start_new_session=True))
        address_file, deadline = Path(ray_dir) / "ray_current_cluster", time.monotonic() + 120
        while not (address_file.is_file() and address_file.read_text().strip()):
            if nodes[0].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head on {NODES[0]} did not start:\n"
                                   + (log_dir / "head.log").read_text()[-2000:])
            time.sleep(0.5)
        address = address_file.read_text().strip()
        with open(log_dir / "worker.log", "w") as log:
            nodes.append(subprocess.Popen(
                [ray_cli, "start", f"--address={address}", f"--node-ip-address={NODES[1]}", *common,
                 *([f"--dashboard-agent-listen-port={dashboard_ports[2]}"] if dashboard_ports else [])],
                stdout=log, stderr=subprocess.STDOUT, env=node_envs[1], start_new_session=True))
        yield address
    finally:
        for node in reversed(nodes):
            _stop(node)
        shutil.rmtree(ray_dir, ignore_errors=True)


def _tc(*args: str) -> None:
    result = subprocess.run(["tc", *args], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"tc {' '.join(args)}: {result.stderr.strip()}")


@contextmanager
def link_cap(address: str, gbit: float | None):
    """Packets on loopback to `address` leave at most at `gbit` Gbit/s while inside (None: no cap).
    Refuses to touch a loopback interface that already has a queueing discipline of its own."""
    if gbit is None:
        yield
        return
    if shutil.which("tc") is None:
        raise RuntimeError("capping the link needs tc (iproute2) and root")
    current = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
    if current.strip() and "noqueue" not in current:
        raise RuntimeError(f"lo already has a queueing discipline ({current.strip()}); not replacing it")
    _tc("qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10")
    try:
        _tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit")
        _tc("class", "add", "dev", "lo", "parent", "1:", "classid", "1:20", "htb", "rate", f"{gbit}gbit",
            "ceil", f"{gbit}gbit")
        _tc("filter", "add", "dev", "lo", "parent", "1:", "protocol", "ip", "prio", "1", "u32", "match", "ip",
            "dst", f"{address}/32", "flowid", "1:20")
        yield
    finally:
        _tc("qdisc", "del", "dev", "lo", "root")
