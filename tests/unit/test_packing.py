"""pack_sequences (first-fit-decreasing packing, token alignment) and packed_attention_mask
against an explicit loop reference."""

import random

import pytest
import torch

from rlkit.data.packing import pack_sequences, packed_attention_mask

PAD = 0


def make_examples(lengths: list[int], seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Distinct token ids per example (so each can be found again); mask 1 on the second half."""
    rng = random.Random(seed)
    examples, next_id = [], 1
    for n in lengths:
        ids = list(range(next_id, next_id + n))
        next_id += n
        examples.append((ids, [int(t >= n // 2) for t in range(n)] if rng.random() < 0.8 else [1] * n))
    return examples


def sequences_of(batch) -> list[tuple[list[int], list[float], list[int]]]:
    """(input_ids, loss_mask, position_ids) of every sequence in every row, read back via segment_ids."""
    out = []
    for r in range(len(batch)):
        segments = batch["segment_ids"][r]
        for s in segments.unique().tolist():
            if s:
                where = segments == s
                out.append((batch["input_ids"][r][where].tolist(), batch["loss_mask"][r][where].tolist(),
                            batch["position_ids"][r][where].tolist()))
    return out


def expected(example, max_length):
    ids, mask = example[0][:max_length], example[1][:max_length]
    return ids, [0.0] + [float(m) for m in mask[1:]]


@pytest.mark.parametrize("pack", [False, True])
def test_every_example_appears_once_aligned_and_truncated(pack):
    examples = make_examples([5, 12, 3, 9, 1, 7, 4, 4, 2, 11])
    max_length = 10
    batch = pack_sequences(examples, max_length=max_length, pad_id=PAD, pack=pack)
    found = sequences_of(batch)
    assert sorted((ids, mask) for ids, mask, _ in found) == sorted(expected(e, max_length) for e in examples)
    for ids, mask, positions in found:
        assert positions == list(range(len(ids)))  # restart at 0 for each sequence
        assert mask[0] == 0.0  # predicted from the previous sequence, never trained on
    assert batch["input_ids"].shape[1] <= max_length
    assert batch["input_ids"].dtype == batch["position_ids"].dtype == batch["segment_ids"].dtype == torch.long
    assert batch["loss_mask"].dtype == torch.float32


def test_unpacked_is_one_sequence_per_row_in_order():
    examples = make_examples([3, 6, 2])
    batch = pack_sequences(examples, max_length=5, pad_id=PAD, pack=False)
    assert batch["input_ids"].tolist() == [[1, 2, 3, PAD, PAD], [4, 5, 6, 7, 8], [10, 11, PAD, PAD, PAD]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4], [0, 1, 0, 0, 0]]


def test_first_fit_decreasing_by_hand():
    # lengths 3, 6, 2, 5, 4 into rows of 8: sorted 6, 5, 4, 3, 2 -> [6, 2], [5, 3], [4]
    examples = [([i] * n, [1] * n) for i, n in enumerate([3, 6, 2, 5, 4], start=1)]
    batch = pack_sequences(examples, max_length=8, pad_id=PAD, pack=True)
    assert batch["input_ids"].tolist() == [[2, 2, 2, 2, 2, 2, 3, 3], [4, 4, 4, 4, 4, 1, 1, 1],
                                           [5, 5, 5, 5, 0, 0, 0, 0]]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 1, 2, 2, 2],
                                             [1, 1, 1, 1, 0, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 0, 1, 2],
                                              [0, 1, 2, 3, 0, 0, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0, 1], [0, 1, 1, 1, 1, 0, 1, 1],
                                           [0, 1, 1, 1, 0, 0, 0, 0]]


def test_row_length_is_the_longest_row_used():
    batch = pack_sequences(make_examples([2, 3]), max_length=64, pad_id=PAD, pack=True)
    assert batch["input_ids"].shape == (1, 5)
    assert pack_sequences(make_examples([2, 3]), max_length=64, pad_id=PAD, pack=False)["input_ids"].shape == (2, 3)


def test_packing_is_deterministic_and_fills_rows():
    examples = make_examples([random.Random(1).randint(1, 30) for _ in range(200)])
    first = pack_sequences(examples, max_length=32, pad_id=PAD, pack=True)
    second = pack_sequences(examples, max_length=32, pad_id=PAD, pack=True)
    assert all(torch.equal(first[k], second[k]) for k in first.tensors)
    total = sum(min(len(ids), 32) for ids, _ in examples)
    assert len(first) < len(examples) and len(first) * 32 < 1.5 * total


@pytest.mark.parametrize("examples, message", [
    ([], "no examples"),
    ([([1, 2], [1])], "example 0 has 2 input_ids and 1 loss_mask"),
    ([([1], [1]), ([], [])], "example 1 has 0 input_ids"),
])
def test_bad_examples_raise(examples, message):
    with pytest.raises(ValueError, match=message):
        pack_sequences(examples, max_length=4, pad_id=PAD, pack=True)


def reference_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    rows, length = segment_ids.shape
    mask = torch.ones(rows, 1, length, length, dtype=torch.bool)
    for r in range(rows):
        for i in range(length):
            for j in range(length):
                same = segment_ids[r, i] == segment_ids[r, j] != 0
                if (j <= i and same) or i == j:
                    mask[r, 0, i, j] = False
    return mask


def test_attention_mask_matches_loop_reference():
    examples = make_examples([5, 12, 3, 9, 1, 7, 4, 4, 2, 11])
    segment_ids = pack_sequences(examples, max_length=16, pad_id=PAD, pack=True)["segment_ids"]
    assert (segment_ids == 0).any()  # padding is exercised
    mask = packed_attention_mask(segment_ids)
    assert mask.shape == (len(segment_ids), 1, 16, 16) and mask.dtype == torch.bool
    assert torch.equal(mask, reference_mask(segment_ids))
    assert (~mask).any(dim=-1).all()  # every query row attends something: no NaN softmax


def test_attention_mask_by_hand():
    mask = packed_attention_mask(torch.tensor([[1, 1, 2, 0]]))
    # True = masked out; token 2 starts a new sequence, the pad attends only itself
    assert mask[0, 0].int().tolist() == [[0, 1, 1, 1],
                                         [0, 0, 1, 1],
                                         [1, 1, 0, 1],
                                         [1, 1, 1, 0]]
