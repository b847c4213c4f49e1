"""What a Megatron rank lets go of before a WarmPool (rlkit/cluster/warm_pool.py) keeps its
process idle for the next run: its process groups, and what would keep them or the model alive.
An idle worker holds no process group, whose gloo threads would keep waking, and no model memory."""

import gc
import sys

import torch
import torch.distributed as dist


def release_process(model: list, mpu, checkpoint_pending: bool) -> None:
    """Leave the process group and let the model go (the caller drops its own references, then
    collect()). model: the rank's chunks ([] before setup)."""
    _drop_kept_graphs(model)
    if dist.is_initialized():
        assert not checkpoint_pending, "a checkpoint is still being written (finish_checkpoint)"
        mpu.destroy_model_parallel()
        _drop_megatron_group_holders(mpu)
        dist.destroy_process_group()


def collect() -> None:
    """The model and optimizer reach their process groups through reference cycles: until a full
    collection frees them, each group's gloo threads stay (about 50 threads per run), and they
    cost an idle worker a tenth of a core after a few runs."""
    gc.collect()


def _drop_kept_graphs(chunks: list[torch.nn.Module]) -> None:
    """Drop the tensors with an autograd graph that modules (or their helpers) keep after a step:
    megatron-core's MoE token dispatcher keeps its last routing probs. Such a graph reaches the
    gradient hooks of the DDP wrapper, and so the whole model: a cycle through autograd's C++ nodes
    that no garbage collection frees, so a pooled worker would keep every MoE model it trained."""
    for chunk in chunks:
        for module in chunk.modules():
            helpers = [v for v in vars(module).values()
                       if hasattr(v, "__dict__") and not isinstance(v, (torch.nn.Module, torch.Tensor, type))]
            for holder in (module, *helpers):
                for name, value in list(vars(holder).items()):
                    if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                        setattr(holder, name, None)


def _drop_megatron_group_holders(mpu) -> None:
    """What still holds a run's process groups after megatron-core 0.16's destroy_model_parallel,
    each group keeping its gloo threads (and rank 0 its store's server thread) alive: two groups it
    does not reset, and the rotary embeddings' forward, an lru_cache keyed by the module, whose
    entries keep every run's rotary module (and its context-parallel group) until 32 are cached."""
    mpu._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
    mpu._INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
    for module, cls in [("megatron.core.models.common.embeddings.rotary_pos_embedding", "RotaryEmbedding"),
                        ("megatron.core.models.common.embeddings.yarn_rotary_pos_embedding", "YarnRotaryEmbedding")]:
        if module in sys.modules:  # imported only by the models that use it
            getattr(sys.modules[module], cls).forward.cache_clear()
