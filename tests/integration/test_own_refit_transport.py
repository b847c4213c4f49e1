"""A refit transport of one's own, from this file alone: FILES, a TransportSpec whose sending half
writes each packed bucket to a file and whose receiving half reads it back, selected as a user
selects theirs (refit.transport=module:attribute). Its own config rule refuses a bad setting
before any worker starts; on the CPU path (Megatron policy ranks, HF generation workers, each
serving refits from a standing receiver of its own) a refit through it, then another after a
training step (replayed), leaves every generation worker bit-identical to the policy's export."""

import os
import tempfile

import pytest
import torch

from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.cluster.refit_driver import RefitDriver
from rlkit.cluster.setup import start_workers
from rlkit.config.schema import ConfigError
from rlkit.data.batch import Batch, batch_totals
from rlkit.models.resolve import resolve_model_dir
from rlkit.refit.plan import PackedBucket
from rlkit.refit.transport import TransportSpec

pytestmark = pytest.mark.integration

TRANSPORT = "tests.integration.test_own_refit_transport:FILES"


class FileSender:
    """Writes each bucket to a file of its own, sends every receiver its path, and removes it once
    all of them loaded it."""

    def prepare(self, plan, fresh_receivers: bool):
        return None  # nothing for the receivers to set up

    def send(self, channels, plan, pack):
        for _ in plan.buckets:
            packed = pack(None)
            descriptor, path = tempfile.mkstemp(prefix="rlkit-refit-bucket-")
            with os.fdopen(descriptor, "wb") as file:
                file.write(packed.buffer.numpy().tobytes())
            try:
                for channel in channels:
                    channel.send((packed.index, path, packed.checksum))
                for channel in channels:
                    channel.expect(packed.index, f"bucket {packed.index} to be loaded")
            finally:
                os.remove(path)


class FileReceiver:
    def receive(self, channel, plan, start, load):
        for bucket in plan.buckets:
            index, path, checksum = channel.receive(f"bucket {bucket.index}")
            load(PackedBucket(index, torch.from_file(path, size=bucket.nbytes, dtype=torch.uint8), checksum))
            channel.send(index)


def one_machine(cfg):
    if cfg.refit.channel_host != "loopback":
        raise ConfigError(f"refit.channel_host: the file transport reaches one machine's files only (got: "
                          f"{cfg.refit.channel_host}); set refit.channel_host=loopback")


FILES = TransportSpec("files", check=one_machine, sending_half=FileSender, receiving_half=FileReceiver)


def test_its_own_rule_refuses_a_bad_setting_before_any_worker_starts(make_cfg):
    with pytest.raises(ConfigError, match=r"^refit.channel_host: the file transport reaches one machine's files"):
        make_cfg(f"refit.transport={TRANSPORT}", "refit.channel_host=node_ip")


def test_refits_through_it_leave_generation_bit_identical_to_the_policy(warm_pool, make_cfg):
    cfg, _ = make_cfg(f"refit.transport={TRANSPORT}", "refit.bucket_mb=0.0625")
    workers = start_workers(cfg, str(resolve_model_dir(cfg)), pool=warm_pool)
    try:
        driver = RefitDriver(cfg, workers.policy, workers.generation, workers.placement_group, sleepers=[])
        compared = []
        for step in range(2):
            if step:  # new weights, loaded by replaying the first refit's copies
                input_ids = torch.randint(0, 300, (8, 12), generator=torch.Generator().manual_seed(0))
                mask = torch.ones(input_ids.shape)
                workers.policy.train(Batch({"input_ids": input_ids, "loss_mask": mask}), batch_totals(mask),
                                     NextTokenNLL())
            metrics = driver.push_weights()
            compared.append((metrics, workers.policy.export_hf_weights(), workers.generation.weights()))
    finally:
        workers.shutdown()
    (first, before, _), (second, after, received) = compared
    assert not all(torch.equal(before[name], after[name]) for name in after), "training changed nothing"
    assert first["refit/buckets"] == second["refit/buckets"] > 3 and second["refit/replayable_fraction"] == 1.0
    assert len(received) == 2
    for weights in received:
        assert set(weights) == set(after)
        for name, tensor in after.items():
            assert weights[name].dtype == tensor.dtype and torch.equal(weights[name], tensor), name
    assert not [f for f in os.listdir(tempfile.gettempdir()) if f.startswith("rlkit-refit-bucket-")]
