"""Ports for the Ray heads tests start with `ray start`, which takes port numbers, not sockets."""

import random
import socket

# below the kernel's ephemeral range (32768+ on Linux) and above Ray's worker ports (10002-19999): a
# port the kernel hands out (bind to port 0) is free only until the socket closes, and any process's
# next outgoing connection may take it before `ray start` binds it
QUIET_PORTS = range(20000, 32768)


def unused_ports(host: str, count: int = 1) -> list[int]:
    """`count` distinct ports that nothing listens on at host now."""
    ports = []
    while len(ports) < count:
        port = random.choice(QUIET_PORTS)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports
