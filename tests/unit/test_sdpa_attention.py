"""SDPAttention (policy.attention_backend=sdpa) against megatron-core's DotProductAttention
(=local) on random query/key/value: causal, rlkit's packed-row mask, grouped KV heads, one
tensor-parallel rank's share of the heads, query-key layer scaling; outputs and gradients, in fp32
and in bf16. And what it refuses.

Tolerances, as the largest difference over the largest magnitude of DotProductAttention's
result: fp32 1e-5 (measured at most 3e-7: another summation order); bf16 2e-2, 2.5 bf16 steps
(measured at most 1e-2: DotProductAttention rounds the scores to bf16 before its fp32 softmax,
SDPA keeps them in fp32; against an fp32 computation SDPA's bf16 results were the closer of the
two in every case here).

DotProductAttention runs in this process without a process group: its three CUDA-only
dependencies (score buffer, RNG tracker around dropout, default causal mask) are patched for the
test only."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions import fused_softmax
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig

from rlkit.bridge.sdpa_attention import SDPAttention
from rlkit.config.schema import ConfigError
from rlkit.data.packing import packed_attention_mask

SEQ, BATCH, HEAD_DIM = 12, 3, 8
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def dot_product_attention_on_cpu(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_global_memory_buffer", lambda: SimpleNamespace(
        get_tensor=lambda shape, dtype, name: torch.empty(shape, dtype=dtype)))
    monkeypatch.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda: SimpleNamespace(fork=contextlib.nullcontext))
    monkeypatch.setattr(fused_softmax, "get_default_causal_mask",
                        lambda sq: torch.ones(sq, sq, dtype=torch.bool).triu(diagonal=1))


def config(heads=4, kv_heads=4, dtype=torch.float32, **kwargs) -> TransformerConfig:
    return TransformerConfig(num_layers=4, hidden_size=heads * HEAD_DIM, num_attention_heads=heads,
                             num_query_groups=kv_heads, attention_dropout=0.0, bf16=dtype == torch.bfloat16,
                             params_dtype=dtype, **kwargs)


def build(cls, cfg: TransformerConfig, tp: int = 1, layer_number: int = 1):
    tp_group = SimpleNamespace(tp=SimpleNamespace(size=lambda: tp))  # heads are split by this size
    return cls(cfg, layer_number=layer_number, attn_mask_type=AttnMaskType.causal, attention_type="self",
               pg_collection=tp_group)


def packed_mask() -> torch.Tensor:
    """Rows of 3, 2 and 1 sequences with padding, as rlkit's packed SFT rows: [BATCH, 1, SEQ, SEQ]."""
    segments = torch.tensor([[1] * 5 + [2] * 4 + [3] * 3, [1] * 7 + [2] * 3 + [0] * 2, [1] * 9 + [0] * 3])
    return packed_attention_mask(segments)


def outputs_and_grads(module, q, k, v, mask, grad_out):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = module(q, k, v, mask)
    out.backward(grad_out)
    return [out, q.grad, k.grad, v.grad]


CASES = {  # name: (TransformerConfig kwargs, TP size, layer number, packed mask)
    "causal": (dict(heads=4, kv_heads=4), 1, 1, False),
    "packed": (dict(heads=4, kv_heads=4), 1, 1, True),
    "gqa": (dict(heads=4, kv_heads=2), 1, 1, False),
    "gqa-packed": (dict(heads=4, kv_heads=2), 1, 1, True),
    # one of two TP ranks: 4 query heads and 2 KV heads of 8 and 4
    "tp-rank": (dict(heads=8, kv_heads=4), 2, 1, False),
    # DotProductAttention splits the scale between its scores and its softmax; the product is the same
    "layer-scaling": (dict(heads=4, kv_heads=4, apply_query_key_layer_scaling=True, fp16=False), 1, 3, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_matches_dot_product_attention(case, dtype):
    kwargs, tp, layer_number, packed = CASES[case]
    cfg = config(dtype=dtype, **kwargs)
    heads, kv_heads = cfg.num_attention_heads // tp, cfg.num_query_groups // tp
    g = torch.Generator().manual_seed(0)
    q = torch.randn(SEQ, BATCH, heads, HEAD_DIM, generator=g).to(dtype)
    k, v = (torch.randn(SEQ, BATCH, kv_heads, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    grad_out = torch.randn(SEQ, BATCH, heads * HEAD_DIM, generator=g).to(dtype)
    mask = packed_mask() if packed else None
    ours = outputs_and_grads(build(SDPAttention, cfg, tp, layer_number), q, k, v, mask, grad_out)
    megatron = outputs_and_grads(build(DotProductAttention, cfg, tp, layer_number), q, k, v, mask, grad_out)
    assert ours[0].shape == (SEQ, BATCH, heads * HEAD_DIM)
    for name, a, b in zip(["output", "query grad", "key grad", "value grad"], ours, megatron):
        assert a.dtype == b.dtype == dtype
        error = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
        assert error < TOLERANCE[dtype], f"{name}: max |sdpa - local| / max |local| = {error:.2e}"


def test_packed_rows_attend_within_their_own_sequence():
    """A sequence's output in a packed row is its output alone (the mask is not a no-op)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(SEQ, BATCH, 4, HEAD_DIM, generator=g) for _ in range(3))
    attention = build(SDPAttention, config())
    packed = attention(q, k, v, packed_mask())
    second = slice(5, 9)  # row 0's second sequence
    alone = attention(q[second, :1], k[second, :1], v[second, :1], None)
    torch.testing.assert_close(packed[second, :1], alone)


@pytest.mark.parametrize("kwargs, refused", [
    (dict(window_size=(4, 0)), "sliding-window attention"),
    (dict(softmax_type="off-by-one"), "softmax_type='off-by-one'"),
    (dict(attention_dropout=0.1), "attention dropout (0.1)"),
], ids=["window", "softmax-offset", "dropout"])
def test_refuses_what_it_cannot_compute_when_built(kwargs, refused):
    cfg = config()
    for key, value in kwargs.items():
        setattr(cfg, key, value)  # after __post_init__, which checks these for other backends
    with pytest.raises(ConfigError, match=r"^policy\.attention_backend: sdpa does not support") as info:
        build(SDPAttention, cfg)
    assert refused in str(info.value) and "policy.attention_backend=local" in str(info.value)


@pytest.mark.parametrize("kwargs, refused", [
    (dict(packed_seq_params=object()), "packed_seq_params"),
    (dict(attention_bias=torch.zeros(1)), "attention_bias"),
], ids=["thd", "bias"])
def test_refuses_inputs_it_cannot_compute(kwargs, refused):
    q = torch.randn(SEQ, BATCH, 4, HEAD_DIM)
    with pytest.raises(ConfigError, match=r"^policy\.attention_backend: sdpa does not support") as info:
        build(SDPAttention, config())(q, q, q, None, **kwargs)
    assert refused in str(info.value) and "TransformerEngine" in str(info.value)
