"""LoadReplay: after a loader has placed each tensor once, replayed refits leave the model
bit-identical to running the loader again; loaders that compute are not replayed."""

import torch

from rlkit.refit.plan import RefitPlan
from rlkit.refit.replay import LoadReplay

HIDDEN, VOCAB, PADDED_VOCAB = 4, 6, 8
MANIFEST = [("embed", (VOCAB, HIDDEN), "float32"), ("q", (4, HIDDEN), "float32"), ("k", (2, HIDDEN), "float32"),
            ("v", (2, HIDDEN), "float32"), ("norm", (HIDDEN,), "float32"), ("scaled", (HIDDEN,), "float32"),
            ("tied_head", (VOCAB, HIDDEN), "float32"), ("o", (HIDDEN, HIDDEN), "float32")]


class FusedModel(torch.nn.Module):
    """Parameters laid out the way an inference engine fuses them, and its own loader."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Parameter(torch.full((PADDED_VOCAB, HIDDEN), 7.0))  # vocab padded
        self.qkv = torch.nn.Parameter(torch.zeros(8, HIDDEN))  # q;k;v stacked
        self.norm = torch.nn.Parameter(torch.zeros(HIDDEN))
        self.scaled = torch.nn.Parameter(torch.zeros(HIDDEN))
        self.o_shard = torch.nn.Parameter(torch.zeros(HIDDEN, 2))  # a TP rank's column slice
        self.calls = 0

    @torch.no_grad()
    def load_weights(self, weights):
        for name, w in weights:
            self.calls += 1
            if name in ("embed", "tied_head"):  # one parameter, written by both, padding zeroed
                self.embed.data[:VOCAB].copy_(w)
                self.embed.data[VOCAB:].fill_(0)
            elif name in ("q", "k", "v"):
                offset = {"q": 0, "k": 4, "v": 6}[name]
                self.qkv.data.narrow(0, offset, w.shape[0]).copy_(w)
            elif name == "o":  # a strided view of the received tensor
                self.o_shard.data.copy_(w.narrow(1, 2, 2))
            elif name == "norm":
                self.norm.data.copy_(w)
            else:  # computes: must go through the loader every time
                self.scaled.data.copy_(w * 2)


def send(plan: RefitPlan, replay: LoadReplay, seed: int, buffers: list[torch.Tensor] | None = None) -> dict:
    """One refit of random weights; packed into new buffers, or alternately into `buffers` (two
    kept across refits, as the GPU transports do)."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: torch.randn(shape, generator=gen) for name, shape, _ in MANIFEST}
    for bucket in plan.buckets:
        sources = {s.name: [(tensors[s.name], 0)] for s in bucket.slots}
        out = buffers[bucket.index % 2] if buffers else None
        replay.load(plan.pack(bucket.index, sources, with_checksum=True, out=out), verify=True)
    return tensors


def test_replays_from_kept_buffers_read_what_they_hold_now():
    """The replay keeps its views of the buffers it was given; every refit must still copy what
    the buffers hold at that refit, and after release_buffers it must take new buffers' views."""
    plan = RefitPlan.build(MANIFEST, bucket_bytes=64)
    largest = max(b.nbytes for b in plan.buckets)
    buffers = [torch.empty(largest, dtype=torch.uint8) for _ in range(2)]
    replayed, reference = FusedModel(), FusedModel()
    replay = LoadReplay(plan, replayed)
    send(plan, replay, 0, buffers)  # learns through the loader
    for seed in (1, 2, 3, 4):
        if seed == 3:  # a transport that regrows its buffers drops the old views first
            replay.release_buffers()
            assert all(not r.bound for r in replay._replays.values())
            buffers = [torch.empty(largest + 64, dtype=torch.uint8) for _ in range(2)]
        tensors = send(plan, replay, seed, buffers)
        reference.load_weights(list(tensors.items()))
        for name, param in replayed.named_parameters():
            assert torch.equal(param, dict(reference.named_parameters())[name]), (seed, name)
    bound = [ptr for r in replay._replays.values() for ptr in r.bound]
    assert set(bound) <= {b.data_ptr() for b in buffers}  # views of the current buffers only


def test_replayed_refits_match_the_loader_bit_for_bit():
    plan = RefitPlan.build(MANIFEST, bucket_bytes=64)  # several buckets
    assert len(plan.buckets) > 2
    replayed, reference = FusedModel(), FusedModel()
    replay = LoadReplay(plan, replayed)
    send(plan, replay, seed=0)  # learns through the loader
    assert replayed.calls == len(MANIFEST)
    for seed in (1, 2):
        tensors = send(plan, replay, seed)
        reference.load_weights(list(tensors.items()))
        for name, param in replayed.named_parameters():
            assert torch.equal(param, dict(reference.named_parameters())[name]), (seed, name)
        # the tied head was written after the embedding, and wins, as in the loader
        assert torch.equal(replayed.embed[:VOCAB], tensors["tied_head"])
    # only the computing loader ran again
    assert replayed.calls == len(MANIFEST) + 2
    assert replay.replayable_fraction == (len(MANIFEST) - 1) / len(MANIFEST)


class SwappingModel(FusedModel):
    """A loader that replaces a parameter's storage instead of copying into it."""

    @torch.no_grad()
    def load_weights(self, weights):
        for name, w in weights:
            if name == "norm":
                self.norm.data = w.clone()
            else:
                super().load_weights([(name, w)])


def test_a_loader_that_swaps_storage_is_never_replayed():
    plan = RefitPlan.build(MANIFEST, bucket_bytes=64)
    model = SwappingModel()
    replay = LoadReplay(plan, model)
    send(plan, replay, seed=0)
    calls = model.calls
    tensors = send(plan, replay, seed=1)
    assert replay.replayable_fraction == 0.0
    assert model.calls == calls + len(MANIFEST) - 1  # every tensor but norm counts a call
    assert torch.equal(model.norm, tensors["norm"]) and torch.equal(model.qkv[:4], tensors["q"])
