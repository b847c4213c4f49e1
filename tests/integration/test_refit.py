"""Refit through the CPU transport: generation weights end bit-identical to the policy's
exported HF weights, and a corrupted bucket is caught and named. In bf16, an MoE expert bias
(refit.keep_fp32) stays float32 from the trained policy into the generation model."""

import pytest
import ray
import torch

from safetensors.torch import load_file

from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.cluster.setup import start_workers
from rlkit.cluster.worker_group import WorkerError
from rlkit.data.batch import Batch, batch_totals
from rlkit.models.resolve import resolve_model_dir
from rlkit.cluster.refit_driver import ObjectStoreTransfer, RefitDriver
from rlkit.refit.plan import PackedBucket, RefitPlan
from rlkit.workers.generation.hf import HFGenerationWorker as Engine
from rlkit.workers.policy.megatron import MegatronModelWorker as Policy

pytestmark = pytest.mark.integration


# (overrides, export path). TP=2 and EP=2: the bridge's export really gathers shards. TP=1: refits copy
# parameter rows directly (qwen2: tied embeddings and a fused qkv bias; qwen3: q/k norms). Two
# generation workers both receive every bucket.
LAYOUTS = {
    "tp2-bridge": (["policy.num_workers=2", "policy.tensor_parallel_size=2"], False),
    "dp2-direct": (["policy.num_workers=2"], True),
    "qwen3-direct": (["policy.model_path=tiny://qwen3"], True),
    # experts split over two ranks; the HF workers hold them fused (rlkit/models/checkpoint_names.py)
    "qwen3-moe-ep2": (["policy.model_path=tiny://qwen3_moe", "policy.num_workers=2", "policy.expert_parallel_size=2"],
                      False),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def workers(request, warm_pool, make_cfg):
    overrides, direct = LAYOUTS[request.param]
    cfg, _ = make_cfg(*overrides, "policy.micro_batch_size=16", "generation.num_workers=2")
    started = start_workers(cfg, str(resolve_model_dir(cfg)), pool=warm_pool)
    started.direct_export = direct
    yield started
    started.shutdown()


@pytest.fixture(scope="module")
def plan(workers):
    # a small budget so the tiny model spans many buckets
    return RefitPlan.build(workers.policy.workers.every_rank(Policy.refit_manifest)[0], bucket_bytes=64 * 1024)


def test_refit_makes_generation_weights_bit_identical(workers, plan):
    before = workers.generation.weights()[0]
    metrics = ObjectStoreTransfer(workers.policy, workers.generation)(plan, True)
    exported = workers.policy.export_hf_weights()
    assert len(plan.buckets) > 3 and metrics["refit/buckets"] == len(plan.buckets)
    assert metrics["refit/direct_export"] == workers.direct_export
    # the sender's share of the time is reported, and is part of the whole
    assert 0 < metrics["timing/refit_export_host"] + metrics["timing/refit_pack_host"] < metrics["timing/refit_transfer"]
    assert set(exported) == set(plan.names)
    for received in workers.generation.weights():
        assert set(received) == set(exported)
        for name, tensor in exported.items():
            assert received[name].dtype == tensor.dtype
            assert torch.equal(received[name], tensor), name
    assert not all(torch.equal(before[n], exported[n]) for n in exported), "refit changed nothing"


def _packed_buckets(workers, plan) -> list[PackedBucket]:
    streams = [a.stream_refit_buckets.options(num_returns="streaming").remote(plan, True)
               for a in workers.policy.workers.actors]
    buckets = [ray.get(ref) for ref in streams[0]]
    for stream in streams[1:]:
        list(stream)
    return buckets


def test_corrupted_bucket_is_detected_and_named(workers, plan):
    buckets = _packed_buckets(workers, plan)
    victim = buckets[1]
    corrupted = victim.buffer.clone()
    corrupted[len(corrupted) // 2] ^= 0x10  # one flipped bit
    generation = workers.generation.workers
    generation.every_rank(Engine.begin_refit, plan, True)
    with pytest.raises(WorkerError) as error:
        generation.only([0], Engine.load_bucket, PackedBucket(victim.index, corrupted, victim.checksum))
    message = str(error.value)
    assert f"bucket {victim.index}" in message and "checksum" in message
    assert plan.buckets[victim.index].slots[0].name in message


def test_missing_bucket_fails_the_refit(workers, plan):
    buckets = _packed_buckets(workers, plan)
    generation = workers.generation.workers
    generation.every_rank(Engine.begin_refit, plan, True)
    for bucket in buckets[:-1]:
        generation.every_rank(Engine.load_bucket, bucket)
    with pytest.raises(WorkerError, match=f"buckets \\[{buckets[-1].index}\\] never arrived"):
        generation.every_rank(Engine.end_refit)


def test_keep_fp32_expert_bias_arrives_float32_and_bit_exact_after_a_bf16_step(warm_pool, make_cfg):
    """A bf16 GLM-4-MoE policy at EP=2 trains one step and refits into bf16 HF workers with the
    run's own plan (transfer dtype bf16, refit.keep_fp32 ["*e_score_correction_bias"]): Megatron
    keeps the expert bias float32 (a buffer that Float16Module's cast would round; the router
    restores it) and frozen (moe_router_bias_update_rate 0, rlkit/bridge), so the generation
    workers hold the checkpoint's float32 bias bit for bit, and every other tensor in bf16 as the
    policy exports it."""
    cfg, _ = make_cfg("policy.model_path=tiny://glm4_moe", "policy.num_workers=2", "policy.expert_parallel_size=2",
                      "policy.precision=bf16", "generation.precision=bf16", "policy.micro_batch_size=4",
                      "generation.num_workers=1")
    model_dir = resolve_model_dir(cfg)
    workers = start_workers(cfg, str(model_dir), pool=warm_pool)
    try:
        input_ids = torch.randint(0, 300, (8, 12), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(input_ids.shape)
        workers.policy.train(Batch({"input_ids": input_ids, "loss_mask": mask}), batch_totals(mask), NextTokenNLL())
        RefitDriver(cfg, workers.policy, workers.generation, workers.placement_group, sleepers=[]).sync()
        exported, received = workers.policy.export_hf_weights(), workers.generation.weights()[0]
    finally:
        workers.shutdown()
    biases = {n: t for n, t in load_file(model_dir / "model.safetensors").items() if n.endswith("e_score_correction_bias")}
    assert biases and set(received) == set(exported)
    for name, tensor in exported.items():
        expected = biases.get(name, tensor)
        assert received[name].dtype == (torch.float32 if name in biases else torch.bfloat16), name
        assert tensor.dtype == received[name].dtype and torch.equal(received[name], expected), name
