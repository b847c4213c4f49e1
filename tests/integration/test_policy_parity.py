"""Megatron policy logprobs agree across parallel layouts and with HF transformers.

Tolerance: 1e-5 absolute on token logprobs (fp32; measured differences are ~1e-6, from
different reduction orders in TP matmuls and the vocab-parallel softmax)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlkit.cluster.setup import start_workers
from rlkit.data.batch import Batch

pytestmark = pytest.mark.integration
TOLERANCE = 1e-5


def _hf_logprobs(model_dir, input_ids):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return torch.nn.functional.pad(lp, (1, 0))


@pytest.fixture(scope="module")
def sequences(tiny_qwen2):
    g = torch.Generator().manual_seed(0)
    return Batch({"input_ids": torch.randint(0, 300, (8, 12), generator=g)})


def _policy_logprobs(make_cfg, model_dir, batch, overrides):
    cfg, _ = make_cfg(*overrides)
    workers = start_workers(cfg, str(model_dir))
    try:
        return workers.policy.logprobs(batch)
    finally:
        workers.shutdown()


@pytest.mark.parametrize("layout", [["policy.num_workers=1"],
                                    ["policy.num_workers=2", "policy.tensor_parallel_size=2"],
                                    ["policy.num_workers=2", "policy.pipeline_parallel_size=2"]],
                         ids=["tp1", "tp2", "pp2"])
def test_logprobs_match_hf(ray_cluster, make_cfg, tiny_qwen2, sequences, layout):
    reference = _hf_logprobs(tiny_qwen2, sequences["input_ids"])
    overrides = [*layout, "policy.micro_batch_size=4", "policy.train_global_batch_size=128",
                 "generation.num_workers=1"]
    logprobs = _policy_logprobs(make_cfg, tiny_qwen2, sequences, overrides)
    assert logprobs.shape == reference.shape
    assert (logprobs - reference).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_other_architectures_match_hf(ray_cluster, make_cfg, cache_dir, sequences, arch):
    """Qwen3 (q/k norms, untied) and Llama load through the bridge and agree with HF at TP=2."""
    from rlkit.models.resolve import resolve_model_dir

    cfg, _ = make_cfg(f"policy.model_path=tiny://{arch}")
    model_dir = resolve_model_dir(cfg)
    reference = _hf_logprobs(model_dir, sequences["input_ids"])
    logprobs = _policy_logprobs(make_cfg, model_dir, sequences,
                                [f"policy.model_path=tiny://{arch}", "policy.num_workers=2",
                                 "policy.tensor_parallel_size=2", "policy.micro_batch_size=4",
                                 "generation.num_workers=1"])
    assert (logprobs - reference).abs().max().item() < TOLERANCE
