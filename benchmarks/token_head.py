"""Token logprobs and entropy from vocab-parallel logits (rlkit/workers/policy/token_head.py) on one GPU:
forward, backward (of the logprobs) and forward + backward with the entropy's gradient, of the Triton
kernels (a few block sizes and warp counts), of the chunked torch ops, and of Megatron's
vocab_parallel_cross_entropy on fp32 logits (logprobs only) for reference; beside them the
memory-bound limit of each: the bytes it must read and write over the bandwidth of a device copy
measured in the same run (bytes read + written per second). The largest differences of the kernels'
logprobs, entropy and gradient from the torch ops' are recorded too.

    python benchmarks/token_head.py --out token_head.json        (a GPU; 4096 tokens x 151,936 ids, bf16)
    python benchmarks/token_head.py --dry-run                     (CPU, tiny sizes, Triton's interpreter)
"""

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch

KERNEL_CONFIGS = [(2048, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)]  # (block, num_warps)
TEMPERATURE = 0.7


def _synchronize(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_ms(run, device: str, setup=lambda: None, repeats: int = 10) -> float:
    """Median ms of run(setup()) after a warm-up, setup untimed."""
    times = []
    for _ in range(repeats + 1):
        state = setup()
        _synchronize(device)
        start = time.perf_counter()
        run(state)
        _synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[1:])


def _times(head, logits: torch.Tensor, device: str, entropy: bool) -> dict:
    """head(leaf, entropy_grad) -> (logprobs, entropy): the forward without autograd (as for the
    logprobs of the policy that sampled), the backward of the logprobs, and (with entropy) forward +
    backward of a loss on both."""
    leaf = logits.detach().requires_grad_()
    grads = torch.randn(2, len(logits), device=device)

    def forward(entropy_grad=False):
        leaf.grad = None  # each backward writes a fresh gradient, as in a step (none to add to)
        return head(leaf, entropy_grad)

    def both(_):
        logprobs, token_entropy = forward(entropy_grad=True)
        ((grads[0] * logprobs).sum() + (grads[1] * token_entropy).sum()).backward()

    times = {"forward_ms": _timed_ms(torch.no_grad()(lambda _: forward()), device),
             "backward_ms": _timed_ms(lambda logprobs: logprobs.backward(grads[0]), device,
                                      setup=lambda: forward()[0])}
    if entropy:
        times["fwd_bwd_entropy_ms"] = _timed_ms(both, device)
    return times


def _rlkit_head(backend, targets):
    from rlkit.workers.policy.token_head import token_head

    return lambda leaf, entropy_grad: token_head(backend, leaf, targets, TEMPERATURE, None, entropy=entropy_grad,
                                                 entropy_grad=entropy_grad)


def _megatron_head(targets, device: str):
    """-vocab_parallel_cross_entropy at TP=1 on fp32 logits (a process group of one rank). It works in
    place on its input: a clone of it where autograd records, none for the forward alone."""
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1)

    def head(leaf, entropy_grad):
        logits = leaf.clone() if torch.is_grad_enabled() else leaf
        return -vocab_parallel_cross_entropy(logits[:, None], targets[:, None])[:, 0], None

    return head


def _differences(kernels, torch_ops, logits) -> dict:
    """Largest |kernels - torch ops| of the logprobs, entropy and gradient of a loss on both."""
    found = []
    for head in (kernels, torch_ops):
        leaf = logits.detach().requires_grad_()
        logprobs, token_entropy = head(leaf, True)
        (logprobs.sum() + token_entropy.sum()).backward()
        found.append((logprobs.detach(), token_entropy.detach(), leaf.grad.float()))
    return {name: (ours - theirs).abs().max().item()
            for name, ours, theirs in zip(("logprobs", "entropy", "grad"), *found)}


def run(rows: int, vocab_local: int, dtype: torch.dtype, device: str, configs) -> dict:
    from rlkit.workers.policy.token_head import CHUNK_BYTES, ChunkedTorch
    from rlkit.workers.policy.token_head_kernels import Kernels

    gen = torch.Generator(device=device).manual_seed(0)
    logits = (3 * torch.randn(rows, vocab_local, generator=gen, device=device)).to(dtype)
    targets = torch.randint(0, vocab_local, (rows,), generator=gen, device=device)
    src = torch.empty(logits.numel() * logits.element_size(), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    traffic_gbps = 2 * src.numel() / _timed_ms(lambda _: dst.copy_(src), device) / 1e6  # read + written
    del src, dst

    def limits(element_size: int) -> dict:  # forward reads the logits; backward reads them and writes the gradient
        logits_bytes = rows * vocab_local * element_size
        return {f"{name}_ms": passes * logits_bytes / traffic_gbps / 1e6
                for name, passes in (("forward", 1), ("backward", 2), ("fwd_bwd_entropy", 3))}

    torch_ops = _rlkit_head(ChunkedTorch(max(1, CHUNK_BYTES // (4 * vocab_local))), targets)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows,
              "vocab_local": vocab_local, "dtype": str(dtype).removeprefix("torch."),
              "traffic_gbps": traffic_gbps,
              "limits": {str(dtype).removeprefix("torch."): limits(logits.element_size()), "float32": limits(4)},
              "differences": _differences(_rlkit_head(Kernels(), targets), torch_ops, logits),
              "kernels": {f"block{block}_warps{warps}": _times(_rlkit_head(Kernels(block, warps), targets), logits,
                                                               device, entropy=True)
                          for block, warps in configs},
              "chunked_torch": _times(torch_ops, logits, device, entropy=True)}
    fp32_logits = logits.float()
    del logits
    result["megatron_fp32"] = _times(_megatron_head(targets, device), fp32_logits, device, entropy=False)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4096, help="tokens")
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: each holds vocab / tp ids")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--dry-run", action="store_true", help="CPU, 8 tokens x 300 ids, Triton's interpreter")
    parser.add_argument("--out", help="JSON file (default: stdout)")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when triton is first imported, below
        result = run(8, 300, getattr(torch, args.dtype), "cpu", KERNEL_CONFIGS[:1])
    else:
        result = run(args.rows, args.vocab // args.tp, getattr(torch, args.dtype), "cuda", KERNEL_CONFIGS)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
