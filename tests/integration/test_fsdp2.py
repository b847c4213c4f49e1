"""policy.backend=fsdp2 (rlkit/workers/policy/fsdp2.py) against Megatron on the same tiny Qwen2 and
Llama in fp32: the FSDP2 policy's two ranks, each holding half of every weight and its own half of
the rows, give the token logprobs of Megatron's one rank, and one SFT step gives the same loss,
gradient norm and logprobs after it. Its export, gathered from the shards, is the checkpoint bit
for bit under the checkpoint's names; its distributed checkpoint (torch.distributed.checkpoint)
loads into new workers, whose next step is the uninterrupted run's bit for bit.

Tolerance 1e-5 as in test_policy_parity.py (Megatron against transformers)."""

import pytest
import torch
from safetensors.torch import load_file

from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.data.batch import Batch, batch_totals
from rlkit.models.resolve import resolve_model_dir

pytestmark = pytest.mark.integration
TOLERANCE = 1e-5
BACKENDS = {"megatron": ["policy.num_workers=1"], "fsdp2": ["policy=fsdp2_tiny", "policy.num_workers=2"]}


def _rows(count: int, seed: int) -> Batch:
    """Rows of 11 tokens whose loss masks end at different lengths (from 4 to 11)."""
    g = torch.Generator().manual_seed(seed)
    ends = torch.randint(4, 12, (count, 1), generator=g)
    positions = torch.arange(11)
    return Batch({"input_ids": torch.randint(0, 300, (count, 11), generator=g),
                  "loss_mask": ((positions >= 1) & (positions < ends)).float()})


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def runs(request, model_workers, make_cfg, tmp_path_factory) -> dict[str, dict]:
    """Per backend: the export before training, logprobs of 8 rows, one step's metrics on them
    (micro-batches of 4) and the logprobs after it. FSDP2's also: a distributed checkpoint after
    that step, a second step, and that second step again on new workers that loaded the checkpoint."""
    rows, later, results = _rows(8, 0), _rows(8, 1), {}
    for name, overrides in BACKENDS.items():
        cfg, _ = make_cfg(*overrides, f"policy.model_path=tiny://{request.param}", "policy.micro_batch_size=4",
                          "policy.train_global_batch_size=8")
        model_dir = resolve_model_dir(cfg)
        policy = model_workers.start(cfg, model_dir)
        results[name] = {"model_dir": model_dir, "exported": policy.export_hf_weights(),
                         "logprobs": policy.logprobs(rows),
                         "step": policy.train(rows, batch_totals(rows["loss_mask"]), NextTokenNLL()),
                         "logprobs after": policy.logprobs(rows)}
    checkpoint = str(tmp_path_factory.mktemp("fsdp2_dist"))
    policy.save_checkpoint(checkpoint, "dist")
    policy.finish_checkpoint(wait=True)
    results["fsdp2"]["second step"] = _step_and_weights(policy, later)
    resumed = model_workers.start(cfg, model_dir)
    resumed.load_checkpoint(checkpoint, "dist")
    results["fsdp2"]["resumed second step"] = _step_and_weights(resumed, later)
    return results


def _step_and_weights(policy, rows: Batch) -> tuple[dict, dict]:
    return policy.train(rows, batch_totals(rows["loss_mask"]), NextTokenNLL()), policy.export_hf_weights()


def test_the_export_is_the_checkpoint_bit_for_bit(runs):
    checkpoint = load_file(runs["fsdp2"]["model_dir"] / "model.safetensors")
    assert runs["fsdp2"]["exported"].keys() == checkpoint.keys()
    for name, tensor in checkpoint.items():
        assert torch.equal(runs["fsdp2"]["exported"][name], tensor), name


def test_logprobs_match_megatron(runs):
    assert (runs["fsdp2"]["logprobs"] - runs["megatron"]["logprobs"]).abs().max().item() < TOLERANCE


def test_a_train_step_matches_megatron(runs):
    fsdp2, megatron = runs["fsdp2"], runs["megatron"]
    assert fsdp2["step"]["loss"] == pytest.approx(megatron["step"]["loss"], abs=TOLERANCE)
    assert fsdp2["step"]["grad_norm"] == pytest.approx(megatron["step"]["grad_norm"], rel=TOLERANCE)
    assert (fsdp2["logprobs after"] - megatron["logprobs after"]).abs().max().item() < TOLERANCE
    assert (fsdp2["logprobs after"] - fsdp2["logprobs"]).abs().max().item() > 100 * TOLERANCE  # the step moved them


def test_a_dist_checkpoint_resumes_the_next_step_exactly(runs):
    (step, weights), (resumed_step, resumed_weights) = runs["fsdp2"]["second step"], runs["fsdp2"]["resumed second step"]
    assert resumed_step == step  # weights and Adam's moments and step count all came back
    for name, weight in weights.items():
        assert torch.equal(resumed_weights[name], weight), name
