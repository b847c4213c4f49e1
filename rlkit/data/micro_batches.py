"""Micro-batches without padding FLOPs: each micro-batch is cut to its own longest row, and with a
token budget, rows of similar length go together.

A row's length is where its last trained-on token ends (the last 1 of its response_mask or
loss_mask): causal attention means nothing after that changes an output that is read, so cutting
there is exact. Rows of right-padded batches (rlkit/data/batch.py) end in padding; packed rows
(rlkit/data/packing.py) end at their last sequence.
"""

import torch

from rlkit.data.batch import Batch

LENGTH_MASKS = ("response_mask", "loss_mask")  # the [B, S] masks that say where a row's read outputs end


def row_lengths(batch: Batch) -> list[int]:
    """Tokens of each row up to its last masked token (at least 1); the full width if the batch
    has no mask field."""
    width = batch["input_ids"].shape[1]
    masks = [batch[k] for k in LENGTH_MASKS if k in batch]
    if not masks:
        return [width] * len(batch)
    used = torch.stack([m != 0 for m in masks]).any(dim=0)
    last = torch.where(used.any(dim=1), width - used.flip(1).int().argmax(dim=1), torch.ones(len(batch)).long())
    return last.tolist()


def plan_micro_batches(lengths: list[int], rows_per_micro_batch: int, max_tokens: int,
                       min_count: int = 1) -> list[list[int]]:
    """Row indices of each micro-batch. max_tokens == 0: runs of rows_per_micro_batch rows in order.
    Otherwise rows longest first, each micro-batch as many as fit in max_tokens once padded to its
    longest row (always at least one). Then, while there are fewer than min_count, the one of most
    rows is halved (Megatron's interleaved schedule needs a micro-batch per pipeline rank)."""
    if not max_tokens:
        plan = [list(range(i, min(i + rows_per_micro_batch, len(lengths))))
                for i in range(0, len(lengths), rows_per_micro_batch)]
    else:
        plan, current = [], []
        for row in sorted(range(len(lengths)), key=lambda r: -lengths[r]):  # stable: ties keep row order
            if current and (len(current) + 1) * lengths[current[0]] > max_tokens:
                plan.append(current)
                current = []
            current.append(row)
        plan = plan + [current] if current else plan
    if len(lengths) < min_count:
        raise ValueError(f"{len(lengths)} rows cannot make the {min_count} micro-batches the pipeline schedule needs")
    while len(plan) < min_count:
        largest = max(range(len(plan)), key=lambda i: len(plan[i]))
        rows = plan[largest]
        plan[largest:largest + 1] = [rows[:len(rows) // 2], rows[len(rows) // 2:]]
    return plan


def micro_batches(batch: Batch, rows_per_micro_batch: int, max_tokens: int,
                  min_count: int = 1) -> tuple[list[Batch], list[int]]:
    """The micro-batches of batch (plan_micro_batches), each cut to its longest row, and the row
    order they hold (row_order[i]: the batch row that comes i-th)."""
    lengths = row_lengths(batch)
    plan = plan_micro_batches(lengths, rows_per_micro_batch, max_tokens, min_count)
    parts = []
    for rows in plan:
        width = max(lengths[r] for r in rows)
        index = torch.tensor(rows)
        parts.append(Batch({k: v[index, :width] if v.dim() > 1 and v.shape[1] == batch["input_ids"].shape[1]
                            else v[index] for k, v in batch.tensors.items()}))
    return parts, [r for rows in plan for r in rows]


def restore_rows(outputs: list[torch.Tensor], row_order: list[int], width: int) -> torch.Tensor:
    """Inverse of micro_batches for per-token outputs: [B, width] in the batch's row order, 0 past
    each micro-batch's cut."""
    joined = torch.cat([torch.nn.functional.pad(o, (0, width - o.shape[1])) for o in outputs])
    restored = torch.empty_like(joined)
    restored[torch.tensor(row_order)] = joined
    return restored
