"""A tiny Qwen3-MoE (4 experts, top-2) without TransformerEngine, its experts on one rank, spread
over 2 (EP=2) and over 2 x 2 with tensor parallelism, and a tiny GLM-4-MoE at EP=1 and EP=2: Megatron's logprobs equal HF transformers'
(tolerance as in test_policy_parity.py), and the bridge's HF export, which gathers the experts
back, returns the checkpoint it loaded bit for bit. One SFT step has HF's loss and gradient norm
where Megatron trains an MoE model (TP=1), and is refused by name at TP > 1."""

import pytest
import torch
from safetensors.torch import load_file
from test_policy_parity import TOLERANCE, _hf_logprobs
from transformers import AutoModelForCausalLM

from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.cluster.worker_group import WorkerError
from rlkit.data.batch import Batch, batch_totals
from rlkit.models.resolve import resolve_model_dir

pytestmark = pytest.mark.integration
MOE = "policy.model_path=tiny://qwen3_moe"
# GLM-4-MoE: a dense first layer, sigmoid routing with an expert bias (exported with the weights), a shared expert
GLM = "policy.model_path=tiny://glm4_moe"
LAYOUTS = {"ep1": [MOE, "policy.num_workers=1"],
           "ep2": [MOE, "policy.num_workers=2", "policy.expert_parallel_size=2"],
           "tp2-ep2": [MOE, "policy.num_workers=4", "policy.tensor_parallel_size=2", "policy.expert_parallel_size=2"],
           "glm4-ep1": [GLM, "policy.num_workers=1"],
           "glm4-ep2": [GLM, "policy.num_workers=2", "policy.expert_parallel_size=2"]}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def moe_cfg(request, make_cfg):
    cfg, _ = make_cfg(*LAYOUTS[request.param], "policy.micro_batch_size=4")
    return cfg


@pytest.fixture(scope="module")
def moe_dir(moe_cfg):
    return resolve_model_dir(moe_cfg)


@pytest.fixture(scope="module")
def moe_policy(model_workers, moe_cfg, moe_dir):
    return moe_cfg.policy, model_workers.start(moe_cfg, moe_dir)


@pytest.fixture(scope="module")
def input_ids():
    return torch.randint(0, 300, (8, 12), generator=torch.Generator().manual_seed(0))


def test_moe_logprobs_match_hf(moe_policy, moe_dir, input_ids):
    _, policy = moe_policy
    reference = _hf_logprobs(moe_dir, input_ids)
    logprobs = policy.logprobs(Batch({"input_ids": input_ids}))
    assert (logprobs - reference).abs().max().item() < TOLERANCE


def test_moe_export_returns_the_checkpoint_bit_exact(moe_policy, moe_dir):
    _, policy = moe_policy
    checkpoint = load_file(moe_dir / "model.safetensors")
    exported = policy.export_hf_weights()
    assert set(exported) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def _hf_nll_and_grad_norm(model_dir, input_ids, mask):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logprobs = torch.log_softmax(model(input_ids).logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    loss = -(logprobs * mask[:, 1:]).sum() / mask.sum()
    loss.backward()
    return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters()]).norm().item()


def test_moe_training_step_has_hf_loss_and_gradient_norm(moe_policy, moe_dir, input_ids):
    """Last for its layout: the step changes the weights the tests above read. The gradient norm
    is Megatron's optimizer's, 3e-5 (relative) from HF's for the dense tiny Qwen3 as well."""
    cfg, policy = moe_policy
    mask = torch.ones(input_ids.shape)
    mask[:, 0] = 0  # the first token has no logprob
    batch = Batch({"input_ids": input_ids, "loss_mask": mask})
    if cfg.tensor_parallel_size > 1:
        with pytest.raises(WorkerError, match="policy.tensor_parallel_size: an MoE model trains at TP > 1 only"):
            policy.train(batch, batch_totals(mask), NextTokenNLL())
        return
    metrics = policy.train(batch, batch_totals(mask), NextTokenNLL())
    loss, grad_norm = _hf_nll_and_grad_norm(moe_dir, input_ids, mask)
    assert metrics["loss"] == pytest.approx(loss, abs=TOLERANCE)
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
