"""WorkerGroup's error naming on a real local Ray cluster: when a worker dies inside a
collective, its peer fails first ("connection closed by peer"), yet the error names the dead one."""

import os
import socket
import sys
import time

import pytest
from ray import cloudpickle
from ray.util.placement_group import placement_group, remove_placement_group

from rlkit.cluster.worker_group import WorkerError, WorkerGroup


class PairedWorker:
    """Rank 1 listens; rank 0 connects and then dies, which rank 1 sees as a closed connection."""

    def __init__(self, rank: int):
        self.rank = rank
        self.listener = None

    def listen(self) -> int:
        self.listener = socket.create_server(("127.0.0.1", 0))
        return self.listener.getsockname()[1]

    def exchange(self, port: int):
        if self.rank == 0:
            socket.create_connection(("127.0.0.1", port))
            time.sleep(0.2)
            os._exit(1)
        peer, _ = self.listener.accept()
        if peer.recv(1) == b"":
            raise ConnectionError("connection closed by peer")


# the workers' class travels by value: this test module is not importable in Ray's worker processes
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture
def paired_group(ray_cluster):
    pg = placement_group([{"CPU": 0.5}], strategy="PACK")
    pg.wait(60)
    group = WorkerGroup.start("policy", PairedWorker, pg, [0, 0], share=0.1, device="CPU",
                              make_args=lambda rank: {"rank": rank}, timeout_s=60)
    yield group
    group.kill()
    remove_placement_group(pg)


def test_a_death_is_named_over_the_errors_it_causes_in_peers(paired_group):
    port, = paired_group.only([1], PairedWorker.listen)
    with pytest.raises(WorkerError) as error:
        paired_group.every_rank(PairedWorker.exchange, port)
    message = str(error.value)
    assert message.startswith("policy worker 0 died during 'exchange'"), message
    assert "worker 1 then failed: ConnectionError('connection closed by peer')" in message
