"""Batch container and right_pad."""

import pytest
import torch

from rlkit.data.batch import Batch, right_pad


def make_batch(n=6, seq=4):
    return Batch({
        "input_ids": torch.arange(n * seq).view(n, seq),
        "rewards": torch.arange(n, dtype=torch.float32) * 10,
    })


def rows(batch, key):
    return [batch[key][i].tolist() for i in range(len(batch))]


def test_basic_access():
    batch = make_batch()
    assert len(batch) == 6 and "rewards" in batch and "advantages" not in batch
    assert batch["rewards"].tolist() == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert len(Batch({})) == 0


def test_mismatched_leading_dims_raise():
    with pytest.raises(ValueError, match="disagree"):
        Batch({"input_ids": torch.zeros(3, 4), "rewards": torch.zeros(2)})
    with pytest.raises(ValueError, match="disagree"):
        make_batch().with_fields(advantages=torch.zeros(5))


def test_with_fields_adds_and_overrides_without_mutating():
    batch = make_batch()
    advantages = torch.ones(6)
    updated = batch.with_fields(advantages=advantages, rewards=torch.zeros(6))
    assert set(updated.tensors) == {"input_ids", "rewards", "advantages"}
    assert updated["rewards"].tolist() == [0.0] * 6 and updated["advantages"] is advantages
    assert set(batch.tensors) == {"input_ids", "rewards"} and batch["rewards"][1] == 10.0


def test_select():
    batch = make_batch()
    selected = batch.select("rewards")
    assert list(selected.tensors) == ["rewards"] and selected["rewards"] is batch["rewards"]
    with pytest.raises(KeyError, match="advantages"):
        batch.select("rewards", "advantages")


def test_slice():
    batch = make_batch()
    part = batch.slice(2, 5)
    assert len(part) == 3
    assert part["rewards"].tolist() == [20.0, 30.0, 40.0]
    assert rows(part, "input_ids") == rows(batch, "input_ids")[2:5]


@pytest.mark.parametrize("num_chunks", [1, 2, 3, 6])
def test_split_then_concat_round_trips(num_chunks):
    batch = make_batch()
    chunks = batch.split(num_chunks)
    assert len(chunks) == num_chunks
    size = 6 // num_chunks
    for k, chunk in enumerate(chunks):
        assert len(chunk) == size
        for i in range(size):
            assert chunk["input_ids"][i].tolist() == batch["input_ids"][k * size + i].tolist()
            assert chunk["rewards"][i].item() == batch["rewards"][k * size + i].item()
    joined = Batch.concat(chunks)
    assert set(joined.tensors) == set(batch.tensors)
    for key in batch.tensors:
        assert torch.equal(joined[key], batch[key])


@pytest.mark.parametrize("num_chunks", [4, 5, 7])
def test_uneven_split_raises(num_chunks):
    with pytest.raises(ValueError, match="equal chunks"):
        make_batch().split(num_chunks)


def test_concat_of_different_sizes():
    joined = Batch.concat([make_batch(2), make_batch(3)])
    assert len(joined) == 5
    assert joined["rewards"].tolist() == [0.0, 10.0, 0.0, 10.0, 20.0]


def test_right_pad():
    padded = right_pad([[1, 2, 3], [4], []], pad_id=0)
    assert padded.dtype == torch.long
    assert padded.tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]
    assert right_pad([[7], [8, 9]], pad_id=-1, length=4).tolist() == [[7, -1, -1, -1], [8, 9, -1, -1]]
