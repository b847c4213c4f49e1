"""A tiny Qwen3-MoE (4 experts, top-2) without TransformerEngine, its experts on one rank, spread
over 2 (EP=2) and over 2 x 2 with tensor parallelism: Megatron's logprobs equal HF transformers'
(tolerance as in test_policy_parity.py), and the bridge's HF export, which gathers the experts
back, returns the checkpoint it loaded bit for bit."""

import pytest
import torch
from safetensors.torch import load_file
from test_policy_parity import TOLERANCE, _hf_logprobs

from rlkit.cluster.setup import start_workers
from rlkit.data.batch import Batch
from rlkit.models.resolve import resolve_model_dir

pytestmark = pytest.mark.integration
MOE = "policy.model_path=tiny://qwen3_moe"
LAYOUTS = {"ep1": ["policy.num_workers=1"],
           "ep2": ["policy.num_workers=2", "policy.expert_parallel_size=2"],
           "tp2-ep2": ["policy.num_workers=4", "policy.tensor_parallel_size=2", "policy.expert_parallel_size=2"]}


@pytest.fixture(scope="module")
def moe_dir(make_cfg):
    cfg, _ = make_cfg(MOE)
    return resolve_model_dir(cfg)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def moe_policy(request, ray_cluster, make_cfg, moe_dir):
    cfg, _ = make_cfg(MOE, *LAYOUTS[request.param], "policy.micro_batch_size=4")
    workers = start_workers(cfg, str(moe_dir), with_generation=False)
    yield workers.policy
    workers.shutdown()


def test_moe_logprobs_match_hf(moe_policy, moe_dir):
    input_ids = torch.randint(0, 300, (8, 12), generator=torch.Generator().manual_seed(0))
    reference = _hf_logprobs(moe_dir, input_ids)
    logprobs = moe_policy.logprobs(Batch({"input_ids": input_ids}))
    assert (logprobs - reference).abs().max().item() < TOLERANCE


def test_moe_export_returns_the_checkpoint_bit_exact(moe_policy, moe_dir):
    checkpoint = load_file(moe_dir / "model.safetensors")
    exported = moe_policy.export_hf_weights()
    assert set(exported) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
