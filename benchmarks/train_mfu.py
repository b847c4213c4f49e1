"""Training throughput of the policy alone: optimizer steps on random rows of a fixed length
(default 4096 tokens) through rlkit's Megatron workers, with tokens/s and MFU from the model's
architecture (rlkit/observability/throughput.py) against the GPU's bf16 dense peak.

    python3 benchmarks/train_mfu.py --model qwen3-1.7b --tokens 4096 --rows 16 --micro-batch 2 --out mfu.json
    python3 benchmarks/train_mfu.py --model tiny --recipe grpo_tiny_cpu --tokens 64 --rows 8 ...  (CPU dry run)
"""

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import model_dir_for  # noqa: E402

from rlkit.algorithms.objectives import NextTokenNLL  # noqa: E402
from rlkit.cluster.setup import start_workers  # noqa: E402
from rlkit.data.batch import Batch, batch_totals  # noqa: E402
from rlkit.launch.config import load_config  # noqa: E402
from rlkit.observability.throughput import DecoderShape, peak_bf16_flops, training_flops  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--recipe", default="grpo_smollm2_gpu")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per row")
    parser.add_argument("--rows", type=int, default=16, help="rows per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed optimizer steps (after one warm-up step)")
    parser.add_argument("--work-dir", default="/tmp/rlkit_e2e")
    parser.add_argument("--out", required=True)
    parser.add_argument("--profile", help="a folder: the operator tables of the first timed step (rlkit/observability/profiling.py)")
    parser.add_argument("overrides", nargs="*", help="extra rlkit key=value")
    args = parser.parse_args()
    model_dir = model_dir_for(args.model, Path(args.work_dir) / "cache")
    cfg, _ = load_config(args.recipe, [f"policy.model_path={model_dir}", f"run.cache_dir={args.work_dir}/cache",
                                       f"policy.micro_batch_size={args.micro_batch}",
                                       f"policy.train_global_batch_size={args.rows}",
                                       f"generation.vllm.max_model_len={args.tokens}" if torch.cuda.is_available()
                                       else "generation.max_new_tokens=8", *args.overrides])
    shape = DecoderShape.of(json.loads((model_dir / "config.json").read_text()))
    if args.profile:  # the workers read it at each call: call 2 is the first step after the warm-up
        os.environ.update(RLKIT_PROFILE_DIR=str(Path(args.profile).resolve()), RLKIT_PROFILE_CALLS="2")
    workers = start_workers(cfg, str(model_dir), with_generation=False)
    try:
        vocab = min(shape.vocab, 32000)
        rows = args.rows - args.rows % workers.policy.layout.dp_size
        batch = Batch({"input_ids": torch.randint(0, vocab, (rows, args.tokens), generator=torch.Generator().manual_seed(0)),
                       "loss_mask": torch.ones(rows, args.tokens)})
        totals = batch_totals(batch["loss_mask"])
        seconds = []
        for _ in range(args.steps + 1):
            start = time.perf_counter()
            workers.policy.train(batch, totals, NextTokenNLL())
            seconds.append(time.perf_counter() - start)
        step_s = statistics.median(seconds[1:])
        device = workers.policy.device_name()
        flops = training_flops(shape, [args.tokens] * rows)
        peak = peak_bf16_flops(device)
        gpus = len(workers.placement.policy_bundles)
        result = {"machine": device or "cpu", "model": args.model, "tokens_per_row": args.tokens, "rows": rows,
                  "micro_batch": args.micro_batch, "gpus": gpus, "step_seconds": seconds, "median_step_s": step_s,
                  "tokens_per_s": rows * args.tokens / step_s, "model_tflops_per_gpu": flops / step_s / gpus / 1e12,
                  "mfu": flops / step_s / gpus / peak if peak else None, "overrides": args.overrides,
                  "transformer_engine": transformer_engine_version()}
        Path(args.out).write_text(json.dumps(result, indent=1))
        print("train_mfu " + " ".join(f"{k} {v}" for k, v in result.items() if k != "step_seconds"))
    finally:
        workers.shutdown()


def transformer_engine_version() -> str | None:
    """The TransformerEngine the workers build their layers with (None: Megatron's torch layers)."""
    return importlib.metadata.version("transformer_engine") if importlib.util.find_spec("transformer_engine") else None


if __name__ == "__main__":
    main()
