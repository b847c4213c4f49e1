"""Context parallelism (policy.context_parallel_size=2) gives what one rank holding whole rows
gives: logprobs of right-padded and of packed rows, and one SFT step (its loss, its gradient norm,
the weights after it). fp32, rows of 13 tokens and micro-batches cut to 13 and 9: lengths that
are not multiples of 2 x CP = 4, so the worker pads them.

Tolerance 1e-5 as in test_policy_parity.py (the CP ranks' attention sums keys in another order).
Adam's first step is blind to a gradient's scale, so the gradient norm checks that the CP ranks'
gradients add up to exactly one rank's: each rank computes the loss of the whole rows, from
logprobs gathered over the CP group."""

import pytest
import torch

from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.data.batch import Batch, batch_totals
from rlkit.data.packing import pack_sequences

pytestmark = pytest.mark.integration
TOLERANCE = 1e-5
LAYOUTS = {"cp1": ["policy.num_workers=1"], "cp2": ["policy.num_workers=2", "policy.context_parallel_size=2"]}


def _rows() -> Batch:
    """8 rows of 13 tokens; their loss masks end at different lengths, so the two micro-batches of 4
    are cut to 13 and 9 tokens."""
    g = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 300, (8, 13), generator=g)
    mask = torch.zeros(8, 13)
    for row, end in enumerate([13, 6, 9, 11, 9, 4, 7, 8]):
        mask[row, 1:end] = 1.0
    return Batch({"input_ids": input_ids, "loss_mask": mask})


def _packed_rows() -> Batch:
    g = torch.Generator().manual_seed(4)
    examples = [(torch.randint(0, 300, (n,), generator=g).tolist(), [1] * n) for n in [9, 4, 7, 3, 11, 5, 6, 2]]
    return pack_sequences(examples, max_length=15, pad_id=0, pack=True)


@pytest.fixture(scope="module")
def runs(model_workers, make_cfg, tiny_qwen2) -> dict[str, dict]:
    """Per layout: logprobs before, the step's metrics, the weights and logprobs after."""
    rows, packed = _rows(), _packed_rows()
    results = {}
    for name, layout in LAYOUTS.items():
        cfg, _ = make_cfg(*layout, "policy.micro_batch_size=4", "policy.train_global_batch_size=8")
        policy = model_workers.start(cfg, tiny_qwen2)
        results[name] = {"logprobs": policy.logprobs(rows), "packed": policy.logprobs(packed),
                         "step": policy.train(rows, batch_totals(rows["loss_mask"]), NextTokenNLL()),
                         "weights": policy.export_hf_weights(),
                         "logprobs after": policy.logprobs(rows)}
    return results


def test_logprobs_match_one_rank(runs):
    for field in ["logprobs", "packed"]:
        assert (runs["cp2"][field] - runs["cp1"][field]).abs().max().item() < TOLERANCE, field


def test_a_train_step_matches_one_rank(runs):
    one, two = runs["cp1"], runs["cp2"]
    assert two["step"]["loss"] == pytest.approx(one["step"]["loss"], abs=TOLERANCE)
    assert two["step"]["entropy"] == pytest.approx(one["step"]["entropy"], rel=TOLERANCE)
    assert two["step"]["grad_norm"] == pytest.approx(one["step"]["grad_norm"], rel=TOLERANCE)
    assert one["weights"].keys() == two["weights"].keys()
    for name, weight in one["weights"].items():
        assert (two["weights"][name] - weight).abs().max().item() < TOLERANCE, name
    assert (two["logprobs after"] - one["logprobs after"]).abs().max().item() < TOLERANCE
    assert (one["logprobs after"] - one["logprobs"]).abs().max().item() > 100 * TOLERANCE  # the step did move them
