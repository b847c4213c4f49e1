"""refit.delta end to end: three GRPO steps of the tiny recipe on a local Ray cluster (two policy
ranks, two HF generation workers), trained in fp32 at a small learning rate and sent in bf16.
The first refit is dense, the next ones send only the changed elements; after every refit each
generation worker holds exactly the policy's exported weights in bf16, bit for bit."""

import pytest
import torch

from rlkit.cluster.refit_driver import RefitDriver
from rlkit.launch.run import train

pytestmark = pytest.mark.integration


def test_grpo_refits_with_deltas_bit_identical_to_the_policy(warm_pool, make_cfg, monkeypatch):
    push_weights, compared = RefitDriver.push_weights, []

    def push_then_compare(driver: RefitDriver) -> dict:
        metrics = push_weights(driver)
        exported = driver.policy.export_hf_weights()  # fp32: a dense refit loads each in bf16
        for received in driver.generation.weights():
            assert set(received) == set(exported)
            for name, tensor in exported.items():
                assert received[name].dtype == torch.bfloat16, name
                assert torch.equal(received[name], tensor.to(torch.bfloat16)), name
        compared.append(metrics)
        return metrics

    monkeypatch.setattr(RefitDriver, "push_weights", push_then_compare)
    cfg, resolved = make_cfg("refit.delta=true", "refit.bucket_mb=0.25", "generation.precision=bf16",
                             # the untrained model earns no reward, so no advantage: the entropy bonus moves it
                             "algorithm.entropy_coef=0.01", "policy.optimizer.lr=1e-5",
                             "algorithm.num_steps=3", "algorithm.prompts_per_step=8",
                             "policy.train_global_batch_size=64", "algorithm.val_before_training=false",
                             "algorithm.val_every=100", "run.name=grpo_delta_refit")
    history = train(cfg, resolved, pool=warm_pool).history
    # a refit before each step's rollout, and one for the validation after the last step
    assert len(history) == 3 and len(compared) == 4
    assert all("refit/delta_fraction" in metrics for metrics in history)
    first, *later = compared
    assert first["refit/buckets"] > 1
    assert first["refit/delta_fraction"] == 1.0 and first["refit/delta_bytes"] == first["refit/dense_bytes"]
    for metrics in later:
        assert 0 < metrics["refit/delta_fraction"] < 0.5, metrics
        assert metrics["refit/delta_bytes"] < 0.5 * metrics["refit/dense_bytes"], metrics
    for metrics in compared:
        assert metrics["refit/delta_redone"] == 0.0
        assert metrics["timing/refit_delta_encode"] > 0 and metrics["timing/refit_delta_apply"] > 0
    print("refit/delta_fraction:", [round(m["refit/delta_fraction"], 4) for m in compared],
          "refit/delta_bytes:", [m["refit/delta_bytes"] for m in compared])
