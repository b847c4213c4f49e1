"""LoRA GRPO with vLLM under refit.peft=adapter: each engine loads the run's start checkpoint with
LoRA on, every refit hands it the policy's adapters alone as a new LoRA adapter, and its logprobs
agree with the policy's on the sampled tokens. Colocated, the engine sleeps between rollouts with
its LoRA buffers among its weights; its adapter files are gone once the run ends."""

import glob
import math
import os
import tempfile

import pytest
from transformers import AutoModelForCausalLM

from rlkit.launch.run import train
from rlkit.models.resolve import resolve_model_dir

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8
LORA = ["policy.bridge=megatron_bridge", "refit.peft=adapter",
        f"policy.peft={{type: lora, rank: {RANK}, alpha: 16, dropout: 0.0, target_modules: [{','.join(TARGETS)}]}}"]
COLOCATED = ["cluster.placement=colocated", "refit=cuda_ipc"]
DISAGGREGATED = ["cluster.placement=disaggregated", "refit=nccl"]


def _adapter_dirs() -> set[str]:
    """The vLLM workers' adapter directories on this node (tmpfs, else the temp dir)."""
    return {path for root in ("/dev/shm", tempfile.gettempdir()) if os.path.isdir(root)
            for path in glob.glob(os.path.join(root, "rlkit-adapters-*"))}


def _bf16_bytes(model_dir) -> tuple[int, int]:
    """(the model's weights, rank-RANK adapters on TARGETS) in bf16 bytes, from the HF model's layers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    adapted = [m for name, m in model.named_modules() if name.rpartition(".")[2] in TARGETS]
    return (2 * sum(p.numel() for p in model.parameters()),
            2 * RANK * sum(m.in_features + m.out_features for m in adapted))


@pytest.mark.parametrize("layout", [pytest.param(COLOCATED, id="cuda_ipc"),
                                    pytest.param(DISAGGREGATED, id="nccl", marks=pytest.mark.gpus(2))])
def test_grpo_lora_with_vllm_refits_the_adapters_alone(ray_cluster, make_cfg, layout, request):
    before = _adapter_dirs()
    cfg, resolved = make_cfg(*layout, *LORA, "algorithm.num_steps=3", "algorithm.val_every=3",
                             "algorithm.warm_start.sft_steps=20", f"run.name=gpu_lora_{request.node.callspec.id}")
    history = train(cfg, resolved).history
    for metrics in history[1:]:
        assert math.isfinite(metrics["train/reward"]) and metrics["train/grad_norm"] > 0
        assert metrics["refit/token_mult_prob_error"] <= 1.05
    model_bytes, adapter_bytes = _bf16_bytes(resolve_model_dir(cfg))
    refits = [m["refit/bytes"] for m in history if "refit/bytes" in m]
    assert len(refits) > 1 and set(refits) == {adapter_bytes}  # the adapters alone, in bf16
    assert adapter_bytes < model_bytes / 10
    assert _adapter_dirs() == before  # every engine removed its adapter files at shutdown
    print(f"LoRA adapter refit {request.node.callspec.id}: " + ", ".join(
        f"step {i}: reward {m['train/reward']:.3f} mult_err {m['refit/token_mult_prob_error']:.4f} "
        f"refit {m.get('timing/refit_transfer', 0):.3f} s" for i, m in enumerate(history[1:], 1)))
