"""Code run on several ranks of one torch.distributed gloo group on this machine, a process each."""

import socket

import torch.multiprocessing as mp


def on_gloo_ranks(checks, nprocs: int = 2) -> dict:
    """checks(rank, port, results) in nprocs spawned processes, which meet at 127.0.0.1:port (free
    when chosen) and each put what it found in results[rank]. Returns {rank: what it found}."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(checks, args=(port, results), nprocs=nprocs)
        return dict(results)
