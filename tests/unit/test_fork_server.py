"""The worker fork server (rlkit/cluster/fork_server.py) with real processes, as a raylet drives it:
a worker started through fork_client.py is a child of the server that runs the script with the
client's arguments, environment, working directory and standard streams, and the client exits with
its status; lifetimes are tied (a client's signal reaches its worker, a killed client's worker is
killed, a stopped server's workers die, and so does a server whose driver process ended, even
after the thread that started it); with no server, or one whose preload started a thread, the
client becomes the worker itself; Ray is kept out of the preload and is there in each worker. The
default preload is fork-safe (it imports no Ray, starts no Python thread, initializes no CUDA); a
command starts its server ahead only where it will start a local cluster."""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import psutil
import pytest

from rlkit.cluster import fork_server
from rlkit.cluster.fork_server import ForkServer
from rlkit.config.schema import ClusterConfig

WORKER = textwrap.dedent("""\
    import gc, json, os, random, sys, time
    import helper  # from PYTHONPATH in the client's environment
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": os.environ.get("WORKER_ENV"), "pid": os.getpid(),
                      "ppid": os.getppid(), "random": random.random(), "helper": helper.VALUE,
                      "client_env": [os.environ.get("RLKIT_FORK_SOCKET"), os.environ.get("RLKIT_FORK_WORKER")],
                      "gc": [gc.isenabled(), gc.get_freeze_count()]}),
          flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if sys.argv[1] == "sleep":
        time.sleep(60)
    sys.exit(int(sys.argv[2]))
""")


@pytest.fixture
def script(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper.py").write_text("VALUE = 7\n")
    (tmp_path / "worker.py").write_text(WORKER)
    return tmp_path / "worker.py"


@pytest.fixture
def server():
    started = ForkServer.start(preload=("json",))
    yield started
    started.stop()


def run_worker(socket: Path, script: Path, *args: str, wait: bool = True):
    """fork_client.py as the raylet runs it (as its worker script, the server's client_environment
    inherited), in script's folder with its own env."""
    env = {**os.environ, "WORKER_ENV": "from the client", "PYTHONPATH": str(script.parent / "lib"),
           fork_server.SOCKET_ENV: str(socket), fork_server.WORKER_ENV: str(script)}
    process = subprocess.Popen([sys.executable, str(fork_server.CLIENT), *args],
                               cwd=script.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return process
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


def test_a_forked_worker_runs_as_the_client_would_and_its_status_comes_back(server, script):
    status, out, err = run_worker(server.socket, script, "exit", "3")
    seen = json.loads(out)
    assert status == 3 and err == "to stderr\n"
    assert seen["argv"] == [str(script), "exit", "3"] and seen["cwd"] == str(script.parent)
    assert seen["env"] == "from the client" and seen["helper"] == 7
    assert seen["client_env"] == [None, None]  # the client's own settings stay out of the worker's
    assert seen["ppid"] == server.process.pid  # forked by the server, not started by the client
    # what the server preloaded is frozen: the worker's collections, on as in any process, leave it be
    assert seen["gc"][0] and seen["gc"][1] > 0
    again = json.loads(run_worker(server.socket, script, "exit", "0")[1])
    assert again["random"] != seen["random"]  # each worker seeds its own, as a fresh process does


def wait_for_worker(process) -> psutil.Process:
    return psutil.Process(json.loads(process.stdout.readline())["pid"])


def test_the_server_and_its_workers_are_out_of_the_drivers_process_group(server, script):
    """A signal to the driver's process group (a terminal's Ctrl-C) is the driver's to handle: it
    finishes its step with its workers still there. Each worker leads a group of its own: a raylet
    kills an ended worker's group, which must not hold the server and the other workers."""
    client = run_worker(server.socket, script, "sleep", "0", wait=False)
    worker = wait_for_worker(client)
    try:
        assert os.getpgid(worker.pid) == worker.pid
        assert os.getpgid(server.process.pid) not in (worker.pid, os.getpgid(0))
        assert os.getpgid(worker.pid) != os.getpgid(0)
    finally:
        client.kill()
        client.wait()


def test_a_server_folder_left_by_an_ended_driver_is_removed_as_the_next_server_starts(monkeypatch):
    # a short folder: under xdist pytest's tmp_path would put the server's socket past 107 bytes
    tmp_path = Path(tempfile.mkdtemp(prefix="fs-"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.Popen(["true"])
    ended.wait()
    left, running, other = (tmp_path / f"rlkit-fork-{ended.pid}-x1", tmp_path / f"rlkit-fork-{os.getpid()}-x2",
                            tmp_path / "rlkit-fork-other")
    for directory in (left, running, other):
        directory.mkdir()
        (directory / "fork.sock").touch()
    started = ForkServer.start(preload=("json",))
    try:
        assert not left.exists() and running.exists() and other.exists()
        assert started.directory.name.startswith(f"rlkit-fork-{os.getpid()}-")
    finally:
        started.stop()
        shutil.rmtree(tmp_path)


class Stop(BaseException):
    """What a stop signal's handler raises, as rlkit's does (rlkit/launch/interrupts.py)."""


def test_a_stop_signal_while_the_server_starts_leaves_nothing_behind(monkeypatch):
    """A Ctrl-C or SIGTERM at a command's first moments can come as the server is forked: it is held
    until the server is owned, then stops the start, which stops the server and removes its folder."""
    tmp_path = Path(tempfile.mkdtemp(prefix="fs-"))  # short: see the test above
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    popen, started = subprocess.Popen, []

    def popen_as_a_signal_comes(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        started.append(popen(*args, **kwargs))
        return started[-1]

    def stop(signum, frame):
        raise Stop()

    monkeypatch.setattr(fork_server.subprocess, "Popen", popen_as_a_signal_comes)
    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with pytest.raises(Stop):
            ForkServer.start(preload=("json",))
        assert len(started) == 1 and started[0].poll() is not None  # the server was started, then stopped
        assert list(tmp_path.iterdir()) == []  # its folder too
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(tmp_path)


def test_a_signal_to_the_client_reaches_its_worker(server, script):
    client = run_worker(server.socket, script, "sleep", "0", wait=False)
    worker = wait_for_worker(client)
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=30) == 128 + signal.SIGTERM
    assert not worker.is_running()


def test_a_killed_clients_worker_is_killed(server, script):
    client = run_worker(server.socket, script, "sleep", "0", wait=False)
    worker = wait_for_worker(client)
    client.kill()
    client.wait()
    worker.wait(timeout=30)


def test_a_stopped_servers_workers_die_with_it(server, script):
    client = run_worker(server.socket, script, "sleep", "0", wait=False)
    worker = wait_for_worker(client)
    server.stop()
    worker.wait(timeout=30)
    assert client.wait(timeout=30) != 0
    assert not server.socket.exists() and not server.directory.exists()


def test_without_a_server_the_client_becomes_the_worker(tmp_path, script):
    status, out, err = run_worker(tmp_path / "absent.sock", script, "exit", "5")
    seen = json.loads(out)
    assert status == 5 and err == "to stderr\n" and seen["helper"] == 7 and seen["client_env"] == [None, None]
    assert seen["ppid"] == os.getpid()  # exec'd in place: the process this test started


RAY_USER = textwrap.dedent("""\
    import json, os, sys
    import guarded  # preloaded by the server
    import ray  # what Ray's default_worker.py imports first
    print(json.dumps({"ppid": os.getppid(), "guarded_ray": getattr(guarded.ray, "__name__", None),
                      "same_ray": guarded.ray is ray}), flush=True)
""")


def test_ray_is_kept_out_of_the_preload_and_is_there_in_each_worker(tmp_path, monkeypatch):
    """A module that imports Ray only where it can (as vLLM does) is preloaded without it, and
    imported again in each worker, where it finds Ray; one that needs Ray is left to the workers."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "guarded.py").write_text("try:\n    import ray\nexcept ImportError:\n    ray = None\n")
    (tmp_path / "worker.py").write_text(RAY_USER)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))
    server = ForkServer.start(preload=("guarded", "ray"))
    try:
        status, out, err = run_worker(server.socket, tmp_path / "worker.py")
        assert status == 0, err
        assert json.loads(out) == {"ppid": server.process.pid, "guarded_ray": "ray", "same_ray": True}
    finally:
        server.stop()


def test_a_server_whose_preload_starts_a_thread_serves_no_one(tmp_path, script, monkeypatch):
    (tmp_path / "lib" / "threaded.py").write_text("import threading, time\n"
                                                   "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "lib"))
    refusing = ForkServer.start(preload=("threaded",))
    try:
        status, out, _ = run_worker(refusing.socket, script, "exit", "0")
        assert status == 0 and json.loads(out)["ppid"] == os.getpid()  # exec'd by its client
    finally:
        refusing.stop()


@pytest.mark.parametrize("fork_workers,address,ray_address,started", [
    (True, None, None, True), (True, None, "local", True), (True, "local", None, True),
    (False, None, None, False), (True, "10.0.0.1:6379", None, False), (True, None, "auto", False)])
def test_a_command_starts_its_server_ahead_only_for_a_local_cluster(monkeypatch, fork_workers, address,
                                                                     ray_address, started):
    if ray_address is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", ray_address)
    monkeypatch.setattr(fork_server, "preload_for", lambda bridge: ("json",))
    server = fork_server.start_ahead(ClusterConfig(address=address, fork_workers=fork_workers), "mbridge")
    try:
        assert (server is not None) == started
    finally:
        if server is not None:
            server.stop()


@pytest.mark.parametrize("modules", ["PRELOAD", "GPU_PRELOAD"])
def test_the_default_preload_is_fork_safe(modules):
    """What every run's server imports (vLLM only where it is installed), with either bridge's
    library (both at once here): no Ray, no Python thread, no CUDA, every module that is installed
    imported, and not wandb (which megatron-core would import), though a worker still can (one
    subprocess, about 5 s)."""
    code = (f"import sys; from rlkit.cluster.fork_server import {modules}, BRIDGE_PRELOAD, preload; "
            f"names = tuple(n for m in {modules} for n in (BRIDGE_PRELOAD.values() if m == '<bridge>' else [m])); "
            "print(preload(names)); print(','.join(m for m in names if m.partition(':')[0] not in sys.modules)); "
            "print('wandb' in sys.modules); import wandb")
    checked = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert checked.returncode == 0, checked.stderr[-2000:]
    unsafe, not_imported, wandb_imported = checked.stdout.splitlines()[-3:]
    assert unsafe == "None" and wandb_imported == "False"
    uninstalled = {"vllm.entrypoints.llm"} if importlib.util.find_spec("vllm") is None else set()  # GPU machines only
    assert set(filter(None, not_imported.split(","))) <= uninstalled


DRIVER = textwrap.dedent("""\
    import sys, threading, time
    from rlkit.cluster.fork_server import ForkServer
    started = []
    starter = threading.Thread(target=lambda: started.append(ForkServer.start(preload=("json",))))
    starter.start()
    starter.join()  # the thread that started the server ends; the server stays
    print(started[0].process.pid, started[0].socket, flush=True)
    time.sleep(120)
""")


def test_a_server_lives_as_long_as_the_driver_process_not_the_thread_that_started_it(tmp_path, script):
    driver, socket = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True), None
    try:
        pid, socket = driver.stdout.readline().split()
        server = psutil.Process(int(pid))
        client = run_worker(Path(socket), script, "sleep", "0", wait=False)
        worker = wait_for_worker(client)
        assert server.is_running() and worker.is_running()
        driver.kill()  # no atexit, no stop(): the kernel closes its end of the lifeline
        server.wait(timeout=30)
        worker.wait(timeout=30)
        assert client.wait(timeout=30) != 0
        assert not Path(socket).parent.exists()  # the server removed what the driver's stop() would have
    finally:
        driver.kill()
        driver.wait()
        if socket:  # what the killed driver's stop() would have removed
            shutil.rmtree(Path(socket).parent, ignore_errors=True)


def test_a_client_that_dies_while_it_asks_leaves_the_server_serving(server, script):
    import socket as sockets

    for payload in (b"", b"\x05"):  # gone before a request, and partway through its length
        broken = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
        broken.connect(str(server.socket))
        broken.sendall(payload)
        broken.close()
    status, out, _ = run_worker(server.socket, script, "exit", "0")
    assert status == 0 and json.loads(out)["ppid"] == server.process.pid


def test_the_preload_follows_policy_bridge():
    assert "mbridge" in fork_server.preload_for("mbridge")
    assert fork_server.BRIDGE_PRELOAD["megatron_bridge"] in fork_server.preload_for("megatron_bridge")
    assert "mbridge" not in fork_server.preload_for("megatron_bridge")
