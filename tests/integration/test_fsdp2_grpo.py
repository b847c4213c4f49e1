"""GRPO through the launch path with policy.backend=fsdp2 on a tiny Phi-3, an architecture neither
Megatron bridge converts: a 2-step SFT warm start (saved as an HF checkpoint from the shards), then
2 GRPO steps with a KL reference and an entropy bonus (so every step changes the weights whatever
the rewards), the policy's 2 FSDP2 ranks refitting 2 HF generation workers and checkpointing each
step. After each step's refit the generation workers' sampled logprobs are the policy's own: refit
moved the trained weights under their HF names. The run started again without its last checkpoint
resumes from the one before and logs that last step's metrics exactly."""

import json
import shutil

import pytest

from rlkit.launch.run import train

pytestmark = pytest.mark.integration
RUN = ("policy=fsdp2_tiny", "policy.model_path=tiny://phi3", "run.name=fsdp2_phi3", "algorithm.warm_start.sft_steps=2",
       "algorithm.num_steps=2", "algorithm.val_every=2", "algorithm.prompts_per_step=8", "algorithm.group_size=4",
       "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.01", "policy.train_global_batch_size=16",
       "policy.micro_batch_size=8", "generation.num_workers=2", "checkpoint.every=1")


def steps(metrics_file) -> dict[int, dict]:
    """Per step, every metric but wall-clock timings."""
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith("timing/")} for r in rows}


def test_grpo_trains_a_phi3_policy_under_fsdp2_refits_it_and_resumes_exactly(warm_pool, make_cfg):
    run_dir = train(*make_cfg(*RUN), pool=warm_pool).run_dir
    uninterrupted = steps(run_dir / "metrics.jsonl")
    for step in (1, 2):
        assert uninterrupted[step]["refit/logprob_abs_error_max"] < 1e-4, uninterrupted[step]
        assert uninterrupted[step]["train/grad_norm"] > 0, uninterrupted[step]
    shutil.rmtree(run_dir / "checkpoints" / "step_000002")
    (run_dir / "metrics.jsonl").rename(run_dir / "uninterrupted.jsonl")
    resumed = steps(train(*make_cfg(*RUN), pool=warm_pool).run_dir / "metrics.jsonl")
    assert sorted(resumed) == [2] and resumed[2] == uninterrupted[2]  # from step 1's checkpoint, step 2 alone
