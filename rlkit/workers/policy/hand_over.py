"""A rank's accelerator memory handed to a colocated engine while it generates, and taken back
(policy.offload): which storages go where, by kind, and the pinned bandwidth they are measured
against. The copies themselves are offload.HostOffload's."""

import torch
from torch.distributed.tensor import DTensor

from rlkit.workers.policy.offload import HostOffload, pinned_bandwidth


class MemoryHandOver:
    def __init__(self, offload: str, on_gpu: bool):
        """offload: policy.offload (all: weights and optimizer state to host memory, optimizer: the
        optimizer state only; both drop the gradient buffers; none: nothing)."""
        self.offload, self.on_gpu = offload, on_gpu
        self.host = HostOffload(pin=on_gpu)  # what sleep() moved off the GPU, in reused pinned buffers
        self.pinned_bandwidth = None  # GB/s each way, measured at the first sleep()

    def sleep(self, models: list, trained: list, optimizer) -> dict:
        """Free the GPU storages of `models` (every chunk with weights), of the gradient buffers of
        `trained` (the chunks DDP wraps) and of the optimizer's state. Returns bytes and seconds,
        and the pinned bandwidth they compare with; {} on CPU, with offload none, or while asleep."""
        if not self.on_gpu or self.offload == "none" or self.host.is_asleep:
            return {}
        kinds = resident_storages(models, trained, optimizer)
        keep = kinds["optimizer"] + (kinds["weights"] if self.offload == "all" else [])
        if self.pinned_bandwidth is None:
            self.pinned_bandwidth = pinned_bandwidth()
        freed = sum(s.nbytes() for s in keep + kinds["gradients"])
        copied, seconds = self.host.sleep(keep, kinds["gradients"])
        return {"freed_bytes": freed, "copied_bytes": copied, "seconds": seconds, "pinned": self.pinned_bandwidth}

    def wake(self) -> dict:
        """Undo sleep(). Returns bytes and seconds ({} if awake already)."""
        if not self.host.is_asleep:
            return {}
        copied, seconds = self.host.wake()
        return {"copied_bytes": copied, "seconds": seconds}


def resident_storages(models: list, trained: list, optimizer) -> dict[str, list]:
    """GPU storages by kind, each once: weights (of every chunk of `models`), optimizer (fp32 main
    weights and Adam state) and gradients (the DDP buffers of `trained`, which may be dropped)."""
    kinds, seen = {"weights": [], "optimizer": [], "gradients": []}, set()

    def add(tensor, kind):
        if isinstance(tensor, DTensor):  # a sharded tensor: this rank's shard
            tensor = tensor.to_local()
        storage = tensor.untyped_storage()
        if tensor.is_cuda and storage.data_ptr() not in seen and storage.nbytes() > 0:
            seen.add(storage.data_ptr())
            kinds[kind].append(storage)

    for chunk in models:
        for param in chunk.parameters():
            add(param.data, "weights")
    for chunk in trained:
        for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            add(buffer.grad_data, "gradients")
    if optimizer is not None:
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            opt = getattr(opt, "optimizer", opt)  # inside Megatron's wrapper, or a torch optimizer itself
            for group in opt.param_groups:
                for param in group["params"]:
                    add(param.data, "optimizer")
            for state in opt.state.values():
                for value in state.values():
                    if torch.is_tensor(value):
                        add(value, "optimizer")
    return kinds
