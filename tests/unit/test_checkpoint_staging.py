"""The host buffers a background checkpoint stages into (rlkit/workers/policy/dist_checkpoint.py):
cut out of one block reserved ahead of the first save, each a storage of its own."""

import io
from types import SimpleNamespace

import torch

from rlkit.workers.policy.dist_checkpoint import BackgroundSave, state_bytes


def _buckets(tensors: list[torch.Tensor]) -> list:
    """megatron-core's write buckets as the save plan hands them over: (path, key, (bytes, [(item, tensor)]))."""
    return [("file_0.distcp", "key", ([], [(f"item{i}", t) for i, t in enumerate(tensors)]))]


def _staged(save: BackgroundSave, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [buffer for _, buffer in save._stage(_buckets(tensors))[0][2][1]]


def test_staging_cuts_its_buffers_out_of_the_block_reserved_ahead():
    tensors = [torch.randn(10, 3), torch.arange(7, dtype=torch.int64), torch.randn(5).to(torch.bfloat16),
               torch.tensor(2.5), torch.randn(40)]
    save = BackgroundSave()
    save.reserve(120 + 56 + 10 + 4 + 3 * 64)  # room for the first four, 64-byte aligned, not the fifth
    copies = _staged(save, tensors)
    block = save.block.data_ptr()
    assert [c.data_ptr() - block for c in copies[:4]] == [0, 128, 192, 256]
    assert not block <= copies[4].data_ptr() < block + save.block.numel()  # no room left: allocated apart
    for tensor, copy in zip(tensors, copies):
        assert torch.equal(copy, tensor) and copy.dtype == tensor.dtype and copy.data_ptr() != tensor.data_ptr()
        # each its own storage: the writer serializes a tensor's whole storage, not the block
        assert copy.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
        written = io.BytesIO()
        torch.save(copy, written)
        assert torch.equal(torch.load(io.BytesIO(written.getvalue())), tensor)
        assert len(written.getvalue()) < tensor.numel() * tensor.element_size() + 2048
    # the buffers keep the block's memory alive without the block; the next save reuses them, refreshed
    save.block = None
    tensors[0].add_(1)
    again = _staged(save, tensors)
    assert [a.data_ptr() for a in again] == [c.data_ptr() for c in copies] and torch.equal(again[0], tensors[0])


def test_what_is_reserved_is_the_parameters_and_the_optimizer_state_once_each():
    model = torch.nn.Linear(4, 3)  # 12 + 3 floats: 48 and 12 bytes, 64 each aligned
    adam = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    adam.step()
    # parameters, Adam's two moments (64 bytes a tensor) and its step counters (4-byte scalars)
    expected = 3 * 2 * 64 + 2 * 64
    for optimizer in [SimpleNamespace(optimizer=adam),
                      SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=adam)])]:
        assert state_bytes([model], optimizer) == expected  # the optimizer's params are the model's: once
