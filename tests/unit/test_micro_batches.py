"""Micro-batches cut to their longest row, and a token budget that groups rows of like length."""

import pytest
import torch

from rlkit.data.batch import Batch
from rlkit.data.micro_batches import micro_batches, plan_micro_batches, restore_rows, row_lengths


def rows(lengths: list[int], width: int, mask="response_mask") -> Batch:
    """Right-padded rows whose masks end at `lengths` (a 2-token prompt, then the response)."""
    ids = torch.arange(len(lengths) * width).reshape(len(lengths), width)
    m = torch.zeros(len(lengths), width)
    for r, n in enumerate(lengths):
        m[r, 2:n] = 1.0
    return Batch({"input_ids": ids, mask: m, "advantages": torch.arange(len(lengths)).float()})


def test_a_row_ends_at_its_last_masked_token():
    assert row_lengths(rows([5, 9, 3], 12)) == [5, 9, 3]
    assert row_lengths(rows([5, 9], 12, mask="loss_mask")) == [5, 9]
    assert row_lengths(Batch({"input_ids": torch.zeros(2, 7).long()})) == [7, 7]  # no mask: the full width
    empty = Batch({"input_ids": torch.zeros(1, 7).long(), "response_mask": torch.zeros(1, 7)})
    assert row_lengths(empty) == [1]


def test_without_a_budget_micro_batches_keep_the_row_order():
    assert plan_micro_batches([5, 9, 3, 4, 8], 2, 0) == [[0, 1], [2, 3], [4]]


def test_a_token_budget_groups_rows_longest_first_and_fits_each_group():
    lengths = [5, 9, 3, 4, 8, 9]
    plan = plan_micro_batches(lengths, 2, max_tokens=20)
    assert plan == [[1, 5], [4, 0], [3, 2]]  # 2 x 9, 2 x 8, 2 x 4 (3 x 8 = 24 would not fit)
    assert sorted(r for group in plan for r in group) == list(range(len(lengths)))
    assert all(len(g) * max(lengths[r] for r in g) <= 20 for g in plan)
    assert plan_micro_batches([30, 5], 2, max_tokens=20) == [[0], [1]]  # a row over the budget goes alone


def test_a_minimum_count_halves_the_largest_micro_batches_until_it_is_met():
    """Megatron's interleaved schedule (virtual pipeline stages) needs a micro-batch per pipeline rank."""
    assert plan_micro_batches([5] * 6, 8, 0, min_count=2) == [[0, 1, 2], [3, 4, 5]]
    assert plan_micro_batches([5] * 6, 4, 0, min_count=3) == [[0, 1], [2, 3], [4, 5]]
    assert plan_micro_batches([5, 9, 3], 8, max_tokens=100, min_count=3) == [[1], [0], [2]]
    assert plan_micro_batches([5] * 6, 2, 0, min_count=2) == [[0, 1], [2, 3], [4, 5]]  # already enough
    with pytest.raises(ValueError, match="3 rows cannot make the 4 micro-batches"):
        plan_micro_batches([5, 9, 3], 8, 0, min_count=4)


def test_micro_batches_are_cut_and_outputs_come_back_in_row_order():
    batch = rows([5, 9, 3, 4], 12)
    parts, order = micro_batches(batch, 2, max_tokens=10)
    assert [p["input_ids"].shape[1] for p in parts] == [9, 5, 3]
    assert order == [1, 0, 3, 2]
    for part, picked in zip(parts, [[1], [0, 3], [2]]):
        assert torch.equal(part["input_ids"], batch["input_ids"][picked, :part["input_ids"].shape[1]])
        assert torch.equal(part["advantages"], batch["advantages"][picked])  # per-sample fields are not cut
    restored = restore_rows([p["input_ids"] for p in parts], order, 12)
    lengths = row_lengths(batch)
    for r, n in enumerate(lengths):
        assert torch.equal(restored[r, :n], batch["input_ids"][r, :n])


def test_micro_batch_metrics_are_summed_in_double_and_named():
    from rlkit.workers.policy.schedule import summed_on_host

    outputs = [{"loss": torch.tensor(0.25), "tokens": torch.tensor(3)},
               {"loss": torch.tensor(1e-9, dtype=torch.float32), "tokens": torch.tensor(4)}]
    assert summed_on_host(outputs) == {"loss": 0.25 + float(torch.tensor(1e-9)), "tokens": 7.0}
