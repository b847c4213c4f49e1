"""A new local node's registration is waited for beyond Ray's fixed 30 s (rlkit/cluster/ray_runtime.py):
the lookup Ray makes is asked again until it answers or the deadline passes. (Every local cluster
the integration tests start goes through it against Ray's own lookup.)"""

import time

import pytest

from rlkit.cluster.ray_runtime import node_once_registered


class NotYetRegistered:
    """A GCS lookup that answers only on its third call, as Ray's does for a node still starting."""

    def __init__(self):
        self.calls = []

    def __call__(self, gcs_address, node_id):
        self.calls.append((gcs_address, node_id))
        if len(self.calls) < 3:
            raise RuntimeError(f"GCS cannot find the node with node ID {node_id}")
        return {"node_id": node_id}


def test_a_node_still_registering_is_asked_for_again_until_it_answers():
    lookup = NotYetRegistered()
    assert node_once_registered(lookup, time.monotonic() + 60, "127.0.0.1:6379", "ab12") == {"node_id": "ab12"}
    assert lookup.calls == [("127.0.0.1:6379", "ab12")] * 3


def test_a_node_that_never_registers_fails_once_the_deadline_passes():
    def never(gcs_address, node_id):
        raise RuntimeError("GCS cannot find the node")

    with pytest.raises(RuntimeError, match="cannot find the node"):
        node_once_registered(never, time.monotonic() + 0.3, "127.0.0.1:6379", "ab12")
