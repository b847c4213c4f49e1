"""Tokenized examples -> a Batch of rows, optionally packing several sequences per row.

A packed row holds sequences back to back; segment_ids tell them apart and position_ids restart
at 0 for each one, so with packed_attention_mask every token sees only its own sequence.
"""

import torch

from rlkit.data.batch import Batch


def pack_sequences(examples: list[tuple[list[int], list[int]]], max_length: int, pad_id: int,
                   pack: bool) -> Batch:
    """Batch of R rows x L tokens (L = longest row used, <= max_length) from (input_ids, loss_mask) pairs.

    Sequences longer than max_length keep their first max_length tokens. pack=False puts one sequence
    per row, in order; pack=True fills rows first-fit-decreasing (longest first, ties in input order),
    keeping each row's sequences in placement order. Fields, all [R, L]:
      input_ids     long   pad_id on padding
      loss_mask     float  the examples' masks, with each sequence's first token set to 0: logprobs are
                           token-aligned (see Batch), so that token would be predicted from the
                           previous sequence (or nothing)
      position_ids  long   0, 1, ... within each sequence; 0 on padding
      segment_ids   long   1, 2, ... for the sequences of a row; 0 on padding
    """
    if not examples:
        raise ValueError("pack_sequences got no examples; give at least one (input_ids, loss_mask) pair")
    if max_length < 1:
        raise ValueError(f"max_length is {max_length}; it must be at least 1")
    sequences = []
    for i, (ids, mask) in enumerate(examples):
        if len(ids) != len(mask) or not ids:
            raise ValueError(f"example {i} has {len(ids)} input_ids and {len(mask)} loss_mask entries; "
                             f"give each example a non-empty input_ids and a loss_mask of the same length")
        sequences.append((list(ids[:max_length]), [0] + list(mask[1:max_length])))
    rows = _first_fit_decreasing(sequences, max_length) if pack else [[s] for s in sequences]
    shape = (len(rows), max(sum(len(ids) for ids, _ in row) for row in rows))
    input_ids = torch.full(shape, pad_id, dtype=torch.long)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    position_ids = torch.zeros(shape, dtype=torch.long)
    segment_ids = torch.zeros(shape, dtype=torch.long)
    for r, row in enumerate(rows):
        start = 0
        for segment, (ids, mask) in enumerate(row, 1):
            span = slice(start, start + len(ids))
            input_ids[r, span] = torch.tensor(ids, dtype=torch.long)
            loss_mask[r, span] = torch.tensor(mask, dtype=torch.float32)
            position_ids[r, span] = torch.arange(len(ids))
            segment_ids[r, span] = segment
            start += len(ids)
    return Batch({"input_ids": input_ids, "loss_mask": loss_mask, "position_ids": position_ids,
                  "segment_ids": segment_ids})


def _first_fit_decreasing(sequences: list[tuple], capacity: int) -> list[list[tuple]]:
    """Rows of sequences, each row's total length <= capacity. The sort is stable: ties keep input order."""
    rows, free = [], []
    for sequence in sorted(sequences, key=lambda s: -len(s[0])):
        size = len(sequence[0])
        row = next((r for r, space in enumerate(free) if space >= size), None)
        if row is None:
            row = len(rows)
            rows.append([])
            free.append(capacity)
        rows[row].append(sequence)
        free[row] -= size
    return rows


def packed_attention_mask(segment_ids: torch.Tensor, query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """[R, 1, Q, L] bool from segment_ids [R, L], Megatron's convention (True = masked out): the
    rows of the queries at query_positions [Q] (a context-parallel rank's share), every position if None.

    Query i attends key j iff j <= i and both are in the same (non-padding) sequence. A padding query
    attends itself only, so no softmax row is fully masked (which would give NaN).
    """
    keys = torch.arange(segment_ids.shape[1], device=segment_ids.device)
    queries = keys if query_positions is None else query_positions.to(segment_ids.device)
    query_segments = segment_ids[:, queries, None]
    same_sequence = (query_segments == segment_ids[:, None, :]) & (query_segments != 0)
    causal = keys[None, :] <= queries[:, None]
    itself = keys[None, :] == queries[:, None]
    return ~((same_sequence & causal) | itself).unsqueeze(1)


def pad_rows(batch: Batch, multiple: int, pad_id: int) -> Batch:
    """Append empty rows (pad_id tokens, every other field 0: no loss, no segment) until the row
    count is a multiple of `multiple`, so the batch splits evenly over DP ranks and micro-batches."""
    missing = -len(batch) % multiple
    if missing == 0:
        return batch
    filler = {k: torch.full((missing, *v.shape[1:]), pad_id if k == "input_ids" else 0, dtype=v.dtype)
              for k, v in batch.tensors.items()}
    return Batch({k: torch.cat([v, filler[k]]) for k, v in batch.tensors.items()})
