"""The cuda_ipc transport's pacing channel: a stranger, a silent peer and a vanished peer are
each one error that says what happened, never a hang. (The GPU halves run in tests/gpu.)"""

import threading

import pytest

from rlkit.refit.cuda_ipc import IpcReceiver, IpcSender


def test_a_connection_without_the_token_is_refused():
    sender = IpcSender(timeout_s=5)
    host, port, _ = sender.address
    intruder = threading.Thread(target=IpcReceiver, args=((host, port, b"not the token"),))
    intruder.start()
    with pytest.raises(RuntimeError, match="without this channel's token"):
        sender._accept()
    intruder.join()


def test_no_receiver_is_a_timeout_not_a_hang():
    sender = IpcSender(timeout_s=0.2)
    with pytest.raises(RuntimeError, match="no generation worker connected"):
        sender._accept()


def test_a_silent_or_vanished_peer_is_named():
    sender = IpcSender(timeout_s=0.3)
    receivers = []
    connect = threading.Thread(target=lambda: receivers.append(IpcReceiver(sender.address, timeout_s=0.3)))
    connect.start()
    channel = sender._accept()
    connect.join()
    with pytest.raises(RuntimeError, match="sent nothing for 0s while this side waited for bucket 3"):
        channel.receive("bucket 3")
    receivers[0]._channel.conn.close()
    with pytest.raises(RuntimeError, match="went away while this side waited for bucket 4"):
        channel.receive("bucket 4")


def test_the_channel_listens_on_loopback_only():
    sender = IpcSender()
    assert sender._server.getsockname()[0] == sender.address[0] == "127.0.0.1"
