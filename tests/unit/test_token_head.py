"""rlkit/workers/policy/token_head.py: token logprobs and entropy from vocab-parallel logits, in
chunks, against an fp32 log_softmax over the whole vocabulary (values and both gradients, float64
gradcheck), Megatron's vocab_parallel_cross_entropy at TP=1 and TP=2, and two gloo ranks holding
half the vocabulary each against one rank holding all of it."""

import math

import pytest
import torch
from gloo_ranks import on_gloo_ranks

from rlkit.workers.policy.token_head import token_logprobs_and_entropy

VOCAB, TEMPERATURE = 12, 0.7
TOKENS = 2 * 7  # rows of 7 tokens: chunks of 3 or 4 leave a short last chunk


def _inputs(dtype=torch.float32, seed=0):
    """Logits [2, 7, VOCAB], their targets (in both halves of the vocabulary) and weights for each
    output in a loss."""
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(2, 7, VOCAB, generator=gen)).to(dtype)
    targets = torch.randint(0, VOCAB, (2, 7), generator=gen)
    targets[0, :2] = torch.tensor([0, VOCAB - 1])  # the first and last id of the vocabulary
    return logits, targets, torch.randn(2, 7, generator=gen), torch.randn(2, 7, generator=gen)


def _reference(logits: torch.Tensor, targets: torch.Tensor):
    log_p = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)) / TEMPERATURE, dim=-1)
    return log_p.gather(-1, targets[..., None]).squeeze(-1), -(log_p.exp() * log_p).sum(dim=-1)


def _values_and_grad(fn, logits, weights):
    """fn's (logprobs, entropy) and the gradient of sum(w_logprobs x logprobs + w_entropy x entropy)."""
    leaf = logits.clone().requires_grad_()
    logprobs, entropy = fn(leaf)
    ((weights[0] * logprobs).sum() + (weights[1] * entropy).sum()).backward()
    return logprobs.detach(), entropy.detach(), leaf.grad


@pytest.mark.parametrize("chunk_tokens", [1, 3, 4, TOKENS, None])
def test_values_and_gradients_are_log_softmaxs(chunk_tokens):
    logits, targets, *weights = _inputs()
    ours = _values_and_grad(lambda x: token_logprobs_and_entropy(x, targets, TEMPERATURE, entropy=True,
                                                                 entropy_grad=True, chunk_tokens=chunk_tokens),
                            logits, weights)
    expected = _values_and_grad(lambda x: _reference(x, targets), logits, weights)
    for got, want in zip(ours, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("entropy", [False, True])
def test_gradcheck_in_float64(entropy):
    logits, targets, *_ = _inputs(torch.float64)
    logits = logits[:, :5, :7].clone().requires_grad_()  # 10 tokens over 7 ids, chunks of 3
    targets = targets[:, :5] % 7

    def head(x):
        logprobs, token_entropy = token_logprobs_and_entropy(x, targets, TEMPERATURE, entropy=entropy,
                                                             entropy_grad=entropy, chunk_tokens=3)
        return (logprobs, token_entropy) if entropy else logprobs

    assert torch.autograd.gradcheck(head, (logits,))


def test_hand_values():
    uniform, one_hot = torch.zeros(1, 8), torch.tensor([[0.0, -1e4, -1e4]])
    logprobs, entropy = token_logprobs_and_entropy(uniform, torch.tensor([3]), 1.0, entropy=True)
    assert logprobs.item() == pytest.approx(-math.log(8), abs=1e-6)
    assert entropy.item() == pytest.approx(math.log(8), abs=1e-6)
    logprobs, entropy = token_logprobs_and_entropy(one_hot, torch.tensor([0]), 1.0, entropy=True)
    assert logprobs.item() == pytest.approx(0.0, abs=1e-6) and entropy.item() == pytest.approx(0.0, abs=1e-6)


def test_bf16_logits_get_bf16_gradients_and_fp32_outputs():
    logits, targets, *weights = _inputs(torch.bfloat16)
    logprobs, entropy, grad = _values_and_grad(
        lambda x: token_logprobs_and_entropy(x, targets, TEMPERATURE, entropy=True, entropy_grad=True, chunk_tokens=4),
        logits, weights)
    assert (logprobs.dtype, entropy.dtype, grad.dtype) == (torch.float32, torch.float32, torch.bfloat16)
    expected = _values_and_grad(lambda x: _reference(x, targets), logits.float(), weights)
    torch.testing.assert_close((logprobs, entropy), expected[:2], atol=1e-5, rtol=1e-5)  # the same fp32 math
    torch.testing.assert_close(grad, expected[2].bfloat16())  # within bf16 rounding


def _saved(logits, targets, entropy_grad: bool) -> list[tuple[torch.dtype, tuple]]:
    """(dtype, shape) of each tensor the forward keeps for backward."""
    saved = []

    def pack(tensor):
        saved.append((tensor.dtype, tuple(tensor.shape)))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs, entropy = token_logprobs_and_entropy(logits, targets, TEMPERATURE, entropy=True,
                                                       entropy_grad=entropy_grad, chunk_tokens=4)
    assert entropy.requires_grad == (entropy_grad and torch.is_grad_enabled())
    return saved


def test_backward_keeps_the_logits_as_given_and_per_token_floats():
    logits, targets, *_ = _inputs(torch.bfloat16)
    logits.requires_grad_()
    per_token = (torch.float32, (TOKENS,))
    without_entropy_grad = _saved(logits, targets, entropy_grad=False)
    assert (torch.bfloat16, (TOKENS, VOCAB)) in without_entropy_grad
    assert [s for s in without_entropy_grad if s[1][-1:] == (VOCAB,)] == [(torch.bfloat16, (TOKENS, VOCAB))]
    assert without_entropy_grad.count(per_token) == 1  # logsumexp
    assert _saved(logits, targets, entropy_grad=True).count(per_token) == 2  # and E_p[z]
    with torch.no_grad():
        assert _saved(logits, targets, entropy_grad=True) == []


def test_entropy_is_detached_unless_its_gradient_is_asked_for():
    logits, targets, *_ = _inputs()
    logits.requires_grad_()
    logprobs, entropy = token_logprobs_and_entropy(logits, targets, TEMPERATURE, entropy=True)
    assert logprobs.requires_grad and not entropy.requires_grad
    assert token_logprobs_and_entropy(logits, targets, TEMPERATURE)[1] is None
    with pytest.raises(ValueError, match="entropy_grad"):
        token_logprobs_and_entropy(logits, targets, TEMPERATURE, entropy_grad=True)


def _max_differences(ours, expected) -> list[float]:
    return [(got - want).abs().max().item() for got, want in zip(ours, expected)]


def _megatron(logits, targets, weights):
    """-vocab_parallel_cross_entropy on this rank's shard (its gradient: of the logprobs alone)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    leaf = logits.clone().requires_grad_()
    logprobs = -vocab_parallel_cross_entropy((leaf / TEMPERATURE).contiguous(), targets)
    (weights[0] * logprobs).sum().backward()
    return logprobs.detach(), leaf.grad


def _two_rank_checks(rank: int, port: int, results):
    """Each rank: at TP=1 (the whole vocabulary) against Megatron, then at TP=2 (its half) against
    Megatron and against the whole vocabulary's values and its half of their gradient."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    logits, targets, *weights = _inputs()
    logprobs_only = (weights[0], torch.zeros_like(weights[1]))

    def ours(x, group, weights=weights):
        return _values_and_grad(lambda leaf: token_logprobs_and_entropy(leaf, targets, TEMPERATURE, group,
                                                                        entropy=True, entropy_grad=True,
                                                                        chunk_tokens=4), x, weights)

    mpu.initialize_model_parallel(tensor_model_parallel_size=1)
    whole = ours(logits, mpu.get_tensor_model_parallel_group())
    logprobs, _, grad = ours(logits, mpu.get_tensor_model_parallel_group(), logprobs_only)
    checks = {"tp1_megatron": _max_differences((logprobs, grad), _megatron(logits, targets, weights))}
    mpu.destroy_model_parallel()

    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    half = slice(rank * VOCAB // 2, (rank + 1) * VOCAB // 2)
    group = mpu.get_tensor_model_parallel_group()
    checks["tp2_whole_vocabulary"] = _max_differences(ours(logits[..., half], group),
                                                      (whole[0], whole[1], whole[2][..., half]))
    logprobs, _, grad = ours(logits[..., half], group, logprobs_only)
    checks["tp2_megatron"] = _max_differences((logprobs, grad), _megatron(logits[..., half], targets, weights))
    results[rank] = checks
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    return on_gloo_ranks(_two_rank_checks)


@pytest.mark.parametrize("check", ["tp1_megatron", "tp2_megatron", "tp2_whole_vocabulary"])
def test_two_gloo_ranks(two_ranks, check):
    """Values and gradients within 1e-5 on both ranks: ours at TP=1 and TP=2 against Megatron's
    vocab_parallel_cross_entropy (logprobs), and each TP=2 rank's logprobs, entropy and gradient
    (of both) against the whole vocabulary's on one rank."""
    for rank in (0, 1):
        assert max(two_ranks[rank][check]) < 1e-5, (rank, two_ranks[rank][check])
