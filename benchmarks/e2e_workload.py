"""The end-to-end GRPO workload every framework of benchmarks/e2e.py runs (rlkit, verl, TRL)."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompts_per_step: int = 64
    group_size: int = 8
    response_tokens: int = 512
    max_prompt_tokens: int = 256
    micro_batch_per_gpu: int = 16  # rows per forward/backward (64 x 768 tokens of fp32 logits over a 49k vocab: out of memory)
    train_global_batch: int = 256  # samples per optimizer step
    lr: float = 1e-6
    steps: int = 5
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = False  # False: vLLM captures CUDA graphs
    seed_per_request: bool = False  # False: sampled as the peer samples, without a seed per request
    kl_coef: float = 0.0
