"""The host buffers a background checkpoint stages into (rlkit/workers/policy/dist_checkpoint.py):
reserved ahead of the first save and carved out of that reservation, and the size reserved."""

from types import SimpleNamespace

import torch

from rlkit.workers.policy.dist_checkpoint import BackgroundSave, state_bytes


def _buckets(tensors: list[torch.Tensor]) -> list:
    """megatron-core's write buckets as the save plan hands them over: (path, key, (bytes, [(item, tensor)]))."""
    return [("file_0.distcp", "key", ([], [(f"item{i}", t) for i, t in enumerate(tensors)]))]


def test_staging_buffers_come_out_of_the_reserved_memory_while_it_lasts():
    tensors = [torch.randn(10, 3), torch.arange(7, dtype=torch.int64), torch.randn(5).to(torch.bfloat16),
               torch.tensor(2.5)]
    save = BackgroundSave()
    save.reserve(256)  # room for the first three (aligned), not the fourth
    staged = save._stage(_buckets(tensors))
    copies = [buffer for _, buffer in staged[0][2][1]]
    for tensor, copy in zip(tensors, copies):
        assert torch.equal(copy, tensor) and copy.dtype == tensor.dtype and copy.data_ptr() != tensor.data_ptr()
    arena = save.arena.untyped_storage().data_ptr()
    inside = [c.untyped_storage().data_ptr() == arena for c in copies]
    assert inside == [True, True, True, False]
    assert [c.data_ptr() % 64 for c in copies[:3]] == [0, 0, 0]
    # the next save reuses the same buffers, refreshed
    tensors[0].add_(1)
    again = [buffer for _, buffer in save._stage(_buckets(tensors))[0][2][1]]
    assert [a.data_ptr() for a in again] == [c.data_ptr() for c in copies] and torch.equal(again[0], tensors[0])


def test_the_reserved_size_is_the_parameters_and_the_optimizer_state_once_each():
    model = torch.nn.Linear(4, 3)
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    aligned = [64, 64]  # 12 and 3 float32 elements, each in a buffer at a 64-byte offset
    params = sum(aligned)  # the optimizer holds these same tensors
    moments = 2 * params
    steps = 64 * len(adam.state)  # one step counter per parameter
    assert state_bytes([model], SimpleNamespace(optimizer=adam)) == params + moments + steps
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])
    assert state_bytes([model], chained) == params + moments + steps
