"""Workers of a local cluster fork from one process that has imported their libraries once
(cluster.fork_workers), instead of each importing them: on a small CPU machine torch, transformers and
megatron-core (5-8 s of CPU per worker process, most of a run's start-up there); on a GPU machine
vLLM and megatron-core too (vLLM's import alone is 12-19 s on an H100 host, on the run's critical path).

A `rlkit train` command starts the server as it begins (`start_ahead`), so the server imports while
the driver imports, Ray starts and the data loads; the local cluster's start takes it, or starts
one (`ForkServer.start`), and has the raylet run rlkit/cluster/fork_client.py as its Python worker
script (`client_environment` tells the client where the server and Ray's own worker script are):
the server forks each worker with the client's arguments, environment, working directory and
standard streams. The worker registers with the raylet under its own pid; the client lives as long as it
does and exits with its status. Lifetimes are tied both ways: a worker dies with the server (by the
kernel: PR_SET_PDEATHSIG), the server with the driver process (it holds a pipe's read end, whose
write end only the driver has), a worker with its client (the server kills a worker whose client's
connection closes), and a client exits when its worker does. The server (its workers with it) runs in
a session of its own, out of the driver's process group as the local cluster's Ray processes are
(rlkit/cluster/process_group.py): a signal to that group (a terminal's Ctrl-C) is the driver's to handle. A server's folder that a SIGKILL of both left behind
is removed as the next server starts.

Forking is safe only from a process that runs no Python thread, has run no parallel torch op and
has not initialized CUDA's driver (a forked child could not use CUDA), and only if Ray was not
imported (Ray reads its environment and authentication once, as it imports). So the server keeps
Ray out while it preloads (a module that imports Ray only where it can, as vLLM does, sees it
missing and is imported again in each worker, where Ray is there), checks CUDA's availability by
NVML alone, and checks the rest after preloading; where one does not hold it serves no one, and
every client execs a worker of its own. Linux only."""

import array
import atexit
import contextlib
import ctypes
import gc
import importlib
import json
import logging
import os
import random
import runpy
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

from rlkit.cluster.fork_client import SOCKET_ENV, WORKER_ENV
from rlkit.observability.startup import without_wandb

if TYPE_CHECKING:  # the server's own process imports nothing of rlkit's but its preload
    from rlkit.config.schema import ClusterConfig

log = logging.getLogger(__name__)

# what CPU workers import (torch and transformers with them; none of them imports Ray): the model
# classes, the Megatron worker's module (first: its import filters megatron-core's expected
# warnings), megatron-core as a CPU run imports it, the bridge, and the generation worker's module
PRELOAD = ("transformers.models.qwen2.modeling_qwen2", "transformers.models.llama.modeling_llama",
           "rlkit.workers.policy.megatron", "rlkit.workers.policy.cpu_compat:import_megatron", "<bridge>",
           "rlkit.workers.generation.hf")
# what GPU workers import: vLLM's engine first (the generation workers ask first), then the Megatron
# worker's module, megatron-core as a GPU run imports it, the bridge, and the checker of the GPU
# recipes' math environment (math-verify, with sympy)
GPU_PRELOAD = ("vllm.entrypoints.llm", "rlkit.workers.generation.vllm", "rlkit.workers.policy.megatron",
               "megatron.core.parallel_state", "megatron.core.tensor_parallel.random", "<bridge>", "math_verify")
# "<bridge>" above: policy.bridge's library (Megatron-Bridge imported as its backend does, through its fixes)
BRIDGE_PRELOAD = {"mbridge": "mbridge", "megatron_bridge": "rlkit.bridge.megatron_bridge_compat:auto_bridge"}
_PR_SET_PDEATHSIG = 1
DIRECTORY_PREFIX = "rlkit-fork-"  # a server's folder in the temporary one: rlkit-fork-<driver pid>-<random>
CLIENT = Path(__file__).with_name("fork_client.py")
# the signals that stop a command (rlkit/launch/interrupts.py), deferred while a server is started
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def available() -> bool:
    """Whether this machine's local cluster can fork its workers: Linux."""
    return sys.platform == "linux"


def preload_for(bridge: str) -> tuple[str, ...]:
    """The modules this machine's workers import, with policy.bridge's library: GPU_PRELOAD where an
    NVIDIA GPU is, else PRELOAD."""
    modules = GPU_PRELOAD if Path("/dev/nvidiactl").exists() else PRELOAD
    return tuple(BRIDGE_PRELOAD[bridge] if module == "<bridge>" else module for module in modules)


def start_ahead(cluster: "ClusterConfig", bridge: str) -> "ForkServer | None":
    """At the start of a command that will start a local cluster whose workers fork: the server,
    importing while the driver does, for the command to hand to the cluster (None where no
    local cluster's workers will fork)."""
    if cluster.fork_workers and available() and cluster.address_to_join() is None:
        return ForkServer.start(preload_for(bridge))
    return None


class ForkServer:
    """The driver's handle on a running server."""

    def __init__(self, process: subprocess.Popen, directory: Path, lifeline: int):
        self.process, self.directory, self.lifeline = process, directory, lifeline
        self.socket = directory / "fork.sock"

    @classmethod
    def start(cls, preload: tuple[str, ...], timeout_s: float = 30) -> "ForkServer":
        """Start the server and wait until it listens (it preloads afterwards, while clients queue).
        preload: module names, or module:function to call once imported (preload_for). A server
        that does not start, or a signal that stops the command meanwhile, leaves nothing behind."""
        _remove_stale_directories()
        directory, server = None, None
        try:
            with _stop_signals_deferred():  # until the server is owned: a stop in between would orphan it
                # named after this process, whose end ends the server; short: a socket path fits 107 bytes
                directory = Path(tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{os.getpid()}-"))
                server = cls._spawn(directory, preload)
            deadline = time.monotonic() + timeout_s
            while not server.socket.exists():
                if server.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the worker fork server did not start (exit status {server.process.poll()}); "
                                       f"set cluster.fork_workers=false to start every worker on its own")
                time.sleep(0.01)
            return server
        except BaseException:
            if server is not None:
                server.stop()
            elif directory is not None:
                shutil.rmtree(directory, ignore_errors=True)
            raise

    @classmethod
    def _spawn(cls, directory: Path, preload: tuple[str, ...]) -> "ForkServer":
        """The server's process, serving on a socket in directory once it has started."""
        # the server's read end sees EOF when this process ends, however it ends (PR_SET_PDEATHSIG
        # would follow the thread that started the server, which may end first)
        lifeline_read, lifeline = os.pipe()
        # torch asks NVML, not CUDA's driver, whether a GPU is there (a module that asks as it imports)
        env = {**os.environ, "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
        try:
            process = subprocess.Popen([sys.executable, "-m", "rlkit.cluster.fork_server", str(directory / "fork.sock"),
                                        str(lifeline_read), *preload],
                                       stdin=subprocess.DEVNULL, pass_fds=(lifeline_read,), env=env,
                                       # out of the driver's process group, as the local cluster's Ray processes
                                       # are (ray_runtime): its signal is the driver's alone to handle
                                       start_new_session=True)
        except BaseException:
            os.close(lifeline)
            raise
        finally:
            os.close(lifeline_read)
        server = cls(process, directory, lifeline)
        atexit.register(server.stop)
        return server

    def client_environment(self, worker: str) -> dict[str, str]:
        """Where CLIENT, run as `python CLIENT ARGS...` under this environment, has this server
        start `python worker ARGS...`."""
        return {SOCKET_ENV: str(self.socket), WORKER_ENV: worker}

    def stop(self) -> None:
        """Stop the server (its remaining workers die with it) and remove its folder."""
        if self.lifeline >= 0:
            os.close(self.lifeline)
            self.lifeline = -1
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.directory, ignore_errors=True)  # the socket, or the one the server had yet to name
        atexit.unregister(self.stop)


@contextlib.contextmanager
def _stop_signals_deferred():
    """Within: SIGINT and SIGTERM are noted, not handled; on leaving, the handlers in place get them.
    Python runs signal handlers in the main thread alone, so only there can one interrupt this code."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came = []
    # None: a handler not set from Python, which could not be put back
    previous = {signum: handler for signum in STOP_SIGNALS if (handler := signal.getsignal(signum)) is not None}
    for signum in previous:
        signal.signal(signum, lambda received, _: came.append(received))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in came:
            signal.raise_signal(signum)


def _remove_stale_directories() -> None:
    """This user's server folders whose driver process has ended without removing them (a SIGKILL
    that took the server with it, as one to a cgroup does)."""
    for directory in Path(tempfile.gettempdir()).glob(f"{DIRECTORY_PREFIX}*-*"):
        try:
            owned, driver = directory.stat().st_uid == os.getuid(), int(directory.name.split("-")[2])
        except (OSError, ValueError):  # removed meanwhile, or not named after a driver
            continue
        if owned and not _running(driver):
            shutil.rmtree(directory, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def _remove(socket_path: Path) -> None:
    """The socket and the folder made for it, where they are still there."""
    for remove in (socket_path.unlink, socket_path.parent.rmdir):
        try:
            remove()
        except OSError:
            pass


def _die_with_parent(parent: int) -> None:
    """SIGKILL from the kernel when parent, this process's parent, ends (a single-threaded one)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the request took effect
        os._exit(1)


def preload(names: tuple[str, ...]) -> str | None:
    """Import names, with Ray and wandb kept out; returns why forking is unsafe after that, or None."""
    sys.modules.setdefault("ray", None)  # `import ray` raises ImportError while this placeholder is there
    gc.disable()  # nothing the imports make is garbage worth the full collections their growth would trigger
    try:
        with without_wandb():  # megatron-core's
            for name in names:
                module, _, function = name.partition(":")
                try:
                    imported = importlib.import_module(module)
                except ImportError as error:  # an optional backend that is not installed: its workers import it
                    log.debug("fork server: not preloading %s: %s", module, error)
                    continue
                if function:
                    getattr(imported, function)()
    finally:
        gc.enable()
    if sys.modules.get("ray") is not None:
        return "a preloaded module imported Ray"
    if _cuda_driver_initialized():
        return "a preloaded module initialized CUDA"
    # Python threads only: torch's import starts a native one, which DataLoader's forked workers inherit too
    return f"{threading.active_count()} threads after preloading" if threading.active_count() > 1 else None


def _cuda_driver_initialized() -> bool:
    """Whether this process has initialized CUDA's driver (cuInit): a forked child could not use it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver here
        return False
    count = ctypes.c_int()
    return libcuda.cuDeviceGetCount(ctypes.byref(count)) == 0  # CUDA_ERROR_NOT_INITIALIZED before cuInit


def _without_ray() -> list[str]:
    """The modules preloading left with `ray = None` (they import it only where they can)."""
    return [name for name, module in sys.modules.items()
            if module is not None and vars(module).get("ray", False) is None]


def _with_ray(names: list[str]) -> None:
    """In a worker: Ray importable again, and the modules that found it missing imported again."""
    if "ray" in sys.modules and sys.modules["ray"] is None:
        del sys.modules["ray"]
    for name in names:
        importlib.reload(sys.modules[name])


def _receive_request(connection: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = connection.recvmsg(1 << 16, socket.CMSG_LEN(3 * fds.itemsize))
    for _, _, payload in ancillary:
        fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
    size = struct.unpack("i", data[:4])[0]
    data = data[4:]
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the client closed its request early")
        data += chunk
    return json.loads(data), list(fds)


def _become_worker(request: dict, fds: list[int], server: int, without_ray: list[str]) -> None:
    """In the forked child: the process a fresh `python default_worker.py ...` would be. Never returns."""
    _die_with_parent(server)
    # a process group of its own, as Ray gives the workers it starts: when a worker exits, its raylet
    # kills the worker's process group (what the worker left running), which would otherwise be the
    # server's, every other worker in it
    os.setpgid(0, 0)
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    script, *_ = request["argv"]
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:1] = [os.path.dirname(os.path.abspath(script)), *extra]  # as `python script` sets it
    sys.argv = list(request["argv"])
    random.seed()  # a fresh process seeds from the OS; forked ones would share the server's state
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    if "OMP_NUM_THREADS" in os.environ and "torch" in sys.modules:  # torch read it as it loaded, in the server
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    code = 0
    try:
        _with_ray(without_ray)  # with the worker's environment, as the script's own import of Ray would
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
    os._exit(code)


def serve(path: str, lifeline: int, modules: tuple[str, ...]) -> None:
    """lifeline: the read end of a pipe only the driver writes to; its EOF ends the server."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(128)
    os.rename(path + ".tmp", path)  # ForkServer.start waits for this name: clients queue from here on
    unsafe = preload(modules)
    if unsafe:
        print(f"rlkit fork server: {unsafe}; each worker starts on its own", file=sys.stderr, flush=True)
        return  # the clients' connections close: each execs a worker of its own
    without_ray = _without_ray()
    # no worker's garbage collections walk (and so copy) the pages of what the server imported
    gc.freeze()
    # Python 3.12 warns at every fork of a process with native threads: torch's import starts some
    # (its thread pools, idle here), as it does in every process whose DataLoader forks workers
    warnings.filterwarnings("ignore", message=r"This process \(pid=\d+\) is multi-threaded", category=DeprecationWarning)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))  # nothing to flush; tearing torch down takes a second
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    selector.register(lifeline, selectors.EVENT_READ)
    workers: dict[int, socket.socket] = {}  # pid -> its client's connection
    server = os.getpid()
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                connection, _ = listener.accept()
                try:
                    request, fds = _receive_request(connection)
                except (OSError, ValueError, struct.error):  # a client that died while it asked
                    connection.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    selector.close()
                    for fd in (listener.detach(), wake_read, wake_write, lifeline,
                               *(c.detach() for c in workers.values())):
                        os.close(fd)
                    connection.close()  # held here, a dead server's client would wait on it forever
                    _become_worker(request, fds, server, without_ray)
                for fd in fds:
                    os.close(fd)
                try:
                    connection.sendall(struct.pack("i", pid))
                except OSError:  # its client died meanwhile: so does the worker (reaped below)
                    os.kill(pid, signal.SIGKILL)
                workers[pid] = connection
                selector.register(connection, selectors.EVENT_READ, pid)
            elif key.fileobj == lifeline:  # the driver ended: so do its workers, by their PR_SET_PDEATHSIG
                _remove(Path(path))  # what the driver's stop() would have removed
                os._exit(0)
            elif key.fileobj == wake_read:
                os.read(wake_read, 4096)
                _reap(workers, selector)
            else:  # a client's connection closed: its worker goes too
                if not _still_open(key.fileobj):
                    try:
                        os.kill(key.data, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    selector.unregister(key.fileobj)


def _still_open(connection: socket.socket) -> bool:
    try:
        return connection.recv(1) != b""
    except OSError:
        return False


def _reap(workers: dict[int, socket.socket], selector: selectors.BaseSelector) -> None:
    """Each ended worker's status to its client."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = workers.pop(pid, None)
        if connection is None:
            continue
        try:
            selector.unregister(connection)
        except (KeyError, ValueError):
            pass
        try:
            connection.sendall(struct.pack("i", os.waitstatus_to_exitcode(status)))
        except OSError:
            pass
        connection.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), tuple(sys.argv[3:]))
