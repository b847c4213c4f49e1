"""refit.peft=adapter on the CPU: the HF generation workers load the run's start checkpoint
themselves, under HF peft's LoRA, and each refit moves policy.peft's adapters alone. Through the
launch path (grpo_tiny_lora_cpu): the workers' logprobs equal the policy's on the same tokens, and
refit/bytes is the adapters' size, a fraction of the model's; directly: after a training step and
a refit, every generation worker holds the policy's exported adapters bit for bit, over the
checkpoint's own weights."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.cluster.refit_driver import RefitDriver
from rlkit.cluster.setup import start_workers
from rlkit.data.batch import Batch, batch_totals
from rlkit.launch.config import load_config
from rlkit.models.resolve import resolve_model_dir
from rlkit.workers.policy.megatron import MegatronModelWorker as Policy

pytestmark = pytest.mark.integration
RECIPE = "grpo_tiny_lora_cpu"


def _parameter_bytes(model_dir, peft) -> tuple[int, int]:
    """(the HF model's parameter bytes, those of policy.peft's adapters over it), counted by HF peft."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    base = sum(p.numel() * p.element_size() for p in model.parameters())
    model = get_peft_model(model, LoraConfig(r=peft.rank, lora_alpha=peft.alpha, target_modules=peft.target_modules))
    return base, sum(p.numel() * p.element_size() for name, p in model.named_parameters() if ".lora_" in name)


def test_a_lora_run_refits_the_adapters_alone(warm_pool, cache_dir, tmp_path):
    """test_lora.py's run (its cached warm start) with refit.peft=adapter."""
    from rlkit.launch.run import train

    cfg, resolved = load_config(RECIPE, [
        f"run.cache_dir={cache_dir}", f"run.output_dir={tmp_path}", "algorithm.num_steps=2", "algorithm.val_every=2",
        "checkpoint.every=0", "algorithm.prompts_per_step=16", "policy.train_global_batch_size=128",
        "algorithm.warm_start.sft_steps=61", "refit.peft=adapter", "logger.plots=false"])
    history = train(cfg, resolved, pool=warm_pool).history
    base_bytes, adapter_bytes = _parameter_bytes(resolve_model_dir(cfg), cfg.policy.peft)
    assert adapter_bytes < base_bytes / 10  # what the merged refit would move instead
    # refits before step 0's validation and before step 2's rollout (step 1 generates from step 0's weights)
    assert [metrics["refit/bytes"] for metrics in history if "refit/bytes" in metrics] == [adapter_bytes] * 2
    for step in (1, 2):
        assert history[step]["refit/logprob_abs_error_max"] < 1e-4
        assert history[step]["train/grad_norm"] > 0


def test_generation_workers_hold_the_policys_adapters_bit_for_bit(warm_pool, cache_dir, tmp_path):
    """bf16 generation: the adapters travel in bf16 and land unchanged in both workers' HF peft
    LoRA, over the checkpoint's weights (not random ones: no base weight is ever refit)."""
    cfg, _ = load_config(RECIPE, [f"run.cache_dir={cache_dir}", f"run.output_dir={tmp_path}", "refit.peft=adapter",
                                  "generation.precision=bf16", "policy.micro_batch_size=4",
                                  "policy.optimizer.lr=1e-2"])
    model_dir = resolve_model_dir(cfg)
    workers = start_workers(cfg, str(model_dir), pool=warm_pool)
    try:
        input_ids = torch.randint(0, 300, (8, 12), generator=torch.Generator().manual_seed(0))
        mask = torch.ones(input_ids.shape)
        assert workers.policy.train(Batch({"input_ids": input_ids, "loss_mask": mask}), batch_totals(mask),
                                    NextTokenNLL())["grad_norm"] > 0
        driver = RefitDriver(cfg, workers.policy, workers.generation, workers.placement_group, sleepers=[])
        metrics = driver.sync()
        exported = workers.policy.workers.every_rank(Policy.export_refit_adapters, "bfloat16")[0]
        held, bases = workers.generation.adapter_weights(), workers.generation.weights()
    finally:
        workers.shutdown()
    assert driver.plan is None  # no base weight moved
    assert metrics["refit/bytes"] == sum(t.numel() * t.element_size() for t in exported.values())
    assert any(t.any() for name, t in exported.items() if ".lora_B." in name)  # trained: B is zero no more
    checkpoint = load_file(model_dir / "model.safetensors")
    for adapters, base in zip(held, bases):
        assert set(adapters) == set(exported)
        for name, tensor in exported.items():
            assert tensor.dtype == adapters[name].dtype == torch.bfloat16 and torch.equal(adapters[name], tensor), name
        assert set(base) == set(checkpoint)
        for name, tensor in checkpoint.items():
            assert torch.equal(base[name], tensor.to(torch.bfloat16)), name
