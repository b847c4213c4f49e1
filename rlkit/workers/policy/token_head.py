"""Token logprobs and entropy from vocab-parallel logits, without full-vocabulary fp32 copies.

Each tensor-parallel rank holds its shard [..., V_local] of the logits (rank r: vocab ids
[r * V_local, (r + 1) * V_local)). With z = logits / T, per token:

    logprob = z[target] - logsumexp(z)          entropy = logsumexp(z) - E_p[z],  p = softmax(z)

computed over chunks of tokens, so the fp32 temporaries are a chunk's (about CHUNK_BYTES each)
rather than the whole micro-batch's logits, and never the whole vocabulary on one rank. Backward
keeps only the logits as given (bf16 on GPU) and a few floats per token, and recomputes p per chunk:

    d logprob / dz = onehot(target) - p         d entropy / dz = -p * (z - E_p[z])
"""

import torch
import torch.distributed as dist

CHUNK_BYTES = 256 << 20  # fp32 bytes of one chunk's [tokens, V_local] temporaries


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float, group=None, *,
                               entropy: bool = False, entropy_grad: bool = False,
                               chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log p(target) and (when entropy) the entropy of softmax(logits / temperature) over
    the whole vocabulary, both [...] in fp32 (fp64 for fp64 logits). logits: this rank's vocab shard
    [..., V_local]; targets: global token ids [...]; group: the tensor-parallel group (None: the
    whole vocabulary is here). The entropy carries a gradient only when entropy_grad; chunk_tokens
    (tokens per chunk) defaults to about CHUNK_BYTES of fp32 per chunk."""
    if entropy_grad and not entropy:
        raise ValueError("entropy_grad=True asks for the gradient of an entropy not computed (entropy=False)")
    vocab_local = logits.shape[-1]
    if chunk_tokens is None:
        chunk_tokens = max(1, CHUNK_BYTES // (4 * vocab_local))
    if group is not None and dist.get_world_size(group) == 1:
        group = None
    logprobs, token_entropy = _TokenHead.apply(logits.reshape(-1, vocab_local), targets.reshape(-1), temperature,
                                               group, entropy, entropy_grad, chunk_tokens)
    logprobs = logprobs.view(targets.shape)
    return logprobs, token_entropy.view(targets.shape) if entropy else None


def _all_reduce(values: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(values, op=op, group=group)
    return values


def _shard_targets(targets: torch.Tensor, vocab_local: int, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's index in this rank's shard (0 where the shard does not hold it) and whether it does."""
    local = targets - (dist.get_rank(group) * vocab_local if group is not None else 0)
    held = (local >= 0) & (local < vocab_local)
    return torch.where(held, local, 0), held


def _chunk_sums(logits: torch.Tensor, local_targets: torch.Tensor, held: torch.Tensor, temperature: float, group,
                with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """For a chunk's tokens, over the whole vocabulary: top = max z, and stacked [sum exp(z - top),
    z[target] - top, and with_entropy: sum exp(z - top) x (z - top)]. Two collectives; the fp32
    temporaries (two of the chunk's size) end with the call."""
    z = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True).div_(temperature)
    top = _all_reduce(z.amax(dim=-1), dist.ReduceOp.MAX, group)
    shifted = z.sub_(top[:, None])  # <= 0: exp cannot overflow
    exp = shifted.exp()
    sums = [exp.sum(dim=-1), torch.where(held, shifted.gather(1, local_targets[:, None]).squeeze(1), 0)]
    if with_entropy:
        sums.append(exp.mul_(shifted).sum(dim=-1))
    return top, _all_reduce(torch.stack(sums), dist.ReduceOp.SUM, group)


def _chunk_grad(logits, local_targets, held, logsumexp, mean_z, grad_logprobs, grad_entropy,
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
        grad_z.scatter_add_(1, local_targets[:, None], (grad_logprobs * held)[:, None])
    return grad_z.div_(temperature)


def _chunks(count: int, chunk_tokens: int):
    return (slice(start, start + chunk_tokens) for start in range(0, count, chunk_tokens))


class _TokenHead(torch.autograd.Function):
    """[N, V_local] logits, [N] targets -> [N] logprobs, [N] entropy (empty when not asked for)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, group, with_entropy, entropy_grad, chunk_tokens):
        local_targets, held = _shard_targets(targets, logits.shape[1], group)
        logsumexp = torch.empty(len(targets), dtype=torch.promote_types(logits.dtype, torch.float32),
                                device=logits.device)
        logprobs, mean_z = torch.empty_like(logsumexp), torch.empty_like(logsumexp)
        for rows in _chunks(len(targets), chunk_tokens):
            top, sums = _chunk_sums(logits[rows], local_targets[rows], held[rows], temperature, group, with_entropy)
            log_sum = sums[0].log()
            logsumexp[rows] = top + log_sum
            logprobs[rows] = sums[1] - log_sum
            if with_entropy:
                mean_z[rows] = top + sums[2] / sums[0]
        token_entropy = logsumexp - mean_z if with_entropy else logsumexp.new_empty(0)
        if not entropy_grad:
            ctx.mark_non_differentiable(token_entropy)
        ctx.set_materialize_grads(False)  # an output the loss does not use brings None, not zeros
        if ctx.needs_input_grad[0]:  # false under torch.no_grad: nothing is kept
            ctx.save_for_backward(logits, local_targets, held, logsumexp, mean_z if entropy_grad else None)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        return logprobs, token_entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        no_grads = (None,) * 6  # for the arguments after the logits
        if grad_logprobs is None and grad_entropy is None:
            return None, *no_grads
        logits, local_targets, held, logsumexp, mean_z = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for rows in _chunks(len(logits), ctx.chunk_tokens):
            per_token = [None if t is None else t[rows] for t in (mean_z, grad_logprobs, grad_entropy)]
            grad_logits[rows] = _chunk_grad(logits[rows], local_targets[rows], held[rows], logsumexp[rows], *per_token,
                                            ctx.temperature)
        return grad_logits, *no_grads
