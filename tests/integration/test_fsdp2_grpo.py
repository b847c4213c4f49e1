"""GRPO through the launch path with policy.backend=fsdp2 on a tiny Phi-3, an architecture neither
Megatron bridge converts: a 2-step SFT warm start (saved as an HF checkpoint from the shards), then
2 GRPO steps with a KL reference and an entropy bonus (so every step changes the weights whatever
the rewards), the policy's 2 FSDP2 ranks refitting 2 HF generation workers. After each step's
refit the generation workers' sampled logprobs are the policy's own: refit moved the trained
weights under their HF names."""

import pytest

from rlkit.launch.run import train

pytestmark = pytest.mark.integration


def test_grpo_trains_a_phi3_policy_under_fsdp2_and_refits_it(warm_pool, make_cfg):
    result = train(*make_cfg("policy=fsdp2_tiny", "policy.model_path=tiny://phi3", "run.name=fsdp2_phi3",
                             "algorithm.warm_start.sft_steps=2", "algorithm.num_steps=2", "algorithm.val_every=2",
                             "algorithm.prompts_per_step=8", "algorithm.group_size=4", "algorithm.kl_coef=0.01",
                             "algorithm.entropy_coef=0.01", "policy.train_global_batch_size=16",
                             "policy.micro_batch_size=8", "generation.num_workers=2"), pool=warm_pool)
    steps = [row for row in result.history if row.get("step", 0) >= 1 and "refit/logprob_abs_error_max" in row]
    assert len(steps) == 2, result.history
    for row in steps:
        assert row["refit/logprob_abs_error_max"] < 1e-4, row
        assert row["train/grad_norm"] > 0, row
