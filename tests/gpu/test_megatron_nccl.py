"""Megatron policy on NCCL, bf16, DDP + distributed optimizer, at TP=2 and PP=2 on two GPUs."""

import math

import pytest
import torch

from rlkit.data.batch import batch_totals
from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.cluster.setup import start_workers
from rlkit.data.batch import Batch
from rlkit.models.resolve import resolve_model_dir

DISAGGREGATED = ["cluster.placement=disaggregated", "refit=nccl"]


@pytest.mark.gpus(2)
@pytest.mark.parametrize("layout", [["policy.tensor_parallel_size=2"], ["policy.pipeline_parallel_size=2"]],
                         ids=["tp2", "pp2"])
def test_megatron_nccl_parallel_train_step(ray_cluster, make_cfg, layout):
    """Megatron on NCCL, bf16, DDP + distributed optimizer at TP=2 / PP=2 over 2 GPUs: logprobs
    match TP=1 and a train step runs."""
    g = torch.Generator().manual_seed(0)
    batch = Batch({"input_ids": torch.randint(0, 300, (16, 12), generator=g)})
    results = {}
    for name, overrides in [("ref", ["policy.num_workers=1"]), ("par", ["policy.num_workers=2", *layout])]:
        cfg, _ = make_cfg(*DISAGGREGATED, *overrides, "policy.micro_batch_size=4")
        workers = start_workers(cfg, str(resolve_model_dir(cfg)), with_generation=False)
        try:
            results[name] = workers.policy.logprobs(batch)
            mask = torch.ones(16, 12)
            metrics = workers.policy.train(batch.with_fields(loss_mask=mask), batch_totals(mask), NextTokenNLL())
            assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        finally:
            workers.shutdown()
    # bf16 forward passes with different reduction orders: within a few bf16 ulps of logprob
    assert (results["ref"] - results["par"]).abs().max().item() < 0.1
