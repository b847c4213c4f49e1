"""torch.distributed process groups that listen on one address: the node's own.

torch's TCPStore server binds every interface (`::`) whatever host it is given, and gloo and NCCL
pick their interface from the hostname. A store has no authentication, so a run on a loopback
cluster must not be reachable from the network: rank 0 binds the store's socket itself and hands
it over, and gloo/NCCL are told which interface holds the address."""

import importlib
import ipaddress
import os
import socket
from datetime import timedelta

import psutil
import torch.distributed as dist

# the variables gloo and NCCL read for the interface their sockets use
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def interface_of(address: str) -> str:
    """The name of this machine's network interface whose network holds `address` (e.g. 'lo' for
    127.0.0.1, and for 127.0.0.2, which no interface names but lo's 127.0.0.0/8 routes)."""
    target = ipaddress.ip_address(address)
    for name, addresses in psutil.net_if_addrs().items():
        for a in addresses:
            if a.family not in (socket.AF_INET, socket.AF_INET6) or not a.netmask:
                continue
            prefix = bin(int(ipaddress.ip_address(a.netmask))).count("1")
            network = ipaddress.ip_network(f"{a.address.split('%')[0]}/{prefix}", strict=False)
            if target.version == network.version and target in network:
                return name
    raise RuntimeError(f"no network interface of this machine reaches {address}, the worker's Ray node address")


def use_interface_of(address: str) -> None:
    """gloo and NCCL listen on the interface of `address`, unless the user chose one already. A
    loopback address takes loopback whatever the environment says: a variable inherited from the
    shell (another cluster's interface) would otherwise open a loopback cluster's ranks to the network."""
    name = interface_of(address)
    loopback = ipaddress.ip_address(address).is_loopback
    for variable in INTERFACE_VARIABLES:
        if loopback:
            os.environ[variable] = name
        else:
            os.environ.setdefault(variable, name)


def bound_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """The TCPStore of a process group: rank 0 serves it on host:port (port 0: a free one) and
    nowhere else, the other ranks connect to it."""
    listen_fd = None
    if rank == 0:
        server = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, port))
        server.listen(world_size)
        port = server.getsockname()[1]
        listen_fd = server.detach()  # the store owns the socket from here on, and closes it
    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, master_listen_fd=listen_fd)


def init_process_group(backend: str, host: str, port: int, rank: int, world_size: int, timeout: timedelta,
                       node_address: str) -> None:
    """dist.init_process_group with its store on host:port (bound_store) and gloo/NCCL sockets on
    the interface of node_address, this worker's own node."""
    use_interface_of(node_address)
    store = bound_store(host, port, rank, world_size, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def bind_tcp_rendezvous_stores() -> None:
    """Process groups this process joins through `init_method="tcp://host:port"`, as vLLM's
    engine does, get their store from bound_store: served on host alone. torch makes that store
    in rendezvous._create_c10d_store (private; the same signature from torch 2.0 to 2.13)."""
    # the module: torch.distributed's attribute of that name is its rendezvous function
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    if getattr(rendezvous._create_c10d_store, "binds_its_host", False):
        return

    def create_store(hostname, port, rank, world_size, timeout, use_libuv=True):
        return bound_store(hostname, port, rank, world_size, timeout)

    create_store.binds_its_host = True
    rendezvous._create_c10d_store = create_store
