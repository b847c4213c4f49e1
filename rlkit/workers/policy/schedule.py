"""Megatron's pipeline schedules over rlkit's micro-batches: one model chunk per rank (no pipeline,
or 1F1B across pipeline ranks), or with virtual pipeline stages several chunks per rank, which
Megatron's interleaved schedule runs."""

from typing import Callable

import torch

from rlkit.data.batch import Batch


def min_micro_batches(pipeline_size: int, chunks: int) -> int:
    """The fewest micro-batches a step may have: the interleaved schedule needs one per pipeline rank."""
    return pipeline_size if chunks > 1 else 1


def run_schedule(chunks: list, parts: list[Batch], forward_step: Callable, pipeline_size: int,
                 forward_only: bool) -> list:
    """forward_step(data_iterator, chunk) over every micro-batch in parts, through every chunk of
    this rank; the outputs of the loss function forward_step returns (on the last stage)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    if len(chunks) == 1:
        data = iter(parts)
    else:
        # each chunk reads every micro-batch in turn
        data = [iter(parts) for _ in chunks]
        # micro-batches that go through one virtual stage before the next: the pipeline's depth, or
        # all of them where their number is no multiple of it (the schedule refuses a short last group)
        count = len(parts)
        get_model_config(chunks[0]).microbatch_group_size_per_vp_stage = \
            pipeline_size if count % pipeline_size == 0 else count
    # seq_length and micro_batch_size size the pipeline's messages; variable_seq_lengths (set at
    # build) makes stages exchange each micro-batch's shape instead
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=chunks, num_microbatches=len(parts),
        seq_length=max(p["input_ids"].shape[1] for p in parts), micro_batch_size=max(len(p) for p in parts),
        forward_only=forward_only)


def summed_on_host(outputs: list[dict]) -> dict[str, float]:
    """Each metric summed over the micro-batches' outputs (0-dim tensors, left on the device by the
    loss function), brought to the host in one copy: an .item() per micro-batch would make the
    host wait for the GPU at each one instead of queueing the next."""
    names = list(outputs[0])
    sums = torch.stack([torch.stack([o[k].double() for k in names]) for o in outputs]).sum(dim=0)
    return dict(zip(names, sums.tolist()))
