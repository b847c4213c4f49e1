"""The cuda_ipc transport's two halves. Policy rank i packs buckets into two slots on its GPU;
the generation worker on the same GPU maps both slots through CUDA IPC handles and loads from
them. Slots and their mappings live across refits (remade only when a plan needs larger ones),
so a refit opens nothing. The halves pace each other with one short message per bucket over
the refit channel (rlkit/refit/channel.py) and order their GPU work with interprocess CUDA
events, so no host waits for the other side's kernels: the sender packs bucket k+1 while the
receiver loads k.

An event's wait covers its latest record at the time of the wait call. Each side records
before it sends its message and waits only after the matching message arrived, so every wait
sees the record it means."""

from typing import Callable

import torch

from rlkit.refit.channel import Channel, RefitStart, wait_event
from rlkit.refit.plan import PackedBucket, RefitIntegrityError, RefitPlan

SLOTS = 2


class IpcSender:
    """Policy side: the slots and the events that say a slot is packed."""

    def __init__(self):
        self.slots: list[torch.Tensor] = []
        self.packed_events: list[torch.cuda.Event] = []
        self.loaded_events: list[torch.cuda.Event] = []  # the receiver's, opened from its handles
        # old slots and their events, kept until the receiver has let go of them
        self._retired: tuple[list[torch.Tensor], list[torch.cuda.Event]] = ([], [])
        self._shared = False  # prepare() shared the slots anew: the receiver answers with its events

    def prepare(self, plan: RefitPlan, fresh_receivers: bool) -> tuple | None:
        """Slot and event handles to send with the refit's start when the slots are new (first
        refit, a plan with larger buckets, or a receiver that connected again); else None."""
        from torch.multiprocessing.reductions import reduce_tensor

        largest = max(b.nbytes for b in plan.buckets)
        self._shared = not self.slots or self.slots[0].numel() < largest or fresh_receivers
        if not self._shared:
            return None
        if not self.slots or self.slots[0].numel() < largest:
            self._retired = (self.slots, self.packed_events)
            self.slots = [torch.empty(largest, dtype=torch.uint8, device="cuda") for _ in range(SLOTS)]
            self.packed_events = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS)]
        return [reduce_tensor(s)[1] for s in self.slots], [e.ipc_handle() for e in self.packed_events]

    def send(self, channels: list[Channel], plan: RefitPlan, pack: Callable[[torch.Tensor], PackedBucket]):
        """pack(slot) packs the next bucket into slot. Returns once the receiver (the one beside
        this GPU) has loaded every bucket (its report follows on the channel)."""
        channel, = channels
        stream = torch.cuda.current_stream()
        if self._shared:
            handles = channel.receive("its events for the new slots")
            self.loaded_events = [torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), h) for h in handles]
            self._retired = ([], [])  # the receiver mapped the new slots and dropped the old ones
        count = len(plan.buckets)
        for bucket in plan.buckets:
            slot = bucket.index % SLOTS
            if bucket.index >= SLOTS:  # the receiver is done with this slot's previous bucket
                channel.expect(bucket.index - SLOTS, f"bucket {bucket.index - SLOTS} to be loaded")
                stream.wait_event(self.loaded_events[slot])
            packed = pack(self.slots[slot])
            self.packed_events[slot].record(stream)
            channel.send((packed.index, packed.checksum))
        for index in range(max(0, count - SLOTS), count):
            channel.expect(index, f"bucket {index} to be loaded")
            stream.wait_event(self.loaded_events[index % SLOTS])
        wait_event(stream.record_event(), channel.timeout_s, "this GPU to finish the refit's copies")


class IpcReceiver:
    """Generation side: the mapped slots, and the events that say a slot is loaded."""

    def __init__(self):
        self.slots: list[torch.Tensor] = []
        self.packed_events: list[torch.cuda.Event] = []
        self.loaded_events: list[torch.cuda.Event] = []

    def receive(self, channel: Channel, plan: RefitPlan, start: RefitStart, load: Callable[[PackedBucket], None]):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        stream, device = torch.cuda.current_stream(), torch.cuda.current_device()
        setup = start.setup
        if setup is not None:  # new slots: map them (dropping the old mappings) and answer with our events
            slot_handles, event_handles = setup
            self.slots = [rebuild_cuda_tensor(*_on_this_device(h, device)) for h in slot_handles]
            self.packed_events = [torch.cuda.Event.from_ipc_handle(device, h) for h in event_handles]
            if not self.loaded_events:  # ours live as long as this receiver: the sender may hold them open
                self.loaded_events = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS)]
            channel.send([e.ipc_handle() for e in self.loaded_events])
        if not self.slots:
            raise RuntimeError("refit: the policy started a cuda_ipc refit without sharing its slots")
        for bucket in plan.buckets:
            index, checksum = channel.receive(f"bucket {bucket.index}")
            if index != bucket.index:
                raise RefitIntegrityError(f"refit: the policy sent bucket {index}, expected {bucket.index}")
            slot = index % SLOTS
            stream.wait_event(self.packed_events[slot])
            load(PackedBucket(index, self.slots[slot][:bucket.nbytes], checksum))
            self.loaded_events[slot].record(stream)
            channel.send(index)
        wait_event(stream.record_event(), channel.timeout_s, "this GPU to finish loading the refit")


def gpu_identity() -> str:
    """This process's GPU, the same in every process that uses it (its index is not: each
    process numbers the GPUs it sees)."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


def _on_this_device(handle: tuple, device: int) -> tuple:
    """The sender's device index means nothing in this process; the GPU is the same one."""
    args = list(handle)
    args[6] = device
    return tuple(args)
