"""What a GPU image offers rlkit's long-sequence training, measured: attention kernels (torch SDPA backends and
varlen flash attention, causal, GQA, 1.7B-shaped heads) and device<->host copies of 2.4 GB
(a fresh `.cpu().pin_memory()` against a pinned buffer reused with non_blocking copies).

    python3 benchmarks/kernel_probe.py > result.json      (on a GPU machine)
"""
import inspect
import json
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from rlkit.workers.policy.offload import pinned_bandwidth

BATCH, SEQ, HEADS, KV_HEADS, HEAD_DIM = 8, 2048, 16, 8, 128
CAUSAL_FWD_FLOPS = 4 * BATCH * HEADS * SEQ * SEQ * HEAD_DIM / 2
BWD_FACTOR = 3.5  # forward + backward of attention ~ 3.5x the forward's FLOPs (backward recomputes scores)


def seconds(fn, repeats=20) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def speed(forward) -> dict:
    fwd, fwd_bwd = seconds(forward), seconds(lambda: forward().sum().backward())
    return {"fwd_s": fwd, "fwd_tflops": CAUSAL_FWD_FLOPS / fwd / 1e12, "fwd_bwd_s": fwd_bwd,
            "fwd_bwd_tflops": BWD_FACTOR * CAUSAL_FWD_FLOPS / fwd_bwd / 1e12}


def attention() -> dict:
    bf16 = {"device": "cuda", "dtype": torch.bfloat16, "requires_grad": True}
    q = torch.randn(BATCH, HEADS, SEQ, HEAD_DIM, **bf16)
    k, v = (torch.randn(BATCH, KV_HEADS, SEQ, HEAD_DIM, **bf16) for _ in range(2))
    found = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel(backend):
                found[f"sdpa_{backend.name.lower()}"] = speed(
                    lambda: scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
        except RuntimeError as e:
            found[f"sdpa_{backend.name.lower()}"] = str(e)[:200]
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as e:
        return {**found, "varlen": str(e)}
    # packed: (tokens, heads, dim), every sequence SEQ long; varlen_attn takes repeated KV heads
    tokens = BATCH * SEQ
    qp = torch.randn(tokens, HEADS, HEAD_DIM, **bf16)
    kp, vp = (torch.randn(tokens, HEADS, HEAD_DIM, **bf16) for _ in range(2))
    cu_seqlens = torch.arange(0, tokens + 1, SEQ, device="cuda", dtype=torch.int32)
    signature = str(inspect.signature(varlen_attn))
    causal = {"window_size": (-1, 0)} if "window_size" in signature else {"is_causal": True}
    found["varlen_signature"] = signature
    found["varlen"] = speed(lambda: varlen_attn(qp, kp, vp, cu_seqlens, cu_seqlens, SEQ, SEQ, **causal))
    return found


def copies(gbytes=2.4) -> dict:
    """A fresh .cpu().pin_memory() (what sleep() once did) against rlkit's reused pinned buffers."""
    gpu = torch.empty(int(gbytes * 1e9) // 2, device="cuda", dtype=torch.bfloat16)
    fresh = seconds(lambda: gpu.cpu().pin_memory(), repeats=3)
    reused = pinned_bandwidth(gbytes)
    return {"cpu_then_pin_memory_GB_per_s": gbytes / fresh, "d2h_reused_pinned_GB_per_s": reused["d2h"],
            "h2d_reused_pinned_GB_per_s": reused["h2d"]}


if __name__ == "__main__":
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), **attention(), **copies()},
                     indent=1))
