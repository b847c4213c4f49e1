"""How fast a background checkpoint's first save can copy a model's state into host buffers.

A distributed checkpoint written in the background first copies every tensor it writes into host
buffers (rlkit/workers/policy/dist_checkpoint.py); that copy is what holds training. The buffers
are kept for later saves, so only the first save pays for preparing them. This benchmark times,
for SmolLM2-135M's checkpoint state (bf16 parameters, fp32 main copies and Adam's two moments:
1.9 GB in 728 tensors), each way of preparing them, each in a fresh process (CUDA's host
allocations are per process):

    python benchmarks/checkpoint_staging.py --out staging.json [--variants a,b] [--scale 1.0]

- pin_at_save:    a pinned buffer per tensor, allocated at the save
- pageable:       a pageable buffer per tensor, allocated at the save
- per_tensor:     a pinned buffer per tensor, allocated ahead by a thread
- block_views:    one pinned block allocated ahead by a thread, plain views of it (the writer
                  serializes a tensor's whole storage, so these cannot be written as they are)
- block_numpy:    the same block cut into storages of their own through numpy (torch.frombuffer)
- block_slices:   the same block cut into storages of their own by slicing its untyped storage
                  (the policy worker's own BackgroundSave, as its checkpoints do)

For each: the seconds the thread took to allocate ahead, the first save's copy (what holds
training), the second's, and whether a buffer serializes as its own bytes alone. Reported as
ratios against pin_at_save measured in the same run. On a machine without CUDA it runs the same
code on unpinned host memory (a check that it runs, not a measurement).
"""

import argparse
import io
import json
import subprocess
import sys
import threading
import time

import torch

from rlkit.workers.policy.dist_checkpoint import BackgroundSave, _aligned as aligned

VARIANTS = ["pin_at_save", "pageable", "per_tensor", "block_views", "block_numpy", "block_slices"]


def smollm2_state_shapes(scale: float) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """SmolLM2-135M in Megatron's layout (fused QKV and gated MLP), each tensor as a bf16
    parameter and three fp32 tensors (main copy, Adam's moments)."""
    hidden, ffn, layers, vocab, qkv = 576, 1536, 30, 49152, (9 + 2 * 3) * 64
    hidden, ffn, vocab, qkv = (max(1, int(n * scale)) for n in (hidden, ffn, vocab, qkv))
    model = [(vocab, hidden)]
    for _ in range(layers):
        model += [(hidden,), (qkv, hidden), (hidden, hidden), (hidden,), (2 * ffn, hidden), (hidden, ffn)]
    model += [(hidden,)]
    return [(shape, dtype) for shape in model for dtype in (torch.bfloat16, torch.float32, torch.float32,
                                                            torch.float32)]


def allocate(variant: str, specs: list, pinned: bool) -> list[torch.Tensor]:
    """The host buffers, one per spec, as the variant prepares them."""
    if variant == "per_tensor":
        return [torch.empty(shape, dtype=dtype, pin_memory=pinned) for shape, dtype in specs]
    sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
    if variant == "block_slices":  # what the policy worker's checkpoints do (rlkit/workers/policy/dist_checkpoint.py)
        save = BackgroundSave()
        save.reserve(sum(aligned(n) for n in sizes))
        save._reserving.join()
        return [save._new_buffer(torch.empty(shape, dtype=dtype, device="meta")) for shape, dtype in specs]
    block = torch.empty(sum(aligned(n) for n in sizes), dtype=torch.uint8, pin_memory=pinned)
    memory = block.numpy() if variant == "block_numpy" else None
    buffers, offset = [], 0
    for (shape, dtype), nbytes in zip(specs, sizes):
        part = block[offset:offset + nbytes] if variant == "block_views" else \
            torch.frombuffer(memory[offset:offset + nbytes], dtype=torch.uint8)
        buffers.append(part.view(dtype).view(shape))
        offset += aligned(nbytes)
    return buffers


def stage(sources: list[torch.Tensor], buffers: list[torch.Tensor], on_gpu: bool) -> float:
    start = time.perf_counter()
    for buffer, source in zip(buffers, sources):
        buffer.copy_(source, non_blocking=on_gpu)
    if on_gpu:
        torch.cuda.current_stream().synchronize()
    return time.perf_counter() - start


def run_variant(variant: str, scale: float) -> dict:
    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    specs = smollm2_state_shapes(scale)
    sources = [torch.randn(shape, device=device).to(dtype) for shape, dtype in specs]
    if on_gpu:
        torch.cuda.synchronize()
    result = {"variant": variant, "tensors": len(specs),
              "gbytes": sum(t.numel() * t.element_size() for t in sources) / 1e9}
    if variant in ("pin_at_save", "pageable"):
        start = time.perf_counter()
        buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=on_gpu and variant == "pin_at_save")
                   for t in sources]
        stage(sources, buffers, on_gpu)
        result["first_s"] = time.perf_counter() - start  # allocating included: it is on the save's path
        result["allocate_ahead_s"] = 0.0
    else:
        holder = {}

        def ahead():
            start = time.perf_counter()
            holder["buffers"] = allocate(variant, specs, on_gpu)
            holder["seconds"] = time.perf_counter() - start

        thread = threading.Thread(target=ahead)
        thread.start()
        # training goes on meanwhile: GPU work from the main thread (a token amount on a CPU)
        width = 2048 if on_gpu else 64
        x = torch.randn(width, width, device=device)
        for _ in range(20):
            x = torch.tanh(x @ x.T / width)
        if on_gpu:
            torch.cuda.synchronize()
        thread.join()
        buffers, result["allocate_ahead_s"] = holder["buffers"], holder["seconds"]
        result["first_s"] = stage(sources, buffers, on_gpu)
    result["second_s"] = stage(sources, buffers, on_gpu)
    result["copies_equal"] = all(torch.equal(b, s.cpu()) for b, s in zip(buffers[:8], sources[:8]))
    small = buffers[1]  # a layer norm's parameter: a few hundred bytes
    saved = io.BytesIO()
    torch.save(small, saved)
    result["serializes_alone"] = len(saved.getvalue()) < small.numel() * small.element_size() + 4096
    result["pinned"] = bool(on_gpu and buffers[0].is_pinned())
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--scale", type=float, default=1.0, help="shrink the model's widths (a CPU check)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process's variant
    args = parser.parse_args()
    if args.one:
        print(json.dumps(run_variant(args.one, args.scale)))
        return
    results = []
    for variant in args.variants.split(","):
        child = subprocess.run([sys.executable, __file__, "--out", args.out, "--one", variant,
                                "--scale", str(args.scale)], capture_output=True, text=True, timeout=600)
        if child.returncode != 0:
            raise SystemExit(f"{variant} failed:\n{child.stderr[-3000:]}")
        results.append(json.loads(child.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"{variant:13s} ahead {r['allocate_ahead_s']:.3f} s  first {r['first_s']:.3f} s  "
              f"second {r['second_s']:.3f} s  serializes alone {r['serializes_alone']}  pinned {r['pinned']}",
              flush=True)
    reference = next((r["first_s"] for r in results if r["variant"] == "pin_at_save"), None)
    for r in results:
        r["first_vs_pin_at_save"] = r["first_s"] / reference if reference else None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    with open(args.out, "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
