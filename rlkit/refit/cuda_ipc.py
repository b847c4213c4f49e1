"""The cuda_ipc transport's two halves, one call each per refit. Policy rank i packs buckets into
two slots on its GPU; the vLLM worker on the same GPU maps both slots once per refit through
CUDA IPC handles and loads from them. The halves pace each other with one short message per
bucket over a local socket and order their GPU work with interprocess CUDA events, so no host
waits for the other side's kernels: the sender packs bucket k+1 while the receiver loads k.

An event's wait covers its latest record at the time of the wait call. Each side records
before it sends its message and waits only after the matching message arrived, so every wait
sees the record it means."""

import hmac
import secrets
import socket
from multiprocessing.connection import Connection
from typing import Callable

import torch

from rlkit.refit.plan import PackedBucket, RefitIntegrityError, RefitPlan

SLOTS = 2


class _Channel:
    """Pickled messages over a connected local socket; every receive is bounded."""

    def __init__(self, sock: socket.socket, peer: str, timeout_s: float):
        sock.settimeout(None)
        self.conn, self.peer, self.timeout_s = Connection(sock.detach()), peer, timeout_s

    def send(self, message):
        self.conn.send(message)

    def receive(self, waiting_for: str, raw: bool = False):
        """The next message (raw: bytes, not unpickled, at most 64 of them)."""
        try:
            if self.conn.poll(self.timeout_s):
                return self.conn.recv_bytes(64) if raw else self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"refit: {self.peer} went away while this side waited for {waiting_for}") from None
        raise RuntimeError(f"refit: {self.peer} sent nothing for {self.timeout_s:.0f}s while this side waited "
                           f"for {waiting_for}; it is dead or stuck")

    def close(self):
        self.conn.close()


class IpcSender:
    """Policy side. Listens on 127.0.0.1; the receiver proves itself with a per-channel token."""

    def __init__(self, timeout_s: float = 300.0):
        self.timeout_s, self.token = timeout_s, secrets.token_bytes(16)
        # connections are accepted only from this host, and only with the token
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(timeout_s)
        self._channel: _Channel | None = None

    @property
    def address(self) -> tuple[str, int, bytes]:
        return ("127.0.0.1", self._server.getsockname()[1], self.token)

    def _accept(self) -> _Channel:
        try:
            sock, _ = self._server.accept()
        except socket.timeout:
            raise RuntimeError(f"refit: no generation worker connected to this policy rank's IPC channel within "
                               f"{self.timeout_s:.0f}s") from None
        channel = _Channel(sock, "the colocated generation worker", self.timeout_s)
        if not hmac.compare_digest(channel.receive("its token", raw=True), self.token):
            channel.close()
            raise RuntimeError("refit: a process without this channel's token connected to the IPC channel")
        return channel

    def send(self, plan: RefitPlan, pack: Callable[[torch.Tensor], PackedBucket]):
        """pack(slot_buffer) packs the next bucket into slot_buffer. Returns once the receiver is
        done with both slots (they are freed on return). On failure the channel is closed, so the
        receiver fails at once rather than at its timeout, and the next refit reconnects."""
        if self._channel is None:
            self._channel = self._accept()
        try:
            self._send(plan, pack)
        except BaseException:
            self._channel.close()
            self._channel = None
            raise

    def _send(self, plan: RefitPlan, pack: Callable[[torch.Tensor], PackedBucket]):
        from torch.multiprocessing.reductions import reduce_tensor

        channel, stream = self._channel, torch.cuda.current_stream()
        largest = max(b.nbytes for b in plan.buckets)
        slots = [torch.empty(largest, dtype=torch.uint8, device="cuda") for _ in range(SLOTS)]
        packed_events = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS)]
        channel.send(([reduce_tensor(s)[1] for s in slots], [e.ipc_handle() for e in packed_events]))
        device = torch.cuda.current_device()
        loaded_events = [torch.cuda.Event.from_ipc_handle(device, h) for h in channel.receive("its events")]
        count = len(plan.buckets)
        for bucket in plan.buckets:
            slot = bucket.index % SLOTS
            if bucket.index >= SLOTS:  # the receiver is done with this slot's previous bucket
                self._expect_loaded(bucket.index - SLOTS)
                stream.wait_event(loaded_events[slot])
            packed = pack(slots[slot])
            packed_events[slot].record(stream)
            channel.send((packed.index, packed.checksum))
        for index in range(max(0, count - SLOTS), count):
            self._expect_loaded(index)
            stream.wait_event(loaded_events[index % SLOTS])
        stream.synchronize()

    def close(self):
        if self._channel is not None:
            self._channel.close()
        self._server.close()

    def _expect_loaded(self, index: int):
        loaded = self._channel.receive(f"bucket {index} to be loaded")
        if loaded != index:
            raise RefitIntegrityError(f"refit: the generation worker reported bucket {loaded} loaded, expected {index}")


class IpcReceiver:
    """Generation side: connects to the sender on its GPU and loads every bucket of a plan."""

    def __init__(self, address: tuple[str, int, bytes], timeout_s: float = 300.0):
        host, port, token = address
        self.address = address
        sock = socket.create_connection((host, port), timeout=timeout_s)
        self._channel = _Channel(sock, f"the policy rank at {host}:{port}", timeout_s)
        self._channel.conn.send_bytes(token)

    def close(self):
        self._channel.close()

    def receive(self, plan: RefitPlan, load: Callable[[PackedBucket], None]):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        channel, stream = self._channel, torch.cuda.current_stream()
        slot_handles, event_handles = channel.receive("the bucket slots")
        device = torch.cuda.current_device()
        slots = [rebuild_cuda_tensor(*_on_this_device(h, device)) for h in slot_handles]
        packed_events = [torch.cuda.Event.from_ipc_handle(device, h) for h in event_handles]
        loaded_events = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS)]
        channel.send([e.ipc_handle() for e in loaded_events])
        for bucket in plan.buckets:
            index, checksum = channel.receive(f"bucket {bucket.index}")
            if index != bucket.index:
                raise RefitIntegrityError(f"refit: the policy sent bucket {index}, expected {bucket.index}")
            slot = index % SLOTS
            stream.wait_event(packed_events[slot])
            load(PackedBucket(index, slots[slot][:bucket.nbytes], checksum))
            loaded_events[slot].record(stream)
            channel.send(index)
        stream.synchronize()


def _on_this_device(handle: tuple, device: int) -> tuple:
    """The sender's device index means nothing in this process; the GPU is the same one."""
    args = list(handle)
    args[6] = device
    return tuple(args)
