"""Join the Ray cluster named by cluster.address / RAY_ADDRESS, or start a local one."""

import functools
import importlib.util
import logging
import os
import signal
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import ray
from ray._private import ray_constants, services
from ray._private import utils as ray_utils
from ray._private.authentication.authentication_token_generator import generate_new_authentication_token
from ray._private.node import Node

from rlkit.cluster.fork_server import CLIENT, ForkServer, preload_for
from rlkit.cluster.fork_server import available as fork_server_available
from rlkit.cluster.process_group import ProcessGroup
from rlkit.config.schema import ClusterConfig, ConfigError
from rlkit.observability import console

log = logging.getLogger(__name__)
_fork_server: ForkServer | None = None  # the local cluster's, while it runs
_process_group: ProcessGroup | None = None  # the local cluster's processes', while it runs
TOKEN_ENV = "RAY_AUTH_TOKEN"


def join_or_start_ray(cfg: ClusterConfig, bridge: str, fork_server: ForkServer | None = None) -> bool:
    """Returns True if this call started a local cluster (the caller shuts it down). Its workers
    fork from fork_server (a command's, started as it began: fork_server.start_ahead; the cluster
    stops it), else from one started here that preloads policy.bridge's library (bridge)."""
    if ray.is_initialized():
        return False
    console.route_ray_output()
    if not (sys.stdout.isatty() and sys.stderr.isatty()):  # a log file: no colour codes in the
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # "(Worker pid=...)" prefix the driver prints
    joining = cfg.address_to_join()
    if joining:
        key, address = joining
        _wait_for_cluster(key, address, cfg.connect_timeout_s)
        log.info("joining Ray cluster at %s", address)
        with _own_signal_handlers():
            ray.init(address=address, log_to_driver=True)
        return False
    _start_local(cfg, bridge, fork_server)
    log.info("started a local Ray cluster (%d logical CPUs, loopback only)", cfg.num_cpus)
    return True


def _start_local(cfg: ClusterConfig, bridge: str, started_ahead: ForkServer | None) -> None:
    """A cluster that listens on 127.0.0.1 only and runs no dashboard."""
    global _fork_server, _process_group
    try:
        _fork_server = started_ahead
        if _fork_server is not None and _fork_server.process.poll() is not None:  # it died meanwhile
            _fork_server.stop()
            _fork_server = None
        if _fork_server is None and cfg.fork_workers and fork_server_available():
            _fork_server = ForkServer.start(preload_for(bridge))
        # the raylet holds the first driver's registration until a worker it starts for it ahead
        # has started: a forked one waits for the server's imports (vLLM's, on a GPU: 15-20 s),
        # which would keep the driver from its own start-up meanwhile. Workers start on demand.
        system_config = {"prestart_worker_first_driver": False} if _fork_server is not None else {}
        _own_token()
        _process_group = ProcessGroup()
        with _local_node_settings(_fork_server, _process_group), _own_signal_handlers():
            # address="local" ignores a stale /tmp/ray/ray_current_cluster
            ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=False,
                     object_store_memory=cfg.object_store_mb * 1024 * 1024, log_to_driver=True,
                     _system_config=system_config)
    except BaseException as error:
        if _process_group is not None and not isinstance(error, KeyboardInterrupt):
            _process_group.removes(None)  # Ray's logs say why it did not start
        _stop_local_processes()
        raise


@contextmanager
def _local_node_settings(fork_server: ForkServer | None, process_group: ProcessGroup):
    """What ray.init cannot be told for a local node, set while it starts, restored after."""
    # Ray's servers (GCS, raylet, object manager, workers, agents, metrics) listen on loopback only
    # when the node IP is 127.0.0.1, but on Linux Ray replaces a loopback node IP by the machine's
    # address (services.resolve_ip_for_localhost) unless it runs single-machine, as on macOS and
    # Windows. Single-machine while the node starts; its IP is fixed from then on.
    multi_node = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    # Ray turns token authentication on for a new cluster (RAY_AUTH_MODE unset) and warns that it
    # did, advising how to opt out; it stays on, and the advice is noise for a loopback-only cluster
    token_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    token_log.addFilter(_token_auth_notice)
    # include_dashboard=False still starts the dashboard's head process (usage stats and a metrics
    # port) and waits until it registers: 0.8 s of a 4.4 s start on 2 cores. Ray runs on without
    # it, as it does when that process fails to start; "" is the address a minimal install gives.
    start_api_server = Node.start_api_server
    Node.start_api_server = lambda node, **_: setattr(node, "_webui_url", "")
    # node settings ray.init cannot pass (_local_params)
    node_init = Node.__init__
    Node.__init__ = lambda node, ray_params, *args, **kwargs: node_init(
        node, _local_params(ray_params, fork_server), *args, **kwargs)
    # the session folder, from as soon as the node has made it, goes with the group if the driver ends
    # without stop_local_ray (a SIGKILL), or as a start that did not complete is stopped
    init_temp = Node._init_temp

    def init_temp_removed_with_group(node, *args, **kwargs):
        init_temp(node, *args, **kwargs)
        process_group.removes(Path(node.get_session_dir_path()))

    Node._init_temp = init_temp_removed_with_group
    # forked workers: the raylet runs the fork server's client as its Python worker script, which
    # finds the server and Ray's worker script in the environment the raylet inherits from here.
    # (A job runtime_env could name the client instead, as its py_executable, but then Ray runs
    # its setup_worker.py before each worker: 0.3 s of CPU apiece.)
    client_environment = fork_server.client_environment(_ray_worker_script()) if fork_server else {}
    os.environ.update(client_environment)
    # Ray's processes (GCS, raylet, and the agents and workers the raylet starts) out of the driver's
    # process group: its signals are the driver's to handle (rlkit/cluster/process_group.py)
    console_popen = services.ConsolePopen
    services.ConsolePopen = functools.partial(console_popen, process_group=process_group.pgid)
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = multi_node
        Node.start_api_server, Node.__init__, Node._init_temp = start_api_server, node_init, init_temp
        services.ConsolePopen = console_popen
        token_log.removeFilter(_token_auth_notice)
        for name in client_environment:
            os.environ.pop(name, None)


@contextmanager
def _own_signal_handlers():
    """Around ray.init: where the driver handles SIGTERM itself (rlkit's commands stop where they are,
    then at the next step), Ray's Python handlers, which exit at once without a word, are not set
    (its driver's, and its local node's, which kills the cluster's processes first); and the driver's
    handlers are set again after, in front of the one Ray's core installs, which prints a C++ stack
    dump before it calls them."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    if not callable(handlers[signal.SIGTERM]):
        yield
        return
    set_sigterm_handler = ray_utils.set_sigterm_handler
    ray_utils.set_sigterm_handler = lambda handler: None
    try:
        yield
    finally:
        ray_utils.set_sigterm_handler = set_sigterm_handler
        for s, handler in handlers.items():
            signal.signal(s, handler)


def _own_token() -> None:
    """The local cluster's authentication token, in the environment its processes inherit: Ray turns
    token authentication on for a new cluster and, where no token is set, saves a new one to
    ~/.ray/auth_token, which every later cluster of the user's then shares. A token of the user's
    (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH) is kept, and so is this one for the process's later local
    clusters: Ray's driver keeps the first token it reads."""
    if not {TOKEN_ENV, "RAY_AUTH_TOKEN_PATH"} & os.environ.keys():
        os.environ[TOKEN_ENV] = generate_new_authentication_token()


def _local_params(ray_params, fork_server: ForkServer | None):
    """A local node's settings that ray.init cannot pass."""
    # Ray's dashboard agent listens on one fixed port (52365) unless told otherwise: on a machine
    # where another cluster runs (another run's, a test session's) it retries that port for 3.4 s
    # while the node waits, then runs without it. 0: a free port, as Ray's other agents get.
    ray_params.dashboard_agent_listen_port = 0
    # the autoscaler's monitor process has nothing to scale on one machine (it costs 0.4 s of CPU,
    # and a second cluster's monitor fails to bind its fixed metrics port)
    ray_params.no_monitor = True
    if fork_server is not None:  # its workers start through the client (see _local_node_settings)
        ray_params.worker_path = str(CLIENT)
    return ray_params


def _ray_worker_script() -> str:
    """The script a raylet runs for each Python worker unless told otherwise: default_worker.py."""
    return importlib.util.find_spec("ray._private.workers.default_worker").origin


def _token_auth_notice(record: logging.LogRecord) -> bool:
    """False (drop it) for Ray's "Token authentication is enabled for this Ray cluster" warning."""
    return not record.getMessage().startswith("Token authentication is enabled")


def _wait_for_cluster(key: str, address: str, timeout_s: float) -> None:
    """Ray retries a GCS that does not answer for many minutes; fail within timeout_s instead."""
    # The host:port that ray.init will reach: Ray resolves "auto" and replaces a localhost by the
    # machine's address; a ray:// client address is used as written.
    if address.startswith("ray://"):
        target = address.removeprefix("ray://")
    else:
        target = services.canonicalize_bootstrap_address(address)
    host, _, port = target.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=max(deadline - time.monotonic(), 0.1)):
                return
        except OSError:
            # a head that is still starting gets the rest of the time
            if time.monotonic() >= deadline:
                raise ConfigError(f'{key}={address}: no Ray cluster answered within {timeout_s:g} s; start one '
                                      f'with "ray start --head" or unset cluster.address / RAY_ADDRESS to start a '
                                      f'local one') from None
            time.sleep(0.2)


def stop_local_ray(keep_logs: bool) -> None:
    """Shut down the local cluster this process started. Its session folder (logs, sockets) is
    removed unless keep_logs (a failed run: the workers' logs are the evidence); Ray itself leaves
    every session folder in its temp directory forever."""
    session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
    ray.shutdown()
    if keep_logs:
        _process_group.removes(None)
        log.info("Ray's logs of this run are in %s", session_dir / "logs")
    _stop_local_processes()  # the process group's stop removes the session folder it was given


def _stop_local_processes() -> None:
    """The fork server, and what is left in the cluster's process group once Ray has stopped."""
    global _fork_server, _process_group
    if _fork_server is not None:
        _fork_server.stop()
        _fork_server = None
    if _process_group is not None:
        _process_group.stop()
        _process_group = None


def device_kind() -> str:
    return "GPU" if ray.cluster_resources().get("GPU", 0) > 0 else "CPU"
