"""The nccl transport's two halves and their communicators (its spec: rlkit/refit/transport.py).
A communicator joins one policy rank (rank 0 in it) and the vLLM processes it feeds, outside both
sides' own process groups (refit.broadcast_groups says who feeds whom: transport.broadcast_groups).
Built on vLLM's stateless process group and PyNccl so it needs no shared torch.distributed world.

Both sides keep two bucket buffers across refits (regrown when a plan needs larger ones) and
alternate them: the sender packs bucket k+1 while bucket k is on the wire, each receiver loads
bucket k while k+1 arrives. Hosts wait on events with a deadline, so a peer that never joins a
broadcast is an error, not a hang. A communicator that failed mid-refit cannot tell which
broadcast its peers are in, so it refuses further refits."""

from datetime import timedelta
from typing import Callable

import torch

from rlkit.refit.channel import READY, Channel, RefitStart, wait_event
from rlkit.refit.delta import FRAME_HEADER_WORDS, Frame
from rlkit.refit.plan import PackedBucket, RefitPlan


class RefitCommunicator:
    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                             store_timeout=int(timedelta(seconds=timeout_s).total_seconds()))
        self.timeout_s = timeout_s
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.comm = PyNcclCommunicator(group, device=self.device)
        self.stream = torch.cuda.Stream(device=self.device)
        self._buffers: list[torch.Tensor] = []
        self._broken: str | None = None

    def prepare(self, plan: RefitPlan) -> list[torch.Tensor]:
        """The two buffers for this plan's buckets (regrown if needed), before any broadcast of a
        refit starts: a side that cannot take part says so while nobody waits in a collective."""
        if self._broken is not None:
            raise RuntimeError(f"refit: the nccl refit communicator failed in an earlier refit ({self._broken}); "
                               "its peers may be anywhere in a broadcast, so restart the run")
        largest = max(b.nbytes for b in plan.buckets)
        if not self._buffers or self._buffers[0].numel() < largest:
            self._buffers = [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(2)]
        return self._buffers

    def send_all(self, plan: RefitPlan, pack: Callable[[torch.Tensor], PackedBucket | Frame]):
        """pack(buffer) packs the next bucket into buffer, on the current stream; each bucket
        (and, when it carries one, its checksum) is broadcast on the side stream. A Frame
        (refit.delta) has its header go first, since it tells the receivers how many payload
        bytes follow."""
        buffers, current = self.prepare(plan), torch.cuda.current_stream()
        sent: list[torch.cuda.Event | None] = [None, None]
        try:
            for bucket in plan.buckets:
                slot = bucket.index % 2
                if sent[slot] is not None:
                    wait_event(sent[slot], self.timeout_s, f"the generation workers to receive bucket {bucket.index - 2}")
                packed = pack(buffers[slot])
                framed = isinstance(packed, Frame)
                # on the current stream: a host-to-device copy on the side stream would wait for
                # the broadcast queued there
                if framed:
                    payload, header = packed.payload, torch.tensor(packed.header, dtype=torch.int64, device=self.device)
                else:
                    payload = packed.buffer
                    header = None if packed.checksum is None else torch.tensor([packed.checksum], dtype=torch.int64,
                                                                                device=self.device)
                packed_ready = current.record_event()
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(packed_ready)
                    if framed:
                        self.comm.broadcast(header, src=0, stream=self.stream)
                        if payload.numel():  # an unchanged bucket's delta is empty: nothing follows its header
                            self.comm.broadcast(payload, src=0, stream=self.stream)
                        payload.record_stream(self.stream)  # a delta's payload is a tensor of its own
                    else:
                        self.comm.broadcast(payload, src=0, stream=self.stream)
                        if header is not None:
                            self.comm.broadcast(header, src=0, stream=self.stream)
                    if header is not None:
                        header.record_stream(self.stream)
                sent[slot] = self.stream.record_event()
            for event in sent:
                if event is not None:
                    wait_event(event, self.timeout_s, "the generation workers to receive the last buckets")
        except BaseException as error:
            self._broken = f"{type(error).__name__}: {error}"
            raise

    def receive_all(self, plan: RefitPlan, load: Callable[[PackedBucket | Frame], None], verify: bool,
                    framed: bool = False):
        """Receive every bucket of the plan on the side stream while `load` (on the current
        stream) takes the previous one out; returns when all are loaded. Checksums travel only
        when verifying (the sender's RefitStart says so to both). If a load fails, the remaining
        buckets are still received, so the sender is not left in a broadcast nobody joins, and
        the failure is raised after. framed (refit.delta): each bucket arrives as a Frame, its
        header first (read on the host: it holds the payload's size), and load gets it with the
        whole bucket's buffer as its room."""
        buffers, current = self.prepare(plan), torch.cuda.current_stream()
        headers = torch.empty(len(plan.buckets), dtype=torch.int64, device=self.device)
        if framed:
            frame_headers = torch.empty((len(plan.buckets), FRAME_HEADER_WORDS), dtype=torch.int64, device=self.device)
            host_headers = torch.empty(frame_headers.shape, dtype=torch.int64, pin_memory=True)
        loaded: list[torch.cuda.Event | None] = [None, None]
        failure = None
        try:
            for bucket in plan.buckets:
                slot = bucket.index % 2
                buffer = buffers[slot][:bucket.nbytes]
                with torch.cuda.stream(self.stream):
                    if loaded[slot] is not None:  # bucket k-2 is out of this buffer
                        self.stream.wait_event(loaded[slot])
                    if framed:
                        self.comm.broadcast(frame_headers[bucket.index], src=0, stream=self.stream)
                        host_headers[bucket.index].copy_(frame_headers[bucket.index], non_blocking=True)
                if framed:
                    wait_event(self.stream.record_event(), self.timeout_s, f"bucket {bucket.index}'s header from the policy")
                    header = tuple(host_headers[bucket.index].tolist())
                    payload = buffer[:header[0]]
                with torch.cuda.stream(self.stream):
                    if not framed or payload.numel():
                        self.comm.broadcast(payload if framed else buffer, src=0, stream=self.stream)
                    if verify and not framed:
                        self.comm.broadcast(headers[bucket.index: bucket.index + 1], src=0, stream=self.stream)
                arrived = self.stream.record_event()
                current.wait_event(arrived)
                if failure is None:
                    try:
                        if framed:
                            load(Frame(bucket.index, header, payload, buffer))
                        else:
                            checksum = None
                            if verify:  # reading the checksum waits for the bucket
                                wait_event(arrived, self.timeout_s, f"bucket {bucket.index} from the policy")
                                checksum = int(headers[bucket.index])
                            load(PackedBucket(bucket.index, buffer, checksum))
                    except Exception as error:
                        failure = error
                loaded[slot] = current.record_event()
            wait_event(current.record_event(), self.timeout_s, "the policy's last buckets")
        except BaseException as error:
            self._broken = f"{type(error).__name__}: {error}"
            raise
        if failure is not None:
            raise failure


class NcclSender:
    """Policy rank 0's half: every receiver says it is ready (buffers held, loader set up)
    before the first broadcast, so one that cannot take part fails the refit at once."""

    def __init__(self, communicator: RefitCommunicator):
        self.communicator = communicator

    def prepare(self, plan: RefitPlan, fresh_receivers: bool) -> None:
        self.communicator.prepare(plan)  # before any receiver is told to start

    def send(self, channels: list[Channel], plan: RefitPlan, pack: Callable[[torch.Tensor], PackedBucket | Frame]):
        for channel in channels:
            channel.expect(READY, "it to be ready for the broadcasts")
        self.communicator.send_all(plan, pack)


class NcclReceiver:
    """A generation worker's half."""

    def __init__(self, communicator: RefitCommunicator):
        self.communicator = communicator

    def receive(self, channel: Channel, plan: RefitPlan, start: RefitStart, load: Callable[[PackedBucket], None]):
        self.communicator.prepare(plan)
        channel.send(READY)  # the sender broadcasts only once every receiver got this far
        self.communicator.receive_all(plan, load, start.verify, framed=start.delta)
