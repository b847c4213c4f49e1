"""The host buffers a background checkpoint stages into (rlkit/workers/policy/dist_checkpoint.py):
allocated ahead of the first save, one per tensor out of one block, and taken by shape and dtype."""

from types import SimpleNamespace

import torch

from rlkit.workers.policy.dist_checkpoint import BackgroundSave, state_tensors


def _buckets(tensors: list[torch.Tensor]) -> list:
    """megatron-core's write buckets as the save plan hands them over: (path, key, (bytes, [(item, tensor)]))."""
    return [("file_0.distcp", "key", ([], [(f"item{i}", t) for i, t in enumerate(tensors)]))]


def _staged(save: BackgroundSave, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [buffer for _, buffer in save._stage(_buckets(tensors))[0][2][1]]


def test_staging_takes_the_buffers_reserved_ahead_by_shape_and_dtype():
    tensors = [torch.randn(10, 3), torch.arange(7, dtype=torch.int64), torch.randn(5).to(torch.bfloat16),
               torch.tensor(2.5)]
    save = BackgroundSave()
    save.reserve(tensors[:3])  # not the 0-d one
    save._reserving.join()
    reserved = [save.spare[(tuple(t.shape), t.dtype)][0].data_ptr() for t in tensors[:3]]
    copies = _staged(save, tensors)
    for tensor, copy in zip(tensors, copies):
        assert torch.equal(copy, tensor) and copy.dtype == tensor.dtype and copy.data_ptr() != tensor.data_ptr()
        # each its own storage: the writer serializes a tensor's whole storage
        assert copy.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    assert [c.data_ptr() for c in copies[:3]] == reserved
    assert reserved == sorted(reserved) and reserved[2] - reserved[0] == 128 + 64  # one block, 64-byte aligned
    assert not any(save.spare.values())
    # the next save reuses the same buffers, refreshed
    tensors[0].add_(1)
    again = _staged(save, tensors)
    assert [a.data_ptr() for a in again] == [c.data_ptr() for c in copies] and torch.equal(again[0], tensors[0])


def test_what_is_reserved_is_the_parameters_and_the_optimizer_state_once_each():
    model = torch.nn.Linear(4, 3)
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    expected = [*model.parameters(), *(t for s in adam.state.values() for t in s.values())]
    for optimizer in [SimpleNamespace(optimizer=adam),
                      SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])]:
        found = state_tensors([model], optimizer)  # the optimizer's params are the model's: once
        assert sorted(t.data_ptr() for t in found) == sorted(t.data_ptr() for t in expected)
