"""Rollout throughput of rlkit's vLLM worker against vLLM's own LLM.generate: same checkpoint,
prompts, sampling params and engine settings, each alone on GPU 0, in the same run.

  python benchmarks/generation.py --size 1.5b --out generation.json
  python benchmarks/generation.py --model qwen2.5-7b --prompts 128 --prompt-len 256 --max-tokens 1024 \
      --cuda-graphs --ignore-eos --out generation_7b.json   # one GPU's share of the 7B GRPO step
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import model_checkpoint  # noqa: E402

ENGINE = dict(gpu_memory_utilization=0.5, max_model_len=1024, enforce_eager=True, load_format="dummy",
              dtype="bfloat16", seed=0, logprobs_mode="processed_logprobs")


class VllmDirect:
    """vLLM as a user would call it, in a Ray actor like rlkit's worker."""

    def __init__(self, model_dir: str, engine: dict, raw_outputs: bool):
        import os
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        from vllm import LLM
        self.llm = LLM(model=model_dir, **engine)
        # vLLM's defaults decode text and build a logprob object per token; rlkit asks for neither
        self.outputs = dict(detokenize=False, flat_logprobs=True) if raw_outputs else {}

    def generate(self, prompt_ids, max_tokens, temperature, ignore_eos) -> int:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=1.0, top_k=-1, logprobs=0,
                                ignore_eos=ignore_eos, **self.outputs)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)


class RlkitWorker:
    def __init__(self, model_dir: str, engine: dict, raw_outputs: bool):
        del raw_outputs  # rlkit's worker always asks vLLM for no text and flat logprobs
        from rlkit.launch.config import load_config
        from rlkit.workers.generation.vllm import VLLMGenerationWorker
        cfg, _ = load_config("grpo_tiny_gpu", [f"generation.vllm.gpu_memory_utilization={engine['gpu_memory_utilization']}",
                                               f"generation.vllm.max_model_len={engine['max_model_len']}",
                                               f"generation.vllm.enforce_eager={engine['enforce_eager']}"])
        self.worker = VLLMGenerationWorker(model_dir, cfg.generation, seed=0, rank=0, sleep_mode=False,
                                           fp32_lm_head=cfg.policy.fp32_lm_head)

    def generate(self, prompt_ids, max_tokens, temperature, ignore_eos) -> int:
        from rlkit.data.generation import SamplingParams
        out = self.worker.generate(prompt_ids, SamplingParams(max_tokens, temperature, 1.0, 0, seed=0,
                                                              ignore_eos=ignore_eos))
        return sum(len(t) for t in out.token_ids)


def throughput(actor_cls, model_dir: str, engine: dict, prompt_ids, max_tokens: int, rounds: int,
               ignore_eos: bool, raw_outputs: bool) -> float:
    import ray
    actor = ray.remote(num_gpus=1)(actor_cls).remote(model_dir, engine, raw_outputs)
    ray.get(actor.generate.remote(prompt_ids[:8], 8, 1.0, ignore_eos))  # engine up, warm
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        tokens = ray.get(actor.generate.remote(prompt_ids, max_tokens, 1.0, ignore_eos))
        rates.append(tokens / (time.perf_counter() - start))
    ray.kill(actor)
    time.sleep(5)  # let the engine's GPU memory go before the next one starts
    return statistics.median(rates)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", default="1.5b", help="a Qwen3 shape of benchmarks/common.py (qwen3-<size>)")
    parser.add_argument("--model", help="any model of benchmarks/common.py's MODELS, instead of --size")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cuda-graphs", action="store_true", help="both engines capture CUDA graphs (as rollouts do)")
    parser.add_argument("--ignore-eos", action="store_true", help="every sample is --max-tokens long")
    parser.add_argument("--raw-outputs", action="store_true",
                        help="vLLM's own call without text or per-token logprob objects, as rlkit's worker asks")
    parser.add_argument("--checkpoints", default=tempfile.gettempdir() + "/rlkit_bench")
    parser.add_argument("--out", default="generation.json")
    args = parser.parse_args()
    import ray
    import torch

    model = args.model or f"qwen3-{args.size}"
    engine = dict(ENGINE, enforce_eager=not args.cuda_graphs,
                  max_model_len=max(ENGINE["max_model_len"], args.prompt_len + args.max_tokens))
    model_dir = str(model_checkpoint(model, Path(args.checkpoints)))
    g = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(0, 300, (args.prompts, args.prompt_len), generator=g).tolist()
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    runs = (engine, prompt_ids, args.max_tokens, args.rounds, args.ignore_eos, args.raw_outputs)
    direct = throughput(VllmDirect, model_dir, *runs)
    rlkit = throughput(RlkitWorker, model_dir, *runs)
    result = {"model": model, "prompts": args.prompts, "prompt_len": args.prompt_len,
              "max_tokens": args.max_tokens, "cuda_graphs": args.cuda_graphs, "ignore_eos": args.ignore_eos,
              "raw_outputs": args.raw_outputs,
              "vllm_tokens_per_s": direct, "rlkit_tokens_per_s": rlkit, "ratio": rlkit / direct}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    ray.shutdown()


if __name__ == "__main__":
    main()
