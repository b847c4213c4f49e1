"""Shared by the GPU benchmarks: Qwen3-shaped random checkpoints and the hardware limits
(device copy and NCCL broadcast bandwidth) measured in the same run."""

import statistics
from pathlib import Path

import torch

# ~1.5B (Qwen3-1.7B's shape) and ~7B (Qwen2.5-7B's widths in the Qwen3 architecture)
QWEN3_SHAPES = {
    "1.5b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, head_dim=128, tie_word_embeddings=False),
}


def qwen3_checkpoint(size: str, root: Path) -> Path:
    """A random-init bf16 Qwen3 checkpoint (no hub here) with rlkit's tiny tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from rlkit.models.tiny import build_tokenizer

    out = root / f"qwen3-{size}"
    if (out / "config.json").is_file():
        return out
    tokenizer = build_tokenizer()
    config = Qwen3Config(vocab_size=151936, max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, **QWEN3_SHAPES[size])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def _median_seconds(fn, repeats: int = 10) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy on one GPU, GB/s of bytes copied."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = _median_seconds(lambda: dst.copy_(src))
    torch.cuda.empty_cache()
    return nbytes / seconds / 1e9


def _broadcast_worker(rank: int, port: int, nbytes: int, result):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    seconds = _median_seconds(lambda: dist.broadcast(buffer, src=0))
    if rank == 0:
        result.put(nbytes / seconds / 1e9)
    dist.barrier()
    dist.destroy_process_group()


def broadcast_bandwidth(nbytes: int = 1 << 30) -> float | None:
    """NCCL broadcast GPU0 -> GPU1, GB/s; None with fewer than 2 GPUs."""
    if torch.cuda.device_count() < 2:
        return None
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    procs = [ctx.Process(target=_broadcast_worker, args=(r, port, nbytes, result)) for r in range(2)]
    for p in procs:
        p.start()
    value = result.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    return value
