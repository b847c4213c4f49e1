"""The refit control channel between a policy rank and the generation workers it sends to, and
the thread that serves refits inside each generation worker's process (its receiver:
rlkit/refit/receiver.py).

Why a standing receiver: vLLM runs its model in a process of its own, so a call into it
(Ray actor -> LLM.collective_rpc -> engine core -> worker) costs ~2.5 ms before any byte moves,
and a refit of a 1.5B model has a budget of a few milliseconds. So each generation worker
process runs one thread, started once, that waits on this channel for the policy rank to start
a refit. A refit is then one controller call, to the policy, whose answer carries every
receiver's report.

Messages are pickled over connected sockets, on 127.0.0.1 unless generation runs on other nodes
(refit.channel_host); a receiver proves itself with the channel's token. Every wait inside a refit is bounded; between refits a receiver waits without
a limit (a training step may take an hour).
"""

import hmac
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable

import torch

from rlkit.refit.plan import RefitPlan


@dataclass(frozen=True)
class RefitStart:
    plan: RefitPlan | None  # None: the plan of this channel's previous refit
    verify: bool
    setup: object = None  # transport-specific, e.g. cuda_ipc's slot handles when they change
    delta: bool = False  # refit.delta: buckets travel as frames of their encodings (rlkit/refit/delta.py)


CLOSING = "closing"  # the sender's last message on a channel it closes for good: receivers end
READY = "ready"  # a receiver holds what a refit needs (e.g. nccl: its buffers) before any transfer starts


@dataclass(frozen=True)
class Report:
    """A receiver's last word on a refit: its Received (rlkit/refit/receiver.py), or what went wrong."""
    received: object
    error: str | None = None


class Channel:
    """Pickled messages over a connected local socket."""

    def __init__(self, sock: socket.socket, peer: str, timeout_s: float):
        sock.settimeout(None)
        # small messages each way: without this, Nagle's algorithm holds a message back until the
        # previous one is acknowledged, and delayed acks make that ~40 ms (twice per cuda_ipc refit)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn, self.peer, self.timeout_s = Connection(sock.detach()), peer, timeout_s

    def send(self, message):
        try:
            self.conn.send(message)
        except OSError:
            raise RuntimeError(f"refit: {self.peer} went away (its end of the channel is closed)") from None

    def receive(self, waiting_for: str, bounded: bool = True):
        """The next message, within the channel's timeout (bounded) or whenever it comes. A
        Report with an error from the peer is raised here, naming the peer."""
        try:
            if self.conn.poll(self.timeout_s if bounded else None):
                message = self.conn.recv()
            else:
                raise RuntimeError(f"refit: {self.peer} sent nothing for {self.timeout_s:.0f}s while this side "
                                   f"waited for {waiting_for}; it is dead or stuck")
        except (EOFError, OSError):
            raise RuntimeError(f"refit: {self.peer} went away while this side waited for {waiting_for}") from None
        if isinstance(message, Report) and message.error is not None:
            raise RuntimeError(f"refit: {self.peer} failed: {message.error}")
        return message

    def expect(self, value, waiting_for: str):
        """Receive a message that must equal `value` (e.g. a bucket index acknowledged in order)."""
        message = self.receive(waiting_for)
        if message != value:
            raise RuntimeError(f"refit: {self.peer} sent {message!r} while this side waited for {waiting_for}")

    def close(self):
        self.conn.close()


class ChannelServer:
    """Policy side: listens on `host` (one interface: 127.0.0.1 unless receivers run on other
    nodes) for `receivers` standing receivers, accepts them at the first refit (and again after a
    failed one), and starts each refit on all of them."""

    def __init__(self, receivers: int, timeout_s: float = 300.0, host: str = "127.0.0.1"):
        self.receivers, self.timeout_s, self.token = receivers, timeout_s, secrets.token_bytes(16)
        # connections are accepted only on that interface, and only with the token
        self._server = socket.create_server((host, 0))
        self._server.settimeout(timeout_s)
        self._channels: list[Channel] = []
        self._last_plan: RefitPlan | None = None  # what the connected receivers hold

    @property
    def address(self) -> tuple[str, int, bytes]:
        host, port = self._server.getsockname()[:2]
        return (host, port, self.token)

    def _accept(self, refused: int) -> Channel | None:
        """The next receiver; None for a connection without the token (closed at once: a stale
        receiver of an earlier channel on the same port, say, must not fail this one)."""
        try:
            sock, _ = self._server.accept()
        except socket.timeout:
            stranger = f" (refused {refused} connection(s) without this channel's token)" if refused else ""
            raise RuntimeError(f"refit: no generation worker connected to this policy rank's refit channel within "
                               f"{self.timeout_s:.0f}s{stranger}") from None
        channel = Channel(sock, "a generation worker", self.timeout_s)
        try:
            token = channel.conn.recv_bytes(64) if channel.conn.poll(self.timeout_s) else b""
        except (EOFError, OSError):
            token = b""
        if not hmac.compare_digest(token, self.token):
            channel.close()
            return None
        try:
            channel.peer = channel.receive("its name")
        except BaseException:
            channel.close()
            raise
        return channel

    def accept_receivers(self) -> bool:
        """Accepts the receivers not connected yet (all of them at the first refit or after a
        failed one); whether any was."""
        fresh, refused = len(self._channels) < self.receivers, 0
        while len(self._channels) < self.receivers:
            channel = self._accept(refused)
            if channel is None:
                refused += 1
            else:
                self._channels.append(channel)
        if fresh:
            self._last_plan = None
        return fresh

    def begin(self, plan: RefitPlan, verify: bool, setup: object = None, delta: bool = False) -> list[Channel]:
        """Tells every receiver (accepted by accept_receivers()) that a refit starts; the plan travels
        only when it changed. Returns the channels in the order the receivers connected."""
        start = RefitStart(None if plan == self._last_plan else plan, verify, setup, delta)
        for channel in self._channels:
            channel.send(start)
        self._last_plan = plan
        return self._channels

    def finish(self) -> list:
        """Every receiver's Received of the refit (an error report is raised, naming its sender)."""
        return [channel.receive("its report of the refit").received for channel in self._channels]

    def abort(self):
        """After a failure: close the channels, so receivers stop at once (not at their timeout)
        and connect again; the next refit accepts them afresh."""
        for channel in self._channels:
            channel.close()
        self._channels = []

    def close(self):
        """For good: receivers are told to end rather than connect again (to a port that another
        channel may reuse)."""
        for channel in self._channels:
            try:
                channel.send(CLOSING)
            except OSError:
                pass
        self.abort()
        self._server.close()


def connect_to_sender(address: tuple[str, int, bytes], name: str, timeout_s: float) -> Channel:
    host, port, token = address
    channel = Channel(socket.create_connection((host, port), timeout=timeout_s), f"the policy rank at {host}:{port}",
                      timeout_s)
    channel.conn.send_bytes(token)
    channel.send(name)
    return channel


class ChannelThread:
    """A daemon thread in a generation worker's process: connects to the policy rank's channel
    and serves each refit it starts with serve(channel, plan, start) -> Received. A failed refit is
    reported to the sender, then the thread connects again for the next one; it ends when the
    sender is gone."""

    def __init__(self, address: tuple[str, int, bytes], name: str,
                 serve: Callable[[Channel, RefitPlan, RefitStart], object], device: int | None, timeout_s: float):
        self.address, self.name, self.serve, self.device, self.timeout_s = address, name, serve, device, timeout_s
        self.last_error: str | None = None  # text only: a kept exception would keep its frames' buffers alive
        self.thread = threading.Thread(target=self._run, name=f"rlkit refit receiver ({name})", daemon=True)
        self.thread.start()

    def _run(self):
        if self.device is not None:
            torch.cuda.set_device(self.device)  # the current device is per thread
            # a stream of its own, as vLLM gives its threads, not the legacy default stream
            torch.cuda.set_stream(torch.cuda.Stream())
        while True:
            try:
                channel = connect_to_sender(self.address, self.name, self.timeout_s)
            except (OSError, RuntimeError):
                return  # nobody listens any more (or it closed on us at once): the sender is gone
            try:
                self._serve_refits(channel)
                return  # the sender closed the channel for good
            except Exception as error:
                self.last_error = f"{type(error).__name__}: {error}"
            finally:
                channel.close()

    def _serve_refits(self, channel: Channel):
        """Serves refits until the sender says CLOSING; raises on anything else that ends them."""
        plan = None
        while True:
            start = channel.receive("the next refit", bounded=False)
            if start == CLOSING:
                return
            try:
                if not isinstance(start, RefitStart):
                    raise RuntimeError(f"refit: expected the start of a refit, got {start!r}")
                plan = start.plan or plan
                if plan is None:
                    raise RuntimeError("refit: the sender referred to a previous plan this receiver never got")
                received = self.serve(channel, plan, start)
            except Exception as error:
                channel.send(Report(None, f"{type(error).__name__}: {error}"))
                raise
            channel.send(Report(received))


def wait_event(event: torch.cuda.Event, timeout_s: float, what: str):
    """Host wait for a CUDA event, bounded: a peer that never joins a transfer is an error."""
    deadline = time.monotonic() + timeout_s
    while not event.query():
        if time.monotonic() > deadline:
            raise RuntimeError(f"refit: waited {timeout_s:.0f}s for {what}; the peer is dead or stuck")
        time.sleep(20e-6)
