"""token_head.py's two passes over a rank's vocab-parallel logits [N, V_local] as Triton kernels:
one program per token row, looping over the row's vocabulary in blocks, so the forward reads the
logits once and the backward reads them once and writes the gradient once (the chunked torch ops
make several fp32 round trips of each chunk through memory). With z = logits / T:

    forward, per row, over this shard: top = max z, sum exp(z - top), sum exp(z - top) x (z - top)
        (an online max: the sums are rescaled when an entry raises top) and z[target]
    backward, per row: p = exp(z - logsumexp),
        d loss / dz = g_logprob x (onehot(target) - p) - g_entropy x p x (z - E_p[z])

Offsets are int64 (N x V_local can pass 2^31); the last block of a row is masked.
"""

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK = 4096  # vocabulary entries a program reads at once, at most
NUM_WARPS = 8


@triton.jit
def _row_stats_kernel(logits_ptr, row_stride, local_targets_ptr, stats_ptr, rows, inv_temperature,
                      VOCAB: tl.constexpr, WITH_ENTROPY: tl.constexpr, BLOCK: tl.constexpr):
    """stats[:, row] = [top, sum exp(z - top), sum exp(z - top) x (z - top), z[target]] over this
    shard's z (the third only WITH_ENTROPY; the fourth 0 where the target is not here: -1).

    Each lane of the block keeps its own top and sums over the columns it reads, merged once after
    the loop: no reduction (and barrier) per block, and one exp per entry, exp(-|z - top|), which is
    the entry's term where z <= top and the rescale of the sums where z raises top."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    # lanes start at a z of the row, so every rescale multiplies finite numbers (never -inf x 0)
    top = tl.zeros([BLOCK], dtype=tl.float32) + tl.load(row_ptr).to(tl.float32) * inv_temperature
    total = tl.zeros([BLOCK], dtype=tl.float32)
    weighted = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, VOCAB, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < VOCAB
        z = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32) * inv_temperature
        raises = z > top
        exp = tl.exp(-tl.abs(z - top))
        if WITH_ENTROPY:  # where z raises top: sum exp(x - z) x (x - z) = exp x (weighted + (top - z) x total)
            raised = exp * (weighted + (top - z) * total)
            weighted = tl.where(in_row, tl.where(raises, raised, weighted + exp * (z - top)), weighted)
        total = tl.where(in_row, tl.where(raises, total * exp + 1.0, total + exp), total)
        top = tl.where(in_row & raises, z, top)
    row_top = tl.max(top, axis=0)
    scale = tl.exp(top - row_top)
    tl.store(stats_ptr + row, row_top)
    tl.store(stats_ptr + rows + row, tl.sum(scale * total, axis=0))
    if WITH_ENTROPY:
        tl.store(stats_ptr + 2 * rows + row, tl.sum(scale * (weighted + (top - row_top) * total), axis=0))
    target = tl.load(local_targets_ptr + row)
    target_z = tl.load(row_ptr + target, mask=target >= 0, other=0.0).to(tl.float32) * inv_temperature
    tl.store(stats_ptr + 3 * rows + row, target_z)


@triton.jit
def _logits_grad_kernel(logits_ptr, row_stride, grad_ptr, local_targets_ptr, logsumexp_ptr, mean_z_ptr,
                        grad_logprobs_ptr, grad_entropy_ptr, inv_temperature,
                        VOCAB: tl.constexpr, WITH_LOGPROBS: tl.constexpr, WITH_ENTROPY: tl.constexpr,
                        BLOCK: tl.constexpr):
    """grad[row] = (g_logprob x (onehot(target) - p) - g_entropy x p x (z - E_p[z])) / T in the
    gradient's dtype, each term only when its gradient is given (WITH_*)."""
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * row_stride
    grad_row_ptr = grad_ptr + row * VOCAB
    logsumexp = tl.load(logsumexp_ptr + row)
    if WITH_LOGPROBS:
        target = tl.load(local_targets_ptr + row)  # -1 (never a column) where this shard does not hold it
        grad_logprob = tl.load(grad_logprobs_ptr + row)
    if WITH_ENTROPY:
        mean_z = tl.load(mean_z_ptr + row)
        grad_entropy = tl.load(grad_entropy_ptr + row)
    for start in range(0, VOCAB, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < VOCAB
        z = tl.load(row_ptr + cols, mask=in_row, other=0.0).to(tl.float32) * inv_temperature
        p = tl.exp(z - logsumexp)
        grad = tl.zeros([BLOCK], dtype=tl.float32)
        if WITH_LOGPROBS:
            grad += grad_logprob * (tl.where(cols == target, 1.0, 0.0) - p)
        if WITH_ENTROPY:
            grad -= grad_entropy * p * (z - mean_z)
        tl.store(grad_row_ptr + cols, (grad * inv_temperature).to(grad_ptr.dtype.element_ty), mask=in_row)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    """The logits with each row's entries adjacent (what the kernels index), copied only if not."""
    return logits if logits.stride(1) == 1 else logits.contiguous()


@dataclass(frozen=True)
class Kernels:
    """The passes of token_head.py in Triton (CUDA, or Triton's interpreter on CPU tensors); block:
    vocabulary entries a program reads at once, at most."""
    block: int = BLOCK
    num_warps: int = NUM_WARPS

    def _launch(self, kernel, logits: torch.Tensor, *args, **flags):
        """kernel over logits' rows, a program each. The shard's width is a constant of the compiled
        kernel (one compile per width): its loop's trip count and last block's mask are known."""
        rows, vocab = logits.shape
        kernel[(rows,)](logits, logits.stride(0), *args, **flags, VOCAB=vocab,
                        BLOCK=min(self.block, triton.next_power_of_2(vocab)), num_warps=self.num_warps)

    def row_stats(self, logits: torch.Tensor, local_targets: torch.Tensor, temperature: float,
                  with_entropy: bool) -> torch.Tensor:
        """[4, N] fp32: each row's top, sum exp(z - top), sum exp(z - top) x (z - top) (left unset
        without with_entropy) and z[target] (0 where local_targets is -1), over this shard."""
        logits = _rows(logits)
        stats = torch.empty(4, len(logits), dtype=torch.float32, device=logits.device)
        self._launch(_row_stats_kernel, logits, local_targets, stats, len(logits), 1.0 / temperature,
                     WITH_ENTROPY=with_entropy)
        return stats

    def logits_grad(self, logits: torch.Tensor, local_targets: torch.Tensor, logsumexp: torch.Tensor,
                    mean_z: torch.Tensor | None, grad_logprobs: torch.Tensor | None,
                    grad_entropy: torch.Tensor | None, temperature: float) -> torch.Tensor:
        """d loss / d logits [N, V_local] in the logits' dtype; grad_logprobs or grad_entropy is None
        where the loss does not use it."""
        logits = _rows(logits)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        per_token = [None if t is None else t.contiguous() for t in (grad_logprobs, grad_entropy)]
        self._launch(_logits_grad_kernel, logits, grad, local_targets, logsumexp, mean_z, *per_token,
                     1.0 / temperature, WITH_LOGPROBS=grad_logprobs is not None,
                     WITH_ENTROPY=grad_entropy is not None)
        return grad
