"""What a run started: every process under its driver, and what each listens on."""

import ipaddress
import socket
import time
from dataclasses import dataclass, field

import psutil


@dataclass
class ProcessTree:
    """Processes seen under one driver process, and every socket any of them listened on, over
    repeated looks (see watch)."""
    root: int
    processes: dict = field(default_factory=dict)  # pid -> (create_time, command line)
    listening: set = field(default_factory=set)  # (command line, ip, port)

    def look(self, sockets: bool = True) -> None:
        """Record the processes under the root now and, with sockets, what each listens on (the
        slow part: a read of the socket tables per process)."""
        try:
            root = psutil.Process(self.root)
            found = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for process in found:
            try:
                command = " ".join(process.cmdline())[:200]
                self.processes[process.pid] = (process.create_time(), command)  # a Ray worker renames itself
                for c in process.net_connections(kind="inet") if sockets else ():
                    if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and c.laddr and c.laddr.port):
                        self.listening.add((command[:60], c.laddr.ip, c.laddr.port))
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                pass  # ended meanwhile

    def watch(self, until, interval_s: float = 0.2, timeout_s: float = 600) -> None:
        """Look every interval_s until until() is true."""
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, "the run took too long"
            self.look()
            time.sleep(interval_s)

    def exposed(self) -> list:
        """Sockets listening beyond loopback."""
        return sorted(entry for entry in self.listening if not is_loopback(entry[1]))

    def still_alive(self, grace_s: float = 20) -> list[str]:
        """The processes seen that are alive grace_s from now; each is then killed."""
        deadline = time.monotonic() + grace_s
        alive = [pid for pid in self.processes if self._alive(pid)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.5)
            alive = [pid for pid in alive if self._alive(pid)]
        for pid in alive:
            psutil.Process(pid).kill()
        return [f"{pid} {self.processes[pid][1][:100]}" for pid in alive]

    def _alive(self, pid: int) -> bool:
        try:
            process = psutil.Process(pid)
            return process.create_time() == self.processes[pid][0] and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback  # ::ffff:127.0.0.1 is loopback too
