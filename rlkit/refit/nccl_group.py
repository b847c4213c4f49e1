"""The refit communicator for the nccl transport: policy rank 0 (rank 0 here) and every
generation worker, outside both sides' own process groups. Built on vLLM's stateless process
group and PyNccl so it needs no shared torch.distributed world."""

from datetime import timedelta
from typing import Callable

import torch

from rlkit.refit.plan import PackedBucket, RefitPlan


class RefitGroup:
    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0):
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                             store_timeout=int(timedelta(seconds=timeout_s).total_seconds()))
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.comm = PyNcclCommunicator(group, device=self.device)
        self.stream = torch.cuda.Stream(device=self.device)
        self._sent: list[torch.cuda.Event | None] = [None, None]

    def send(self, packed: PackedBucket):
        """Broadcast a packed bucket and its checksum on the side stream: the caller may pack the
        next bucket meanwhile, but not the one after until bucket k is sent (at most two
        buckets' buffers are alive at once)."""
        packed_ready = torch.cuda.current_stream().record_event()
        checksum = torch.tensor([packed.checksum is not None, packed.checksum or 0], dtype=torch.int64,
                                device=self.device)  # (present?, value)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(packed_ready)
            self.comm.broadcast(packed.buffer, src=0, stream=self.stream)
            self.comm.broadcast(checksum, src=0, stream=self.stream)
            packed.buffer.record_stream(self.stream)
            checksum.record_stream(self.stream)
        sent = self.stream.record_event()
        slot = packed.index % 2
        if self._sent[slot] is not None:
            torch.cuda.current_stream().wait_event(self._sent[slot])
        self._sent[slot] = sent

    def receive_all(self, plan: RefitPlan, load: Callable[[PackedBucket], None], verify: bool):
        """Receive every bucket of the plan on the side stream into two alternating buffers while
        `load` (on the current stream) takes the previous one out; returns when all are loaded.
        The checksum header is read, which waits for its bucket, only when verifying. If a load
        fails, the remaining buckets are still received (so the sender is not left blocked in a
        broadcast nobody joins) and the failure is raised after."""
        current = torch.cuda.current_stream()
        largest = max(b.nbytes for b in plan.buckets)
        buffers = [torch.empty(largest, dtype=torch.uint8, device=self.device) for _ in range(2)]
        headers = torch.empty(len(plan.buckets), 2, dtype=torch.int64, device=self.device)
        loaded: list[torch.cuda.Event | None] = [None, None]
        failure = None
        for bucket in plan.buckets:
            slot = bucket.index % 2
            buffer = buffers[slot][:bucket.nbytes]
            with torch.cuda.stream(self.stream):
                if loaded[slot] is not None:  # bucket k-2 is out of this buffer
                    self.stream.wait_event(loaded[slot])
                self.comm.broadcast(buffer, src=0, stream=self.stream)
                self.comm.broadcast(headers[bucket.index], src=0, stream=self.stream)
            current.wait_event(self.stream.record_event())
            if failure is None:
                try:
                    present, value = headers[bucket.index].tolist() if verify else (False, 0)
                    load(PackedBucket(bucket.index, buffer, value if present else None))
                except Exception as error:
                    failure = error
            loaded[slot] = current.record_event()
        current.synchronize()  # the buffers are freed on return
        if failure is not None:
            raise failure

    def synchronize(self):
        self.stream.synchronize()
