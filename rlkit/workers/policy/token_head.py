"""Token logprobs and entropy from vocab-parallel logits, without full-vocabulary fp32 copies.

Each tensor-parallel rank holds its shard [..., V_local] of the logits (rank r: vocab ids
[r * V_local, (r + 1) * V_local)). With z = logits / T, per token:

    logprob = z[target] - logsumexp(z)          entropy = logsumexp(z) - E_p[z],  p = softmax(z)

Two passes over the logits. Forward: each rank's row stats over its shard (top = max z,
sum exp(z - top), sum exp(z - top) x (z - top), z[target]), which _combine rescales to the group's
max z and sums over the group (a few floats per token, two collectives). Backward: p recomputed
from what forward keeps, the logits as given (bf16 on GPU) and a few floats per token:

    d logprob / dz = onehot(target) - p         d entropy / dz = -p * (z - E_p[z])

On CUDA logits the passes are Triton kernels (token_head_kernels.py), which read the logits once
per pass; elsewhere torch ops over chunks of tokens (ChunkedTorch), whose fp32 temporaries are a
chunk's (about CHUNK_BYTES each) rather than the whole micro-batch's logits.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

try:
    from rlkit.workers.policy.token_head_kernels import Kernels
except ImportError:  # no triton: the torch ops alone
    Kernels = None

CHUNK_BYTES = 256 << 20  # fp32 bytes of one chunk's [tokens, V_local] temporaries
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the kernels compute in fp32; fp64 stays fp64


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float, group=None, *,
                               entropy: bool = False, entropy_grad: bool = False,
                               chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) and (when entropy) the entropy of softmax(logits / temperature) over
    the whole vocabulary, both [...] in fp32 (fp64 for fp64 logits). logits: this rank's vocab shard
    [..., V_local]; targets: global token ids [...]; group: the tensor-parallel group (None: the
    whole vocabulary is here). The entropy carries a gradient only when entropy_grad. On CUDA
    (fp32, bf16, fp16 logits) Triton kernels run the passes; elsewhere torch ops over chunks of
    chunk_tokens tokens (default: about CHUNK_BYTES of fp32 per chunk)."""
    if Kernels is not None and logits.is_cuda and logits.dtype in KERNEL_DTYPES:
        backend = Kernels()
    else:
        chunk_tokens = max(1, CHUNK_BYTES // (4 * logits.shape[-1])) if chunk_tokens is None else chunk_tokens
        backend = ChunkedTorch(chunk_tokens)
    return token_head(backend, logits, targets, temperature, group, entropy=entropy, entropy_grad=entropy_grad)


def token_head(backend, logits: torch.Tensor, targets: torch.Tensor, temperature: float, group, *,
               entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """token_logprobs_and_entropy with the passes of the given backend (ChunkedTorch or Kernels)."""
    if entropy_grad and not entropy:
        raise ValueError("entropy_grad=True asks for the gradient of an entropy not computed (entropy=False)")
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    vocab_local = logits.shape[-1]
    logprobs, token_entropy = _TokenHead.apply(logits.reshape(-1, vocab_local), targets.reshape(-1), temperature,
                                               group, entropy, entropy_grad, backend)
    logprobs = logprobs.view(targets.shape)
    return logprobs, token_entropy.view(targets.shape) if entropy else None


def _all_reduce(values: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(values, op=op, group=group)
    return values


def _shard_targets(targets: torch.Tensor, vocab_local: int, group) -> torch.Tensor:
    """Each target's index in this rank's shard, -1 where the shard does not hold it."""
    local = targets - (dist.get_rank(group) * vocab_local if group is not None else 0)
    return torch.where((local >= 0) & (local < vocab_local), local, -1)


def _combine(stats: torch.Tensor, local_targets: torch.Tensor, group,
             with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """logsumexp, logprobs and (with_entropy) E_p[z] over the whole vocabulary from each rank's row
    stats [top, sum exp(z - top), sum exp(z - top) x (z - top), z[target]]: each rank's sums
    rescaled to the group's max z, then summed over the group."""
    top, total, weighted, target_z = stats
    group_top = _all_reduce(top.clone(), dist.ReduceOp.MAX, group)
    scale = (top - group_top).exp()
    sums = [total * scale, torch.where(local_targets >= 0, target_z - group_top, 0)]
    if with_entropy:  # z - group_top = (z - top) + (top - group_top)
        sums.append(scale * (weighted + (top - group_top) * total))
    sums = _all_reduce(torch.stack(sums), dist.ReduceOp.SUM, group)
    log_sum = sums[0].log()
    mean_z = group_top + sums[2] / sums[0] if with_entropy else None
    return group_top + log_sum, sums[1] - log_sum, mean_z


def _chunk_stats(logits: torch.Tensor, local_targets: torch.Tensor, temperature: float,
                 with_entropy: bool) -> torch.Tensor:
    """A chunk's row stats [4, tokens] (see _combine; the third 0 without with_entropy). The fp32
    temporaries (two of the chunk's size) end with the call."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True).div_(temperature)
    target_z = z.gather(1, local_targets.clamp(min=0)[:, None]).squeeze(1)  # masked in _combine where -1
    top = z.amax(dim=-1)
    shifted = z.sub_(top[:, None])  # <= 0: exp cannot overflow
    exp = shifted.exp()
    total = exp.sum(dim=-1)
    weighted = exp.mul_(shifted).sum(dim=-1) if with_entropy else torch.zeros_like(total)
    return torch.stack([top, total, weighted, target_z])


def _chunk_grad(logits, local_targets, logsumexp, mean_z, grad_logprobs, grad_entropy,
                temperature: float) -> torch.Tensor:
    """d loss / d logits of a chunk's tokens (fp32): p x coefficient / T, plus grad_logprobs / T at each
    target this shard holds. grad_logprobs or grad_entropy is None where the loss does not use it."""
    log_p = logits.to(logsumexp.dtype, copy=True).div_(temperature).sub_(logsumexp[:, None])
    p = log_p.exp()
    if grad_entropy is None:
        coefficient = -grad_logprobs[:, None]
    else:  # -grad_entropy x (z - E_p[z]), where z - E_p[z] = log p - (E_p[z] - logsumexp)
        coefficient = log_p.sub_((mean_z - logsumexp)[:, None]).mul_(-grad_entropy[:, None])
        if grad_logprobs is not None:
            coefficient.sub_(grad_logprobs[:, None])
    grad_z = p.mul_(coefficient)
    if grad_logprobs is not None:
        held = local_targets >= 0
        grad_z.scatter_add_(1, local_targets.clamp(min=0)[:, None], (grad_logprobs * held)[:, None])
    return grad_z.div_(temperature)


def _chunks(count: int, chunk_tokens: int):
    return (slice(start, start + chunk_tokens) for start in range(0, count, chunk_tokens))


@dataclass(frozen=True)
class ChunkedTorch:
    """The two passes in torch ops over chunks of chunk_tokens tokens (Kernels' interface)."""
    chunk_tokens: int

    def row_stats(self, logits: torch.Tensor, local_targets: torch.Tensor, temperature: float,
                  with_entropy: bool) -> torch.Tensor:
        """[4, N] row stats over this shard (see _combine), fp32 (fp64 for fp64 logits)."""
        return torch.cat([_chunk_stats(logits[rows], local_targets[rows], temperature, with_entropy)
                          for rows in _chunks(len(logits), self.chunk_tokens)], dim=1)

    def logits_grad(self, logits, local_targets, logsumexp, mean_z, grad_logprobs, grad_entropy,
                    temperature: float) -> torch.Tensor:
        """d loss / d logits [N, V_local] in the logits' dtype."""
        grad_logits = torch.empty_like(logits)
        for rows in _chunks(len(logits), self.chunk_tokens):
            per_token = [None if t is None else t[rows] for t in (mean_z, grad_logprobs, grad_entropy)]
            grad_logits[rows] = _chunk_grad(logits[rows], local_targets[rows], logsumexp[rows], *per_token,
                                            temperature)
        return grad_logits


class _TokenHead(torch.autograd.Function):
    """[N, V_local] logits, [N] targets -> [N] logprobs, [N] entropy (empty when not asked for)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, group, with_entropy, entropy_grad, backend):
        local_targets = _shard_targets(targets, logits.shape[1], group)
        stats = backend.row_stats(logits, local_targets, temperature, with_entropy)
        logsumexp, logprobs, mean_z = _combine(stats, local_targets, group, with_entropy)
        token_entropy = logsumexp - mean_z if with_entropy else logsumexp.new_empty(0)
        if not entropy_grad:
            ctx.mark_non_differentiable(token_entropy)
        ctx.set_materialize_grads(False)  # an output the loss does not use brings None, not zeros
        if ctx.needs_input_grad[0]:  # false under torch.no_grad: nothing is kept
            ctx.save_for_backward(logits, local_targets, logsumexp, mean_z if entropy_grad else None)
        ctx.temperature, ctx.backend = temperature, backend
        return logprobs, token_entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        no_grads = (None,) * 6  # for the arguments after the logits
        if grad_logprobs is None and grad_entropy is None:
            return None, *no_grads
        logits, local_targets, logsumexp, mean_z = ctx.saved_tensors
        return ctx.backend.logits_grad(logits, local_targets, logsumexp, mean_z, grad_logprobs, grad_entropy,
                                       ctx.temperature), *no_grads
