"""ObjectStoreTransfer's delta refit fallback, its worker calls run in this process (no Ray): a
delta that fails its checksum on one generation worker is logged in one line naming the worker
and the bucket, and the refit is redone dense at once, leaving every worker bit-identical to a
dense refit; a dense redo that fails too is an error."""

import logging
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rlkit.cluster.refit_driver import ObjectStoreTransfer
from rlkit.workers.generation.hf import HFGenerationWorker
from rlkit.refit.plan import RefitIntegrityError, RefitPlan
from rlkit.refit.sender import RefitSender
from test_refit_delta_halves import Trained, assert_bit_identical, receiver


class Group:
    """A WorkerGroup whose workers are local objects: a call, by the method's name as WorkerGroup
    makes it, runs at once and is its own result."""

    def __init__(self, workers: list):
        self.workers = workers
        self.actors = [SimpleNamespace(stream_refit_buckets=Streaming(w)) for w in workers]

    def __len__(self):
        return len(self.workers)

    def every_rank(self, method, *args):
        return [getattr(worker, method.__name__)(*args) for worker in self.workers]

    submit = every_rank

    def wait(self, refs: list, what: str, ranks=None) -> list:
        return refs


class Streaming:
    """A policy actor's stream_refit_buckets, as ObjectStoreTransfer calls it through Ray."""

    def __init__(self, worker):
        self.worker = worker

    def options(self, num_returns: str):
        return self

    def remote(self, *args):
        return self.worker.refit_sender.stream_buckets(*args)


class Corrupting:
    """A receiver that flips one value of the first bucket that carries any, in each of the next
    `times` refits (damaged in transit)."""

    def __init__(self, receiver, times: int):
        self.receiver, self.times, self.hit = receiver, times, False

    def begin(self, plan, verify_checksums):
        self.hit = False
        return self.receiver.begin(plan, verify_checksums)

    def load(self, bucket):
        if self.times and not self.hit and bucket.values.numel():
            values = bucket.values.clone()
            values[0] ^= 1
            bucket, self.hit = replace(bucket, values=values), True
            self.times -= 1
        self.receiver.load(bucket)

    def end(self):
        return self.receiver.end()


def generation_worker(receiver) -> HFGenerationWorker:
    """An HF generation worker's refit calls over `receiver`, without its model."""
    worker = object.__new__(HFGenerationWorker)
    worker.receiver = receiver
    return worker


def transfer(corrupt_times: int):
    source = Trained()
    plan = RefitPlan.build(RefitSender(source).manifest(), bucket_bytes=2048, transfer_dtype="bfloat16",
                           keep_fp32=("router.bias",))
    sender = RefitSender(source)
    policy = SimpleNamespace(refit_sender=sender, refit_stats=sender.sent)  # MegatronModelWorker's refit calls
    receivers = [receiver(plan, rank) for rank in range(2)]
    workers = [generation_worker(r) for r in receivers]
    move = ObjectStoreTransfer(SimpleNamespace(workers=Group([policy])), SimpleNamespace(workers=Group(workers)),
                               delta=True)
    move(plan, True)  # dense: nothing held yet
    source.step()
    workers[0].receiver = Corrupting(receivers[0], corrupt_times)
    return move, plan, source, receivers


def expected(source: Trained, plan: RefitPlan) -> dict[str, torch.Tensor]:
    """What a dense refit loads: every exported tensor in its wire dtype."""
    wire = {s.name: getattr(torch, s.dtype) for b in plan.buckets for s in b.slots}
    return {name: tensor.to(wire[name]) for name, tensor in source.hf_weights()}


def test_a_failed_delta_is_logged_and_the_refit_redone_dense(caplog):
    move, plan, source, receivers = transfer(corrupt_times=1)
    with caplog.at_level(logging.WARNING, logger="rlkit"):
        metrics = move(plan, True)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("refit: ")]
    assert metrics["refit/delta_redone"] == 1.0 and metrics["refit/delta_fraction"] == 1.0  # the redo: dense
    assert len(logged) == 1 and logged[0].startswith("refit: generation worker 0: refit: bucket ")
    assert "failed its checksum" in logged[0] and logged[0].endswith("; redoing this refit dense")
    assert_bit_identical(receivers, expected(source, plan))
    source.step()
    metrics = move(plan, True)  # every worker holds the redo's buckets again: deltas
    assert metrics["refit/delta_redone"] == 0.0 and metrics["refit/delta_fraction"] < 0.5
    assert_bit_identical(receivers, expected(source, plan))


def test_a_dense_redo_that_fails_too_is_an_error():
    move, plan, _, _ = transfer(corrupt_times=2)
    with pytest.raises(RefitIntegrityError, match="generation worker 0: refit: bucket .* also when the refit was "
                                                  "redone dense"):
        move(plan, True)
