"""token_head.py's Triton kernels (token_head_kernels.py) on a GPU against its chunked torch ops, at a
Qwen3 micro-batch's size (4096 tokens over 151,936 ids): values and gradients through the public
function (which takes the kernels on CUDA), each pass on a vocabulary shard whose rows' targets are
partly elsewhere (an aligned and an odd width), and rows past 2^31 entries (int64 offsets)."""

import pytest
import torch

from rlkit.workers.policy.token_head import ChunkedTorch, token_head, token_logprobs_and_entropy
from rlkit.workers.policy.token_head_kernels import Kernels

VOCAB, TEMPERATURE = 151_936, 0.7
CHUNK = ChunkedTorch(chunk_tokens=256)


def _logits(rows: int, vocab: int, dtype=torch.bfloat16, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=gen, device="cuda")).to(dtype)
    return logits, torch.randint(0, vocab, (rows,), generator=gen, device="cuda")


def _values_and_grad(head, logits, targets, entropy_grad: bool):
    """head's (logprobs, entropy) and the gradient of a loss weighing the logprobs (and with
    entropy_grad, the entropy)."""
    leaf = logits.clone().requires_grad_()
    logprobs, entropy = head(leaf, entropy_grad)
    weights = torch.randn(2, len(targets), generator=torch.Generator(device="cuda").manual_seed(1), device="cuda")
    loss = (weights[0] * logprobs).sum() + ((weights[1] * entropy).sum() if entropy_grad else 0)
    loss.backward()
    return logprobs.detach(), entropy.detach(), leaf.grad


def _close(ours, expected, dtype):
    torch.testing.assert_close(ours[:2], expected[:2], atol=1e-4, rtol=1e-5)  # fp32 sums in another order
    grad_tolerance = {} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-4}  # bf16: within its rounding
    torch.testing.assert_close(ours[2], expected[2], **grad_tolerance)


@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("dtype,rows", [(torch.bfloat16, 4096), (torch.float32, 1024)])
def test_public_function_takes_the_kernels_and_matches_the_torch_ops(dtype, rows, entropy_grad):
    logits, targets = _logits(rows, VOCAB, dtype)

    def head(backend):
        if backend is None:
            return lambda x, grad: token_logprobs_and_entropy(x, targets, TEMPERATURE, entropy=True, entropy_grad=grad)
        return lambda x, grad: token_head(backend, x, targets, TEMPERATURE, None, entropy=True, entropy_grad=grad)

    public = _values_and_grad(head(None), logits, targets, entropy_grad)
    on_kernels = _values_and_grad(head(Kernels()), logits, targets, entropy_grad)
    assert all(torch.equal(a, b) for a, b in zip(public, on_kernels))  # the kernels ran, deterministically
    _close(public, _values_and_grad(head(CHUNK), logits, targets, entropy_grad), dtype)


def _passes(backend, logits, local_targets, stats_of=None):
    """backend's row stats, and its gradient with both terms at the log-softmax of stats_of's row stats."""
    stats = backend.row_stats(logits, local_targets, TEMPERATURE, True)
    top, total, weighted, _ = stats if stats_of is None else stats_of
    gen = torch.Generator(device="cuda").manual_seed(2)
    grads = torch.randn(2, len(logits), generator=gen, device="cuda")
    grad = backend.logits_grad(logits, local_targets, top + total.log(), top + weighted / total, *grads, TEMPERATURE)
    return stats, grad


def _compare_passes(logits, local_targets):
    expected_stats, expected_grad = _passes(CHUNK, logits, local_targets)
    stats, grad = _passes(Kernels(), logits, local_targets, stats_of=expected_stats)
    held = local_targets >= 0
    torch.testing.assert_close(stats[:3], expected_stats[:3], atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(stats[3, held], expected_stats[3, held])
    assert (stats[3, ~held] == 0).all()
    torch.testing.assert_close(grad, expected_grad)


@pytest.mark.parametrize("vocab_local", [VOCAB // 4, 49_999])
def test_passes_on_a_vocabulary_shard(vocab_local):
    logits, targets = _logits(512, vocab_local)
    targets[::3] = -1  # held by another rank
    _compare_passes(logits, targets)


def test_rows_past_two_to_the_31_entries():
    rows = 2**31 // VOCAB + 8
    logits, targets = _logits(rows, VOCAB)
    last = slice(rows - 8, rows)
    stats = Kernels().row_stats(logits, targets, TEMPERATURE, True)
    top, total, weighted, _ = stats
    logsumexp, mean_z = top + total.log(), top + weighted / total
    grads = torch.ones(2, rows, device="cuda")
    grad = Kernels().logits_grad(logits, targets, logsumexp, mean_z, *grads, TEMPERATURE)[last]
    expected_stats = CHUNK.row_stats(logits[last], targets[last], TEMPERATURE, True)
    torch.testing.assert_close(stats[:, last], expected_stats, atol=1e-4, rtol=1e-5)
    expected_grad = CHUNK.logits_grad(logits[last], targets[last], logsumexp[last], mean_z[last], *grads[:, last],
                                      TEMPERATURE)
    torch.testing.assert_close(grad, expected_grad)
