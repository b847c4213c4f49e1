"""rlkit/workers/policy/token_head_kernels.py, run on CPU tensors by Triton's interpreter against the
chunked torch ops of token_head.py: each pass alone (the row stats, the gradient with each of its
terms; fp32 and bf16 logits; vocabularies of one and of several blocks, each with a masked tail;
targets in this shard and not), and token_head's values and gradients through each. And both
kernels compile for Hopper (sm_90) here, without a GPU, with 16-byte loads of the logits.

Triton reads TRITON_INTERPRET when it is imported (triton.language's own @jit functions), so the
comparisons run in a child process of their own (this file run as a script, with the variable set),
whose results the tests here read; the test process's triton is left as it was."""

import json
import os
import subprocess
import sys

import pytest
import torch

TEMPERATURE, ROWS, BLOCK = 0.7, 6, 16
VOCABS = [12, 37]  # one block, its tail masked; three blocks, the last one's tail masked
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BF16_OR_TIGHT = {"fp32": {"atol": 1e-6, "rtol": 1e-5}, "bf16": {}}  # bf16: within its rounding


def _inputs(dtype, vocab, seed=0):
    """Logits [ROWS, vocab] (row 0 rising, so each entry raises the max; row 1 falling) and local
    targets: the first and last id, -1 (held by another shard) and random ids."""
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(ROWS, vocab, generator=gen)
    logits[0], logits[1] = torch.linspace(-4, 4, vocab), torch.linspace(4, -4, vocab)
    targets = torch.randint(0, vocab, (ROWS,), generator=gen)
    targets[:3] = torch.tensor([0, vocab - 1, -1])
    return logits.to(dtype), targets


def check_row_stats(kernels, dtype: str, vocab: int, with_entropy: bool):
    """[max z, sum exp(z - max), sum exp(z - max) x (z - max), z[target]]: the third only with
    entropy, the fourth only where this shard holds the target (the kernels: 0, the torch ops: any)."""
    from rlkit.workers.policy.token_head import ChunkedTorch

    logits, targets = _inputs(DTYPES[dtype], vocab)
    ours = kernels.Kernels(block=BLOCK).row_stats(logits, targets, TEMPERATURE, with_entropy)
    expected = ChunkedTorch(4).row_stats(logits, targets, TEMPERATURE, with_entropy)
    compared = [0, 1, 2] if with_entropy else [0, 1]
    torch.testing.assert_close(ours[compared], expected[compared], atol=1e-5, rtol=1e-5)
    held = targets >= 0
    torch.testing.assert_close(ours[3, held], expected[3, held], atol=1e-5, rtol=1e-5)
    assert (ours[3, ~held] == 0).all()


def check_logits_grad(kernels, dtype: str, vocab: int, terms: str):
    """The gradient from d loss / d logprob, d loss / d entropy or both, in the logits' dtype; none
    at a target another shard holds."""
    from rlkit.workers.policy.token_head import ChunkedTorch

    logits, targets = _inputs(DTYPES[dtype], vocab)
    z = logits.float() / TEMPERATURE
    logsumexp, mean_z = z.logsumexp(dim=-1), (z.softmax(dim=-1) * z).sum(dim=-1)
    gen = torch.Generator().manual_seed(1)
    grad_logprobs = torch.randn(ROWS, generator=gen) if terms != "entropy" else None
    grad_entropy = torch.randn(ROWS, generator=gen) if terms != "logprobs" else None
    args = (logits, targets, logsumexp, mean_z, grad_logprobs, grad_entropy, TEMPERATURE)
    ours = kernels.Kernels(block=BLOCK).logits_grad(*args)
    assert ours.dtype == DTYPES[dtype]
    torch.testing.assert_close(ours, ChunkedTorch(4).logits_grad(*args), **BF16_OR_TIGHT[dtype])


def _values_and_grad(backend, logits, targets, entropy: bool, entropy_grad: bool):
    """token_head's (logprobs, entropy) on backend and the gradient of a loss weighing each."""
    from rlkit.workers.policy.token_head import token_head

    leaf = logits.clone().requires_grad_()
    logprobs, entropy_values = token_head(backend, leaf, targets, TEMPERATURE, None, entropy=entropy,
                                          entropy_grad=entropy_grad)
    weights = torch.randn(2, *targets.shape, generator=torch.Generator().manual_seed(2))
    loss = (weights[0] * logprobs).sum() + ((weights[1] * entropy_values).sum() if entropy_grad else 0)
    loss.backward()
    return logprobs.detach(), entropy_values, leaf.grad


def check_token_head(kernels, dtype: str, entropy: str):
    """token_head's logprobs, entropy and gradient through the kernels as through the torch ops,
    [2, 3] tokens over 37 ids."""
    from rlkit.workers.policy.token_head import ChunkedTorch

    logits = _inputs(DTYPES[dtype], 37)[0].view(2, 3, 37)
    targets = torch.randint(0, 37, (2, 3), generator=torch.Generator().manual_seed(3))
    flags = {"entropy": entropy != "none", "entropy_grad": entropy == "with_grad"}
    ours = _values_and_grad(kernels.Kernels(block=BLOCK), logits, targets, **flags)
    expected = _values_and_grad(ChunkedTorch(4), logits, targets, **flags)
    assert (ours[1] is None) == (entropy == "none")
    torch.testing.assert_close(ours[:2], expected[:2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours[2], expected[2], **BF16_OR_TIGHT[dtype])


CASES = {
    **{f"row_stats-{d}-{v}-{'entropy' if e else 'no_entropy'}": (check_row_stats, (d, v, e))
       for d in DTYPES for v in VOCABS for e in (False, True)},
    **{f"logits_grad-{d}-{v}-{terms}": (check_logits_grad, (d, v, terms))
       for d in DTYPES for v in VOCABS for terms in ("logprobs", "entropy", "both")},
    **{f"token_head-{d}-entropy_{e}": (check_token_head, (d, e))
       for d in DTYPES for e in ("none", "without_grad", "with_grad")},
}


def _run_cases() -> dict[str, str | None]:
    """Under TRITON_INTERPRET=1: each case's failure, None where it passed."""
    from rlkit.workers.policy import token_head_kernels

    assert type(token_head_kernels._row_stats_kernel).__name__ == "InterpretedFunction"
    failures = {}
    for name, (check, args) in CASES.items():
        try:
            check(token_head_kernels, *args)
            failures[name] = None
        except AssertionError as error:
            failures[name] = f"{type(error).__name__}: {error}"
    return failures


@pytest.fixture(scope="module")
def interpreted() -> dict[str, str | None]:
    done = subprocess.run([sys.executable, __file__], env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", CASES)
def test_under_the_interpreter(interpreted, case):
    assert interpreted[case] is None, interpreted[case]


def _ptx_for_hopper(kernel, constexprs: dict) -> str:
    """kernel's PTX for sm_90 on bf16 logits, given what Triton specializes a launch on for rows of
    151,936 ids: 16-byte aligned pointers and a row stride that is a multiple of 16."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def arg_type(name):
        if name in ("logits_ptr", "grad_ptr"):
            return "*bf16"
        if name.endswith("_ptr"):
            return "*i64" if "targets" in name else "*fp32"
        return "fp32" if name == "inv_temperature" else "i32"  # row_stride, rows

    names = kernel.arg_names
    signature = {name: "constexpr" if name in constexprs else arg_type(name) for name in names}
    aligned = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
               if name not in constexprs and name != "inv_temperature"}
    source = ASTSource(kernel, signature, constexprs=constexprs, attrs=aligned)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]


def test_kernels_compile_for_hopper_with_16_byte_loads(tmp_path, monkeypatch):
    from rlkit.workers.policy import token_head_kernels

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # compiled here, not found in a cache
    block = {"VOCAB": 151_936, "BLOCK": token_head_kernels.BLOCK}
    for with_entropy in (False, True):
        ptx = _ptx_for_hopper(token_head_kernels._row_stats_kernel, {"WITH_ENTROPY": with_entropy, **block})
        assert "ld.global.v4.b32" in ptx, with_entropy
    for logprobs, entropy in ((True, False), (False, True), (True, True)):
        unused = {name: None for name, used in (("grad_logprobs_ptr", logprobs), ("grad_entropy_ptr", entropy),
                                                 ("mean_z_ptr", entropy)) if not used}
        ptx = _ptx_for_hopper(token_head_kernels._logits_grad_kernel,
                              {"WITH_LOGPROBS": logprobs, "WITH_ENTROPY": entropy, **unused, **block})
        assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx, (logprobs, entropy)


if __name__ == "__main__":
    print(json.dumps(_run_cases()))
