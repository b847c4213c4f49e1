"""Delta refit over the refit channel (refit.delta with refit.transport=nccl): buckets travel as
frames (a header that says how many payload bytes follow, then the payload), each receiver
rebuilds its bucket in the transport's own buffer, which the payload arrived in, and loads it from
there. Frames round-trip every encoding; a RefitSender and StandingReceivers over real refit
channels, with a transport pair that moves each frame's bytes over the channel itself (nccl
broadcasts them on GPUs, in tests/gpu), leave the engines bit-identical to the dense path after
training steps; a corrupted delta is named by its worker and bucket and the next refit is dense,
as is the first one after a receiver lost its copies (a restarted engine)."""

import pytest
import torch
from test_refit_delta_halves import setup

from rlkit.refit.delta import DeltaReceiver, Frame, apply, encode, frame, unframe
from rlkit.refit.plan import PackedBucket, RefitPlan
from rlkit.refit.receiver import StandingReceiver
from rlkit.refit.transport import TransportSpec


def _bucket(words: torch.Tensor) -> tuple[RefitPlan, PackedBucket]:
    plan = RefitPlan.build([("w", tuple(words.shape), str(words.dtype).removeprefix("torch."))], bucket_bytes=1 << 20)
    return plan, PackedBucket(0, words.view(torch.uint8).clone(), None)


@pytest.mark.parametrize("changed, dtype, encoding", [(3, torch.bfloat16, "indices"), (0, torch.bfloat16, "indices"),
                                                       (150, torch.bfloat16, "bitmap"), (999, torch.bfloat16, "dense"),
                                                       (2, torch.float64, "indices"), (40, torch.float64, "bitmap")])
def test_a_frame_round_trips_and_rebuilds_in_the_buffer_it_arrived_in(changed, dtype, encoding):
    g = torch.Generator().manual_seed(changed)
    before = torch.randn(999, generator=g).to(dtype)  # 999 words: a bitmap of 125 bytes, not a multiple of 8
    after = before.clone()
    after[torch.randperm(999, generator=g)[:changed]] += 1
    plan, previous = _bucket(before)
    _, current = _bucket(after)
    encoded = encode(previous.buffer, current, plan.buckets[0])
    assert encoded.encoding == encoding
    sent = frame(encoded)
    room = torch.full((current.buffer.numel(),), 0xAB, dtype=torch.uint8)  # a receive buffer, last used elsewhere
    room[:sent.header[0]] = sent.payload
    received = unframe(Frame(0, sent.header, room[:sent.header[0]], room))
    rebuilt = apply(previous.buffer, received, out=room)
    assert rebuilt.data_ptr() == room.data_ptr() and torch.equal(rebuilt, current.buffer)
    assert sent.header[0] == encoded.sent_bytes + (-encoded.positions.numel() * encoded.positions.element_size() % 8
                                                   if encoded.positions is not None else 0)


class FramesOverChannel:
    """Sending half: each frame's header and payload bytes go over the channel to every receiver."""

    def prepare(self, plan: RefitPlan, fresh_receivers: bool):
        return None

    def send(self, channels, plan: RefitPlan, pack):
        for _ in plan.buckets:
            sent = pack(None)
            assert isinstance(sent, Frame)
            for channel in channels:
                channel.send((sent.index, sent.header, sent.payload.numpy().tobytes()))


class FramesFromChannel:
    """Receiving half: like nccl's, the payload lands in the first bytes of a buffer this half
    keeps (its contents from the bucket before), which the receiver rebuilds the bucket in.
    corrupt: bucket indexes whose payload arrives with its last byte flipped."""

    def __init__(self):
        self.buffer, self.corrupt = torch.empty(0, dtype=torch.uint8), set()

    def receive(self, channel, plan: RefitPlan, start, load):
        assert start.delta
        largest = max(b.nbytes for b in plan.buckets)
        if self.buffer.numel() < largest:
            self.buffer = torch.empty(largest, dtype=torch.uint8)
        for bucket in plan.buckets:
            index, header, data = channel.receive(f"bucket {bucket.index}")
            room = self.buffer[:bucket.nbytes]
            payload = room[:len(data)]
            if data:
                payload.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            if index in self.corrupt and len(data):
                payload[-1] ^= 1
            load(Frame(index, tuple(header), payload, room))


class Engine(torch.nn.Module):
    """A generation model whose loader copies each HF tensor into its own parameter."""

    def __init__(self, plan: RefitPlan):
        super().__init__()
        self.names = [s.name for b in plan.buckets for s in b.slots]
        for i, s in enumerate(s for b in plan.buckets for s in b.slots):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(s.shape, dtype=getattr(torch, s.dtype)),
                                                                requires_grad=False))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, f"p{i}") for i, name in enumerate(self.names)}

    @torch.no_grad()
    def load_weights(self, weights):
        held = self.tensors()
        for name, w in weights:
            held[name].data.copy_(w)


# the pair as refit.transport names it (rlkit/refit/transport.py)
FRAMES = TransportSpec("frames over the channel", sending_half=FramesOverChannel, receiving_half=FramesFromChannel,
                       delta=True)


@pytest.fixture
def channel_refit():
    source, plan, sender, _, dense_refit = setup()
    address = sender.open_channel("test_refit_delta_frames:FRAMES", receivers=2, timeout_s=10, host="127.0.0.1")
    engines = [Engine(plan), Engine(plan)]
    receivers = [StandingReceiver(FramesFromChannel(), lambda e=e: e, address, f"generation worker {i}", 10)
                 for i, e in enumerate(engines)]
    yield source, plan, sender, engines, receivers, dense_refit
    sender._server.close()
    for receiver in receivers:
        receiver.thread.thread.join(timeout=10)


def assert_bit_identical(engines: list[Engine], expected: dict[str, torch.Tensor]):
    for i, engine in enumerate(engines):
        for name, tensor in engine.tensors().items():
            assert torch.equal(tensor.view(torch.uint8), expected[name].view(torch.uint8)), f"engine {i}: {name}"


def test_delta_refits_over_the_channel_equal_the_dense_path_bit_for_bit(channel_refit):
    source, plan, sender, engines, _, dense_refit = channel_refit
    dense_bytes = sum(b.nbytes for b in plan.buckets)
    for step in range(4):
        if step:
            source.step()
        report = sender.send(plan, with_checksum=True, delta=True)
        assert_bit_identical(engines, dense_refit())
        assert all(r.delta_failure is None and r.metrics["timing/refit_delta_apply"] > 0 for r in report.received)
        sent = report.bytes_sent
        assert sent == dense_bytes if step == 0 else sent < 0.5 * dense_bytes  # the first refit is dense
        assert report.delta == (step > 0) and report.delta_metrics["refit/dense_bytes"] == dense_bytes


def test_a_corrupted_delta_is_named_and_the_next_refit_is_dense(channel_refit):
    source, plan, sender, engines, receivers, dense_refit = channel_refit
    sender.send(plan, with_checksum=True, delta=True)
    source.step()
    receivers[1].transport.corrupt = {1}
    report = sender.send(plan, with_checksum=True, delta=True)
    # reports come in the order the receivers connected, which their threads race for
    failures = [r.delta_failure for r in report.received if r.delta_failure is not None]
    assert len(failures) == 1, failures
    assert failures[0].startswith("generation worker 1: refit: bucket 1 failed its checksum"), failures[0]
    receivers[1].transport.corrupt = set()
    redo = sender.send(plan, with_checksum=True, delta=True)  # what the driver does next
    assert redo.bytes_sent == redo.delta_metrics["refit/dense_bytes"] and not redo.delta
    assert all(r.delta_failure is None for r in redo.received)
    assert_bit_identical(engines, dense_refit())


def test_a_receiver_that_lost_its_copies_gets_a_dense_refit(channel_refit):
    source, plan, sender, engines, receivers, dense_refit = channel_refit
    sender.send(plan, with_checksum=True, delta=True)
    source.step()
    receivers[0]._delta = DeltaReceiver()  # as a restarted engine's process holds nothing
    report = sender.send(plan, with_checksum=True, delta=True)
    assert report.bytes_sent == report.delta_metrics["refit/dense_bytes"]
    assert "does not hold the buckets of the last refit" in report.dense_because
    assert_bit_identical(engines, dense_refit())
    source.step()
    again = sender.send(plan, with_checksum=True, delta=True)
    assert again.bytes_sent < 0.5 * again.delta_metrics["refit/dense_bytes"]
    assert_bit_identical(engines, dense_refit())
