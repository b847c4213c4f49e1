"""The refit channel and the receiver threads it serves: refits started by the sender are served and
reported; a failure is one error naming the receiver, after which it connects again; a
stranger, a silent peer and a vanished peer are each one error that says what happened, never
a hang. (The GPU transports that run over it are tested in tests/gpu.)"""

import socket
import threading

import pytest

from rlkit.refit.channel import ChannelServer, ChannelThread, connect_to_sender
from rlkit.refit.plan import RefitPlan

PLAN = RefitPlan.build([("w", (2, 2), "float32")], 1 << 20)


def _stop(server: ChannelServer, receivers: list[ChannelThread]):
    server.close()  # receivers are told the channel is closed for good, and end
    for receiver in receivers:
        receiver.thread.join(timeout=10)
        assert not receiver.thread.is_alive()


def test_standing_receivers_serve_each_refit_and_the_plan_travels_once():
    served = []

    def serve(channel, plan, start):  # stands in for a transport's data path: one message each way
        served.append((plan, start.plan is not None))
        payload = channel.receive("the payload")
        channel.send(payload * 2)
        return {"payload": payload}

    server = ChannelServer(receivers=2, timeout_s=10)
    receivers = [ChannelThread(server.address, f"generation worker {i}", serve, None, 10) for i in range(2)]
    for refit in (1, 2):
        server.accept_receivers()
        channels = server.begin(PLAN, verify=False)
        for channel in channels:
            channel.send(refit)
        assert [channel.receive("the answer") for channel in channels] == [2 * refit] * 2
        assert server.finish() == [{"payload": refit}] * 2
    assert sorted(c.peer for c in channels) == ["generation worker 0", "generation worker 1"]
    assert [plan for plan, _ in served] == [PLAN] * 4
    assert [sent for _, sent in served] == [True, True, False, False]  # the plan went with the first refit only
    _stop(server, receivers)
    # told the channel closed for good, not left to find nobody listening (a new channel may
    # take the same port)
    assert [r.last_error for r in receivers] == [None, None]


def test_a_failed_refit_names_the_receiver_and_it_connects_again():
    def serve(channel, plan, start):
        if start.verify:
            raise ValueError("bucket 3 failed its checksum")
        return {"loaded": True}

    server = ChannelServer(receivers=1, timeout_s=10)
    receiver = ChannelThread(server.address, "generation worker 0", serve, None, 10)
    assert server.accept_receivers()
    server.begin(PLAN, verify=True)
    with pytest.raises(RuntimeError, match="generation worker 0 failed: ValueError: bucket 3 failed its checksum"):
        server.finish()
    server.abort()
    assert server.accept_receivers()  # the receiver came back on a fresh connection
    server.begin(PLAN, verify=False)
    assert server.finish() == [{"loaded": True}]
    assert not server.accept_receivers()
    server._channels[0].send("not a refit")  # a protocol error is reported like any other
    with pytest.raises(RuntimeError, match="generation worker 0 failed: RuntimeError: refit: expected the start of a "
                                           "refit, got 'not a refit'"):
        server.finish()
    _stop(server, [receiver])


def test_a_connection_without_the_token_is_refused_and_the_receiver_still_accepted():
    server = ChannelServer(receivers=1, timeout_s=5)
    host, port, _ = server.address
    stranger = connect_to_sender((host, port, b"not the token"), "a stale receiver", 5)
    receiver = ChannelThread(server.address, "generation worker 0", lambda channel, plan, start: {"ok": 1}, None, 5)
    assert server.accept_receivers()
    assert [c.peer for c in server._channels] == ["generation worker 0"]
    with pytest.raises(RuntimeError, match="went away"):
        stranger.receive("anything")  # its connection was closed
    server.begin(PLAN, verify=False)
    assert server.finish() == [{"ok": 1}]
    _stop(server, [receiver])


def test_only_strangers_is_a_timeout_that_says_so():
    server = ChannelServer(receivers=1, timeout_s=0.3)
    stranger = connect_to_sender(server.address[:2] + (b"not the token",), "a stale receiver", 5)
    with pytest.raises(RuntimeError, match=r"no generation worker connected .* \(refused 1 connection\(s\) without"):
        server.accept_receivers()
    stranger.close()
    server.close()


def test_no_receiver_is_a_timeout_not_a_hang():
    server = ChannelServer(receivers=1, timeout_s=0.2)
    with pytest.raises(RuntimeError, match="no generation worker connected"):
        server.accept_receivers()
    server.close()


def test_a_silent_receiver_is_named_and_its_late_report_still_lands():
    release = threading.Event()

    def stuck(channel, plan, start):
        release.wait()
        return {"late": True}

    server = ChannelServer(receivers=1, timeout_s=0.3)
    receiver = ChannelThread(server.address, "generation worker 5", stuck, None, 0.3)
    server.accept_receivers()
    server.begin(PLAN, verify=False)
    with pytest.raises(RuntimeError, match="generation worker 5 sent nothing for 0s while this side waited for its "
                                           "report of the refit; it is dead or stuck"):
        server.finish()
    release.set()
    assert server.finish() == [{"late": True}]
    _stop(server, [receiver])


def test_a_vanished_receiver_is_named():
    server = ChannelServer(receivers=1, timeout_s=5)
    peer = connect_to_sender(server.address, "generation worker 2", 5)
    server.accept_receivers()
    peer.close()
    with pytest.raises(RuntimeError, match="generation worker 2 went away while this side waited for its report"):
        server.finish()
    server.close()


def test_both_ends_send_small_messages_without_delay():
    """cuda_ipc paces each bucket with small messages both ways; with Nagle's algorithm on, a
    message waits for the previous one's delayed acknowledgement (~40 ms, twice a refit)."""
    import socket

    server = ChannelServer(receivers=1, timeout_s=5)
    peer = connect_to_sender(server.address, "generation worker 0", 5)
    server.accept_receivers()
    for channel in (server._channels[0], peer):
        sock = socket.socket(fileno=channel.conn.fileno())
        try:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        finally:
            sock.detach()
    peer.close()
    server.close()


def test_the_channel_listens_on_loopback_only():
    server = ChannelServer(receivers=1)
    assert server._server.getsockname()[0] == server.address[0] == "127.0.0.1"
    server.close()


def test_a_channel_listens_on_the_interface_it_is_given_only():
    """refit.channel_host=node_ip: the policy rank listens on its node's address, where receivers on
    other nodes reach it (here a second loopback address stands in for a node's)."""
    server = ChannelServer(receivers=1, timeout_s=5, host="127.0.0.2")
    # The socket is bound to that one address, not to every interface. (Whether a connection to
    # 127.0.0.1 is then refused depends on the kernel: some sandboxes route all of 127/8 alike.)
    assert server._server.getsockname()[0] == server.address[0] == "127.0.0.2"
    receiver = ChannelThread(server.address, "generation worker 0", lambda channel, plan, start: {"ok": True}, None, 5)
    server.accept_receivers()
    server.begin(PLAN, verify=False)
    assert server.finish() == [{"ok": True}]
    _stop(server, [receiver])
