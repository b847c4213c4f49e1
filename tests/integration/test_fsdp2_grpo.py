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


@pytest.mark.parametrize("refit_peft", ["merged", "adapter"])
def test_lora_grpo_under_fsdp2_refits_its_adapters_and_checkpoints_them_alone(warm_pool, make_cfg, refit_peft):
    """grpo_tiny_lora_cpu's adapters (HF peft's LoRA on every linear layer, the base frozen) on the
    FSDP2 policy: the KL reference is the base with the adapters off (0 at the first step), the
    generation workers get the merged weights or the adapters alone and sample the policy's
    logprobs, and a checkpoint holds the adapters with a record of their base."""
    # Phi-3's own module names: peft adapts its fused layers as they are
    peft = "{type: lora, rank: 8, alpha: 16, dropout: 0.0, target_modules: [qkv_proj, o_proj, gate_up_proj, down_proj]}"
    run_dir = train(*make_cfg(*RUN, f"run.name=fsdp2_lora_{refit_peft}", f"policy.peft={peft}",
                              "policy.optimizer.lr=1e-3", f"refit.peft={refit_peft}", "checkpoint.every=2"),
                    pool=warm_pool).run_dir
    metrics = steps(run_dir / "metrics.jsonl")
    assert metrics[1]["train/reference_kl"] == 0.0
    for step in (1, 2):
        assert metrics[step]["refit/logprob_abs_error_max"] < 1e-4, metrics[step]
        assert metrics[step]["train/grad_norm"] > 0, metrics[step]
    assert metrics[2]["train/reference_kl"] > 0  # the adapters moved the policy off its base
    assert (run_dir / "checkpoints" / "step_000002" / "policy" / "base.json").is_file()
