"""Refit's two worker halves put together on CPU: a RefitSender (the policy side) serves refits to
StandingReceivers (the generation side) over real refit channels, and the receivers' models end
bit-identical to the exported weights, first through their loader, then by replay. The GPU
transports (CUDA IPC, NCCL) only move the bytes and run in tests/gpu; here a transport pair
moves each packed bucket over the channel itself."""

import contextlib

import pytest
import torch

from rlkit.refit.plan import PackedBucket, RefitPlan
from rlkit.refit.receiver import Received, StandingReceiver
from rlkit.refit.sender import RefitSender
from rlkit.refit.transport import TransportSpec

SHAPES = {"embed": (6, 4), "q": (4, 4), "k": (2, 4), "norm": (4,)}


class Source:
    """The export interface a policy worker gives its sender (through the bridge, no rows)."""

    rank, name = 0, "policy"

    def __init__(self, seed: int):
        self.set_weights(seed)

    def set_weights(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.weights = {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}

    def wake(self):
        pass

    def hf_weights(self):
        return iter(list(self.weights.items()))

    def export_rows(self):
        return None


class Engine(torch.nn.Module):
    """An inference engine's model with its own loader: q and k fused, as vLLM lays them out."""

    def __init__(self):
        super().__init__()
        self.embed, self.qk, self.norm = (torch.nn.Parameter(torch.zeros(s)) for s in [(6, 4), (6, 4), (4,)])

    @torch.no_grad()
    def load_weights(self, weights):
        for name, w in weights:
            if name in ("q", "k"):
                self.qk.data.narrow(0, 0 if name == "q" else 4, w.shape[0]).copy_(w)
            else:
                getattr(self, name).data.copy_(w)


class BytesOverChannel:
    """Sending half: each packed bucket's bytes go over the channel to every receiver."""

    def prepare(self, plan: RefitPlan, fresh_receivers: bool):
        return None

    def send(self, channels, plan: RefitPlan, pack):
        for _ in plan.buckets:
            packed = pack(None)
            for channel in channels:
                channel.send((packed.index, packed.buffer.numpy().tobytes(), packed.checksum))


class BytesFromChannel:
    def receive(self, channel, plan: RefitPlan, start, load):
        for bucket in plan.buckets:
            index, data, checksum = channel.receive(f"bucket {bucket.index}")
            load(PackedBucket(index, torch.frombuffer(bytearray(data), dtype=torch.uint8), checksum))


# the pair as refit.transport names it (rlkit/refit/transport.py); the sender looks it up by that name
BYTES = TransportSpec("bytes over the channel", sending_half=BytesOverChannel, receiving_half=BytesFromChannel)


@pytest.fixture
def refit():
    source = Source(seed=0)
    sender = RefitSender(source)
    plan = RefitPlan.build(sender.manifest(), bucket_bytes=64)
    address = sender.open_channel("test_refit_halves:BYTES", receivers=2, timeout_s=10, host="127.0.0.1")
    engines = [Engine(), Engine()]
    receivers = [StandingReceiver(BytesFromChannel(), lambda e=e: e, address, f"generation worker {i}", 10)
                 for i, e in enumerate(engines)]
    yield source, sender, plan, engines
    sender._server.close()
    for receiver in receivers:
        receiver.thread.thread.join(timeout=10)


def test_refits_through_the_loader_then_by_replay_are_bit_exact(refit):
    source, sender, plan, engines = refit
    assert len(plan.buckets) > 1
    for seed in (0, 1, 2):  # the first refit learns the loader, the next ones replay it
        source.set_weights(seed)
        report = sender.send(plan, with_checksum=True)
        assert report.received == (Received({"refit/replayable_fraction": 1.0}),) * 2
        assert report.direct is False and report.export_s >= 0 and report.bytes_sent == plan.total_bytes
        assert not report.delta and report.dense_because is None
        w = source.weights
        for engine in engines:
            assert torch.equal(engine.embed, w["embed"]) and torch.equal(engine.norm, w["norm"])
            assert torch.equal(engine.qk, torch.cat([w["q"], w["k"]]))


def test_a_receiver_whose_load_fails_is_named_and_the_next_refit_works(refit):
    source, sender, plan, engines = refit
    sender.send(plan, with_checksum=True)
    good = engines[1].load_weights
    engines[1].load_weights = None  # its loader is gone: the first bucket fails to load
    with pytest.raises(RuntimeError, match="refit: generation worker 1 (failed|went away)"):
        sender.send(RefitPlan.build(sender.manifest(), bucket_bytes=128), with_checksum=False)
    engines[1].load_weights = good
    source.set_weights(5)
    sender.send(plan, with_checksum=True)  # the receivers connected again
    assert torch.equal(engines[1].embed, source.weights["embed"])


class SkipsTheLastBucket(BytesFromChannel):
    """A receiving half that takes every bucket off the channel but hands the last one to no loader."""

    def receive(self, channel, plan: RefitPlan, start, load):
        super().receive(channel, plan, start, lambda packed: packed.index == len(plan.buckets) - 1 or load(packed))


def test_a_bucket_the_receiving_half_never_loads_fails_the_refit_naming_it():
    sender = RefitSender(Source(seed=0))
    plan = RefitPlan.build(sender.manifest(), bucket_bytes=64)
    address = sender.open_channel("test_refit_halves:BYTES", receivers=1, timeout_s=10, host="127.0.0.1")
    engine = Engine()
    receiver = StandingReceiver(SkipsTheLastBucket(), lambda: engine, address, "generation worker 0", 10)
    with pytest.raises(RuntimeError, match=rf"generation worker 0 failed: RefitIntegrityError: refit incomplete on "
                                           rf"generation worker 0: buckets \[{len(plan.buckets) - 1}\] never arrived"):
        sender.send(plan, with_checksum=True)
    sender._server.close()
    receiver.thread.thread.join(timeout=10)


class QuantizingEngine(Engine):
    """An engine that, like vLLM's quantized reload, takes each refit's weights into fresh tensors
    while a load session is open and writes them back processed (here: rounded to bf16) into the
    tensors it serves from when the session closes."""

    def __init__(self):
        super().__init__()
        self.staged, self.sessions = None, 0

    @contextlib.contextmanager
    def reload(self, model):
        assert model is self
        served = {name: p.data for name, p in self.named_parameters()}
        self.staged = {name: torch.full_like(t, float("nan")) for name, t in served.items()}
        for name, t in self.staged.items():
            getattr(self, name).data = t
        yield
        for name, t in served.items():
            t.copy_(self.staged[name].bfloat16().float())
            getattr(self, name).data = t
        self.staged, self.sessions = None, self.sessions + 1

    @torch.no_grad()
    def load_weights(self, weights):
        assert self.staged is not None, "a load outside the refit's session"
        super().load_weights(weights)


def test_a_load_session_holds_every_refit_and_the_loader_places_each_tensor_every_time():
    sender = RefitSender(Source(seed=0))
    plan = RefitPlan.build(sender.manifest(), bucket_bytes=64)
    address = sender.open_channel("test_refit_halves:BYTES", receivers=1, timeout_s=10, host="127.0.0.1")
    engine = QuantizingEngine()
    served = engine.qk.data_ptr()
    receiver = StandingReceiver(BytesFromChannel(), lambda: engine, address, "generation worker 0", 10,
                                load_session=engine.reload)
    for seed in (0, 1):  # a replay would write the second refit into the first session's staging tensors
        sender.source.set_weights(seed)
        report = sender.send(plan, with_checksum=True)
        assert report.received == (Received({"refit/replayable_fraction": 0.0}),)
        w = sender.source.weights
        assert engine.sessions == seed + 1 and engine.qk.data_ptr() == served
        assert torch.equal(engine.qk, torch.cat([w["q"], w["k"]]).bfloat16().float())
        assert torch.equal(engine.norm, w["norm"].bfloat16().float())
    sender._server.close()
    receiver.thread.thread.join(timeout=10)
