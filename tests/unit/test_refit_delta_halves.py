"""Delta refit's two halves put together on CPU, no Ray: a RefitSender streams encoded buckets
(refit.delta) to ObjectStoreReceivers as ObjectStoreTransfer drives them, over several versions
of a model trained in fp32 and exported in bf16 (with a tied embedding sent once, fused MoE expert
weights and a float32 tensor kept by refit.keep_fp32), and every receiver ends bit-identical to one fed the dense way.
A delta that fails to rebuild is named and costs its receiver its copy, so the next refit is
dense; so is the first refit of a new receiver, and of a new plan."""

from dataclasses import replace

import torch

from rlkit.refit.plan import RefitPlan
from rlkit.refit.receiver import ObjectStoreReceiver, Received
from rlkit.refit.sender import RefitSender


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.hidden = torch.nn.Linear(32, 32)
        # its bias kept float32 on the wire (refit.keep_fp32), 20 bytes: its slot ends in padding
        self.router = torch.nn.Linear(32, 5)
        # MoE experts fused into one [experts, in, out] tensor, as HF's fused-expert models export them
        self.experts = torch.nn.Parameter(0.02 * torch.randn(4, 32, 32))

    def forward(self, ids):
        hidden = torch.tanh(self.hidden(self.embed(ids)))
        weights = torch.softmax(self.router(hidden)[..., :4], dim=-1)  # top-all routing: every expert trains
        hidden = hidden + torch.einsum("bte,bti,eio->bto", weights, hidden, self.experts)
        logits = hidden @ self.embed.weight.T  # tied: the output layer is the embedding, exported once
        return logits + self.router(hidden).sum(dim=-1, keepdim=True)


class Trained:
    """A policy's export interface (RefitSender's ExportSource) over TinyLM, trained by Adam at a
    small learning rate in fp32, exported through the bridge (no direct rows)."""

    rank, name = 0, "policy"

    def __init__(self):
        torch.manual_seed(0)
        self.model = TinyLM()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-5)

    def step(self):
        ids = torch.randint(0, 64, (8, 12))
        loss = torch.nn.functional.cross_entropy(self.model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()

    def wake(self):
        pass

    def hf_weights(self):
        return iter([(name, p.detach()) for name, p in self.model.named_parameters()])

    def export_rows(self):
        return None


def receiver(plan: RefitPlan, rank: int) -> ObjectStoreReceiver:
    """A generation worker's receiver, its tensors held in the wire dtypes and zeroed."""
    return ObjectStoreReceiver({s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype))
                                for b in plan.buckets for s in b.slots}, f"generation worker {rank}")


def refit(sender: RefitSender, plan: RefitPlan, receivers: list[ObjectStoreReceiver], delta: bool = True,
          corrupt: dict | None = None) -> tuple[list, list[Received]]:
    """One refit as ObjectStoreTransfer drives it: (the buckets sent, the receivers' reports).
    corrupt: {receiver: bucket index} whose bucket that receiver gets with one value flipped."""
    held = [r.begin(plan, verify_checksums=True) for r in receivers]  # every one: begin() resets each
    sent = list(sender.stream_buckets(plan, with_checksum=True, delta=delta, base_held=all(held)))
    for rank, r in enumerate(receivers):
        for bucket in sent:
            if corrupt and corrupt.get(rank) == bucket.index:
                values = bucket.values.clone()
                values[0] ^= 1
                bucket = replace(bucket, values=values)
            r.load(bucket)
    return sent, [r.end() for r in receivers]


def setup(receivers: int = 2):
    source = Trained()
    plan = RefitPlan.build(RefitSender(source).manifest(), bucket_bytes=2048, transfer_dtype="bfloat16",
                           keep_fp32=("router.bias",))
    # one bucket holds bf16 and the float32 bias: compared in 2-byte words
    assert len(plan.buckets) >= 3 and any({s.dtype for s in b.slots} == {"bfloat16", "float32"} for b in plan.buckets)
    # a second sender and receiver take the dense path: the reference
    dense_sender, dense_receiver = RefitSender(source), receiver(plan, 99)

    def dense_refit() -> dict[str, torch.Tensor]:
        refit(dense_sender, plan, [dense_receiver], delta=False)
        return dense_receiver.tensors

    return source, plan, RefitSender(source), [receiver(plan, rank) for rank in range(receivers)], dense_refit


def assert_bit_identical(receivers: list[ObjectStoreReceiver], expected: dict[str, torch.Tensor]):
    for r in receivers:
        for name, tensor in expected.items():
            assert r.tensors[name].dtype == tensor.dtype
            assert torch.equal(r.tensors[name].view(torch.uint8), tensor.view(torch.uint8)), f"{r.name}: {name}"


def test_delta_refits_equal_the_dense_path_bit_for_bit():
    source, plan, sender, receivers, dense_refit = setup()
    for version in range(4):
        if version:
            source.step()
        sent, reports = refit(sender, plan, receivers)
        assert_bit_identical(receivers, dense_refit())
        outcome = sender.sent()
        metrics = outcome.delta_metrics
        assert metrics["refit/dense_bytes"] == plan.total_bytes and metrics["timing/refit_delta_encode"] > 0
        assert outcome.bytes_sent == metrics["refit/delta_bytes"]
        assert all(set(r.metrics) == {"timing/refit_delta_apply"} and r.delta_failure is None for r in reports)
        if version == 0:  # nothing to compare with: every bucket whole
            assert {b.encoding for b in sent} == {"dense"} and metrics["refit/delta_fraction"] == 1.0
            assert not outcome.delta and outcome.dense_because.startswith("the first refit")
        else:
            assert outcome.delta and outcome.dense_because is None
            assert 0 < metrics["refit/delta_fraction"] < 0.5, metrics
            assert metrics["refit/delta_bytes"] < 0.75 * metrics["refit/dense_bytes"], metrics
            assert {"indices", "bitmap"} & {b.encoding for b in sent}


def test_a_corrupted_delta_is_named_and_the_next_refit_is_dense():
    source, plan, sender, receivers, dense_refit = setup()
    refit(sender, plan, receivers)
    source.step()
    victim = next(b.index for b in refit(sender, plan, receivers)[0] if b.encoding != "dense" and b.changed)
    source.step()
    _, reports = refit(sender, plan, receivers, corrupt={0: victim})
    failure = reports[0].delta_failure
    assert failure.startswith("generation worker 0: ") and f"bucket {victim} failed its checksum" in failure
    assert reports[1].delta_failure is None
    sent, reports = refit(sender, plan, receivers)  # what the driver does next: the same version again
    assert {b.encoding for b in sent} == {"dense"} and not any(r.delta_failure for r in reports)
    assert_bit_identical(receivers, dense_refit())


def test_a_new_receiver_or_a_new_plan_gets_a_dense_refit():
    source, plan, sender, receivers, dense_refit = setup()
    refit(sender, plan, receivers)
    source.step()
    receivers.append(receiver(plan, len(receivers)))  # a generation worker restarted
    sent, _ = refit(sender, plan, receivers)
    assert {b.encoding for b in sent} == {"dense"}
    assert "does not hold the buckets of the last refit" in sender.sent().dense_because
    assert_bit_identical(receivers, dense_refit())
    source.step()
    assert {b.encoding for b in refit(sender, plan, receivers)[0]} != {"dense"}
    rebuilt = RefitPlan.build(sender.manifest(), bucket_bytes=4096, transfer_dtype="bfloat16",
                              keep_fp32=("router.bias",))
    assert {b.encoding for b in refit(sender, rebuilt, receivers)[0]} == {"dense"}
    assert sender.sent().dense_because == "the plan changed"
    assert_bit_identical(receivers, dense_refit())


def test_unchanged_weights_travel_as_empty_deltas_padding_included(monkeypatch):
    """Buckets are packed into zeroed buffers: padding left as memory happened to hold would
    show changes at every refit."""
    source, plan, sender, receivers, _ = setup()
    assert any(b.nbytes > sum(s.nbytes for s in b.slots) for b in plan.buckets)
    empty = torch.empty
    # uninitialised memory, made to differ from refit to refit
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: empty(*args, **kwargs).random_(0, 100))
    for _ in range(2):
        sent, _ = refit(sender, plan, receivers)
    assert [b.changed for b in sent] == [0] * len(plan.buckets)
    assert sender.sent().delta_metrics["refit/delta_bytes"] == sender.sent().bytes_sent == 0
