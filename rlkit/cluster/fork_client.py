"""What a local cluster's raylet runs as its Python worker script when workers fork
(cluster.fork_workers): `python fork_client.py ARGS...`, with the fork server's socket and Ray's own
worker script (default_worker.py) in its environment (SOCKET_ENV, WORKER_ENV). It hands
`WORKER ARGS...`, its environment, working directory and standard streams to the fork server
(rlkit/cluster/fork_server.py), which forks the worker, then lives as long as the worker does and
exits with its status; signals it gets go to the worker. Where the server is not there or cannot
fork, it becomes the worker itself (exec). The standard library only: it starts in about 20 ms."""

import json
import os
import signal
import socket
import struct
import sys

SOCKET_ENV, WORKER_ENV = "RLKIT_FORK_SOCKET", "RLKIT_FORK_WORKER"
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def _exec_worker(argv: list[str]) -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)  # a mask outlives exec: the worker's starts clear
    os.execv(sys.executable, [sys.executable, *argv])


def _receive_int(connection: socket.socket) -> int | None:
    """None: the server closed the connection (or reset it, closing with our request unread)."""
    data = b""
    while len(data) < 4:
        try:
            chunk = connection.recv(4 - len(data))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        data += chunk
    return struct.unpack("i", data)[0]


def main(args: list[str]) -> int:
    # taken out of the environment: the worker's is the one it would have had without the client
    path, argv = os.environ.pop(SOCKET_ENV, ""), [os.environ.pop(WORKER_ENV), *args]
    # held until the worker's pid is known: a signal sent while the server forks is forwarded, not lost
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:  # the server stopped (or never started): a worker of its own
        _exec_worker(argv)
    request = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    try:
        socket.send_fds(connection, [struct.pack("i", len(request)) + request], [0, 1, 2])
    except OSError:
        _exec_worker(argv)
    pid = _receive_int(connection)
    if pid is None:  # it closed without forking: preloading failed, so it serves no one
        _exec_worker(argv)
    for signum in FORWARDED:
        signal.signal(signum, lambda received, _: os.kill(pid, received))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    status = _receive_int(connection)
    if status is None:  # the server died; its workers die with it
        return 1
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
