"""GRPO end to end with vLLM generation, dense and MoE, trained by Megatron or FSDP2: colocated on one
GPU, disaggregated on two; on two GPUs also two engines fed by two policy ranks, and one engine
spread over both GPUs; on three and four, the same disaggregated over nccl."""

import math

import pytest

from rlkit.launch.run import train

COLOCATED = ["cluster.placement=colocated", "refit=cuda_ipc"]
DISAGGREGATED = ["cluster.placement=disaggregated", "refit=nccl"]


# tiny Qwen3-MoE (4 experts, top-2): vLLM's fused experts receive the refit
MOE = ["policy.model_path=tiny://qwen3_moe"]
# colocated on two GPUs: each policy rank feeds the engine process on its GPU
TWO_ENGINES = ["policy.num_workers=2", "generation.num_workers=2"]
TP2_ENGINE = ["policy.num_workers=2", "generation.num_workers=1", "generation.vllm.tensor_parallel_size=2"]
# the MoE policy's experts split over two ranks (EP=2), each exporting its experts for the engine beside it
MOE_EP2 = MOE + ["policy.num_workers=2", "policy.expert_parallel_size=2", "generation.num_workers=2"]
# the policy trained by PyTorch FSDP2 (configs/policy/fsdp2_gpu.yaml): HF names straight from its shards
FSDP2 = ["policy=fsdp2_gpu"]


@pytest.mark.parametrize("layout", [pytest.param(COLOCATED, id="cuda_ipc"),
                                    pytest.param(DISAGGREGATED, id="nccl", marks=pytest.mark.gpus(2)),
                                    pytest.param(COLOCATED + MOE, id="moe-cuda_ipc"),
                                    pytest.param(COLOCATED + FSDP2, id="fsdp2-cuda_ipc"),
                                    pytest.param(DISAGGREGATED + FSDP2, id="fsdp2-nccl", marks=pytest.mark.gpus(2)),
                                    # two FSDP2 ranks, each feeding the engine on its GPU
                                    pytest.param(COLOCATED + FSDP2 + TWO_ENGINES, id="fsdp2-two-engines-cuda_ipc",
                                                 marks=pytest.mark.gpus(2)),
                                    # each episode's requests sent as it makes them (vLLM's generate_requests)
                                    pytest.param(COLOCATED + ["env_runner.flow=per_trajectory"],
                                                 id="per-trajectory-cuda_ipc"),
                                    pytest.param(DISAGGREGATED + MOE, id="moe-nccl", marks=pytest.mark.gpus(2)),
                                    pytest.param(COLOCATED + TWO_ENGINES, id="two-engines-cuda_ipc",
                                                 marks=pytest.mark.gpus(2)),
                                    pytest.param(COLOCATED + TP2_ENGINE, id="tp2-engine-cuda_ipc",
                                                 marks=pytest.mark.gpus(2)),
                                    pytest.param(COLOCATED + MOE_EP2, id="moe-ep2-cuda_ipc", marks=pytest.mark.gpus(2)),
                                    pytest.param(DISAGGREGATED + ["generation.vllm.tensor_parallel_size=2"],
                                                 id="tp2-engine-nccl", marks=pytest.mark.gpus(3)),
                                    # policy rank i feeds engine i (refit.broadcast_groups=spread)
                                    pytest.param(DISAGGREGATED + TWO_ENGINES, id="two-engines-nccl-spread",
                                                 marks=pytest.mark.gpus(4))])
def test_grpo_with_vllm(ray_cluster, make_cfg, layout, request):
    cfg, resolved = make_cfg(*layout, "algorithm.num_steps=3", "algorithm.val_every=3",
                             "algorithm.warm_start.sft_steps=20", f"run.name=gpu_{request.node.callspec.id}")
    result = train(cfg, resolved)
    assert len(result.history) == 4
    for metrics in result.history[1:]:
        assert all(math.isfinite(metrics[k]) for k in ["train/reward", "train/grad_norm", "train/entropy"])
        assert metrics["refit/token_mult_prob_error"] <= 1.05
        if cfg.cluster.placement == "colocated":  # the policy's memory was freed while vLLM generated
            assert metrics["memory/policy_offloaded_gb"] > 0
    print(f"GRPO {request.node.callspec.id}: " + ", ".join(
        f"step {i}: reward {m['train/reward']:.3f} mult_err {m['refit/token_mult_prob_error']:.4f}"
        for i, m in enumerate(result.history[1:], 1)))
