"""torch.distributed rendezvous on one address: the store and gloo listen on loopback alone."""

import importlib
import socket
from datetime import timedelta

import psutil
import pytest
import torch
import torch.distributed as dist

from rlkit.workers import rendezvous
from rlkit.workers.rendezvous import init_process_group, interface_of


def loopback_interface() -> str:
    return next(name for name, addresses in psutil.net_if_addrs().items()
                if any(a.address == "127.0.0.1" for a in addresses))


def test_an_address_maps_to_the_interface_whose_network_holds_it():
    assert interface_of("127.0.0.1") == loopback_interface()
    assert interface_of("127.0.0.3") == loopback_interface()  # no interface names it; lo's /8 holds it
    with pytest.raises(RuntimeError, match="no network interface of this machine reaches 203.0.113.7"):
        interface_of("203.0.113.7")  # TEST-NET-3: never assigned


def listening() -> list[tuple[str, int]]:
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def other_interface() -> str | None:
    """A network interface of this machine with an address that is not loopback, if it has one."""
    return next((name for name, addresses in psutil.net_if_addrs().items()
                 if any(a.family == socket.AF_INET and not a.address.startswith("127.") for a in addresses)), None)


@pytest.mark.parametrize("inherited", ["unset", "another interface"])
def test_a_process_group_listens_on_its_node_address_only(monkeypatch, inherited):
    """Also where the environment names another interface for gloo and NCCL (a shell's setting for
    another cluster): a loopback node's ranks stay on loopback."""
    interface = other_interface() if inherited == "another interface" else None
    if inherited == "another interface" and interface is None:
        pytest.skip("this machine has no interface beyond loopback")
    for variable in rendezvous.INTERFACE_VARIABLES:
        monkeypatch.setenv(variable, interface or "")  # recorded, so the test's own setting is undone after it
        if interface is None:
            monkeypatch.delenv(variable)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = set(listening())
    init_process_group("gloo", "127.0.0.1", port, 0, 1, timedelta(seconds=30), node_address="127.0.0.1")
    try:
        tensor = torch.ones(3)
        dist.all_reduce(tensor)
        opened = set(listening()) - before
        assert ("127.0.0.1", port) in opened  # the store, bound where it was told
        assert opened and all(ip in ("127.0.0.1", "::ffff:127.0.0.1") for ip, _ in opened), opened
    finally:
        dist.destroy_process_group()


def test_a_tcp_init_method_serves_its_store_on_its_host_alone(monkeypatch):
    """init_method="tcp://host:port", the way vLLM's engine joins its group: torch alone would
    serve the store on every interface (::)."""
    torch_rendezvous = importlib.import_module("torch.distributed.rendezvous")
    monkeypatch.setattr(torch_rendezvous, "_create_c10d_store", torch_rendezvous._create_c10d_store)
    rendezvous.bind_tcp_rendezvous_stores()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    before = set(listening())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        assert ("127.0.0.1", port) in set(listening()) - before
        assert ("::", port) not in listening()
    finally:
        dist.destroy_process_group()
