"""FP8 rollouts (generation.vllm.quantization=fp8): the engine starts from dummy weights and holds
only what refit gives it, quantized by vLLM as each refit loads it; the policy trains in bf16. A
refit that never reached the engine would leave its logprobs those of random weights."""

import math

from rlkit.launch.run import train


def test_grpo_with_fp8_rollouts_keeps_the_engine_on_the_policy(ray_cluster, make_cfg):
    cfg, resolved = make_cfg("cluster.placement=colocated", "refit=cuda_ipc", "generation.vllm.quantization=fp8",
                             "algorithm.num_steps=3", "algorithm.val_every=3", "algorithm.warm_start.sft_steps=20",
                             "run.name=gpu_fp8_rollouts")
    result = train(cfg, resolved)
    for metrics in result.history[1:]:
        assert all(math.isfinite(metrics[k]) for k in ["train/reward", "train/grad_norm", "train/entropy"])
        # fp8 weights sample near the bf16 policy (bf16 engines: <= 1.05); random weights would be far off
        assert metrics["refit/token_mult_prob_error"] <= 1.5
    # every tensor of each refit through vLLM's quantizing loader, none replayed (rows of steps whose
    # rollout followed no refit have no refit figures)
    refits = [m for m in result.history[1:] if "refit/replayable_fraction" in m]
    assert refits and all(m["refit/replayable_fraction"] == 0.0 for m in refits)
    steps = enumerate(result.history[1:], 1)
    print("fp8 rollouts: " + ", ".join(f"step {i}: reward {m['train/reward']:.3f} mult_err "
                                       f"{m['refit/token_mult_prob_error']:.4f}" for i, m in steps))
