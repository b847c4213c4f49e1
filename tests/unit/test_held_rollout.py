"""The held rollout (rlkit/workers/policy/held_rollout.py), the training ranks' collaborator that
keeps the step's shard: driven here with plain tensors, a plain function as the model's head and a
plain reduce, without Ray, torch.distributed or a model."""

import torch

from rlkit.algorithms.advantages import reinforce_pp_advantages
from rlkit.algorithms.reinforce_pp import KLPenalizedReturns
from rlkit.data.batch import Batch
from rlkit.workers.policy.held_rollout import HeldRollout

ROWS, WIDTH = 4, 5


def shard(**extra: torch.Tensor) -> Batch:
    mask = torch.zeros(ROWS, WIDTH)
    mask[:, 2:] = 1.0  # two prompt tokens, three response tokens per row
    ids = torch.arange(ROWS * WIDTH).reshape(ROWS, WIDTH)
    return Batch({"input_ids": ids, "response_mask": mask, **extra})


def held(batch: Batch) -> HeldRollout:
    rollout = HeldRollout()
    rollout.hold(batch)
    return rollout


def logprobs_of(batch: Batch) -> torch.Tensor:
    """A model's head as a plain function of the rows: one logprob per token from its id."""
    return -batch["input_ids"].float() / 100


def test_forward_stores_the_head_outputs_and_compares_an_lm_head_with_the_sampler():
    sampler = logprobs_of(shard()) + 0.25  # 0.25 off on every token
    rollout = held(shard(generation_logprobs=sampler))
    sums = rollout.forward("old_logprobs", logprobs_of, head="lm", reference=False)
    torch.testing.assert_close(rollout.held["old_logprobs"], logprobs_of(shard()))
    assert sums["tokens"] == ROWS * 3 and abs(sums["abs_sum"] - 0.25 * ROWS * 3) < 1e-5
    assert abs(sums["abs_max"] - 0.25) < 1e-6


def test_a_value_head_stores_its_outputs_and_compares_nothing():
    rollout = held(shard(generation_logprobs=torch.zeros(ROWS, WIDTH)))
    assert rollout.forward("values", logprobs_of, head="value", reference=False) == {}
    assert "values" in rollout.held


def test_the_reference_gives_its_kl_to_the_held_logprobs():
    rollout = held(shard())
    rollout.forward("old_logprobs", logprobs_of, head="lm", reference=False)
    sums = rollout.forward("reference_logprobs", logprobs_of, head="lm", reference=True)
    assert sums == {"tokens": ROWS * 3, "kl_sum": 0.0}  # the same weights: no divergence
    assert "reference_logprobs" in rollout.held


def test_a_rank_without_head_outputs_stores_nothing():
    rollout = held(shard())
    assert rollout.forward("old_logprobs", lambda batch: None, head="lm", reference=False) is None
    assert "old_logprobs" not in rollout.held


def test_estimate_whitens_over_what_reduce_combines_and_answers_from_output_ranks_only():
    """reduce doubles every sum: as if a second data-parallel rank held the same rows, so the
    advantages are those of the two shards whitened together."""
    rewards = torch.tensor([1.0, 0.0, 3.0, 2.0])
    ops = []

    def two_identical_shards(tensor, op):
        ops.append(op)
        return tensor * 2 if op == "sum" else tensor

    rollout = held(shard())
    estimator = KLPenalizedReturns(kl_coef=0.0, kl_estimator="k3", gamma=1.0)
    assert rollout.estimate(rewards, estimator, two_identical_shards, is_output=False) is None
    whole = reinforce_pp_advantages(rewards.repeat(2), shard()["response_mask"].repeat(2, 1), None, 0.0)
    torch.testing.assert_close(rollout.held["advantages"], whole[:ROWS])
    assert {"sum", "min", "max"} <= set(ops)
    assert held(shard()).estimate(rewards, estimator, two_identical_shards, is_output=True) == {}


def test_estimate_skips_a_rank_without_the_estimators_inputs():
    """A pipeline stage before the last holds no logprobs: the KL-penalised estimator cannot run there."""
    rollout = held(shard())
    estimator = KLPenalizedReturns(kl_coef=0.1, kl_estimator="k3", gamma=1.0)
    assert rollout.estimate(torch.ones(ROWS), estimator, lambda tensor, op: tensor, is_output=True) is None
    assert "advantages" not in rollout.held


def test_extend_adds_fields_and_part_slices_the_held_rows():
    rollout = held(shard())
    rollout.extend(Batch({"advantages": torch.arange(ROWS, dtype=torch.float32)[:, None].expand(ROWS, WIDTH)}))
    second = rollout.part(1, 2)
    assert len(second) == 2 and torch.equal(second["input_ids"], shard()["input_ids"][2:])
    assert torch.equal(second["advantages"][:, 0], torch.tensor([2.0, 3.0]))
