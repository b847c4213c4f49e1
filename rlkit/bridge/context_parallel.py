"""Context parallelism without TransformerEngine: each of CP ranks holds a share of every row's
tokens, and attention gathers the keys and values it needs.

The split is Megatron's load-balanced one: a row padded to a multiple of 2 x CP is cut into 2 x CP
equal chunks, and rank r holds chunks r and 2 x CP - 1 - r, so that every rank's queries see as
many causal keys as every other's. megatron-core 0.16.1's RotaryEmbedding assumes this split
(get_pos_emb_on_this_cp_rank): it gives rank r the rotary angles of exactly these positions.
With one rank (CP=1) a row is neither padded nor reordered: every function here is the identity.
"""

import torch
import torch.distributed as dist


def padded_length(length: int, cp_size: int) -> int:
    """The least multiple of 2 x cp_size that holds length tokens (length itself at CP=1)."""
    return length if cp_size == 1 else length + -length % (2 * cp_size)


def positions_on_rank(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Global positions of the tokens rank cp_rank holds of a row of `length` tokens (a multiple of
    2 x cp_size), in the order it holds them: [length / cp_size] long."""
    if cp_size == 1:
        return torch.arange(length)
    chunk = length // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (cp_rank, 2 * cp_size - 1 - cp_rank)])


def rank_major_positions(length: int, cp_size: int) -> torch.Tensor:
    """The global position of each token in the concatenation of every rank's share, rank 0 first
    (what an all-gather returns): [length] long, a permutation."""
    return torch.cat([positions_on_rank(length, cp_size, r) for r in range(cp_size)])


def share_of_rank(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """Rank cp_rank's share of x along dim, x first padded with zeros there to padded_length."""
    length = padded_length(x.shape[dim], cp_size)
    padding = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, length - x.shape[dim]]
    padded = torch.nn.functional.pad(x, padding)
    return padded.index_select(dim, positions_on_rank(length, cp_size, cp_rank).to(x.device))


class _GatherSequence(torch.autograd.Function):
    """All ranks' shares along dim 0, back in sequence order. Backward: sum_grads=True when each
    rank's consumers differ (attention's keys and values: a reduce-scatter of their gradients);
    False when every rank computes the same function of the whole (the loss over gathered
    logprobs: each rank keeps its own share of the identical gradient)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, sum_grads: bool):
        cp_size = group.size()
        gathered = local.new_empty((local.shape[0] * cp_size, *local.shape[1:]))
        dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
        positions = rank_major_positions(len(gathered), cp_size).to(local.device)
        ctx.group, ctx.sum_grads, ctx.positions = group, sum_grads, positions
        return torch.empty_like(gathered).index_copy_(0, positions, gathered)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.index_select(0, ctx.positions)  # rank-major, as gathered
        if not ctx.sum_grads:
            share = len(grad) // ctx.group.size()
            return grad[ctx.group.rank() * share:(ctx.group.rank() + 1) * share], None, None
        local = grad.new_empty((len(grad) // ctx.group.size(), *grad.shape[1:]))
        dist.reduce_scatter_tensor(local, grad.contiguous(), group=ctx.group)
        return local, None, None


def gather_sequence(local: torch.Tensor, group, sum_grads: bool, dim: int = 0) -> torch.Tensor:
    """Every rank's share of a sequence (share_of_rank) along dim, in sequence order, as one tensor;
    differentiable (see _GatherSequence for sum_grads). The identity for a group of one."""
    if group.size() == 1:
        return local
    return _GatherSequence.apply(local.movedim(dim, 0), group, sum_grads).movedim(0, dim)
