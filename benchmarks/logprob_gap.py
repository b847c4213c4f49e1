"""Where the train-vs-generation logprob gap of a bf16 model comes from, layer by layer.

The recipe's model (SmolLM2-135M-Instruct) and its held-out prompts; one GPU, no Ray:
  - vLLM (bf16, the recipe's engine settings, real weights from the directory) samples answers at
    T=1 and at the recipe's temperature, then prefills the T=1 conversations again (prompt
    logprobs): decode vs prefill is vLLM's own share of the gap;
  - Megatron built by rlkit's bridge scores the same tokens in bf16 with each core attention
    (policy.attention_backend local: megatron-core's DotProductAttention, and sdpa: rlkit's
    SDPAttention; same weights), and in fp32 as the reference;
  - for a few conversations, the residual stream after every decoder layer, from vLLM's prefill
    and from each Megatron build, as relative RMS distances to the fp32 reference and to each
    other.

  python benchmarks/logprob_gap.py --out logprob_gap.json
"""

import argparse
import json
import os
import time
from datetime import timedelta

import torch

from rlkit.launch.config import load_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# the Megatron settings that decide its numerics, recorded beside the HF config's
MEGATRON_NUMERICS = ["normalization", "layernorm_epsilon", "rotary_base", "rotary_interleaved", "rope_scaling",
                     "attention_softmax_in_fp32", "apply_query_key_layer_scaling", "fp32_residual_connection",
                     "bias_activation_fusion", "gated_linear_unit", "activation_func", "bf16", "params_dtype"]


def _agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    d = (a - b).abs()
    return {"mean_abs": d.mean().item(), "max_abs": d.max().item(), "token_mult_prob_error": d.exp().mean().item()}


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Vllm:
    def __init__(self, model_dir: str, cfg):
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # apply_model pickles functions
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # this process has touched CUDA already
        from vllm import LLM

        v = cfg.generation.vllm
        self.llm = LLM(model=model_dir, dtype="bfloat16", gpu_memory_utilization=v.gpu_memory_utilization,
                       max_model_len=v.max_model_len, enforce_eager=v.enforce_eager, seed=0,
                       logprobs_mode="processed_logprobs", enable_prefix_caching=False,
                       hf_overrides={"head_dtype": "float32"} if cfg.policy.fp32_lm_head else None)

    def sample(self, prompts: list[list[int]], temperature: float, max_tokens: int):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=1.0, top_k=-1, logprobs=0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        responses = [list(o.outputs[0].token_ids) for o in outs]
        logprobs = [[s[t].logprob for s, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
        return responses, logprobs

    def prefill_logprobs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(token t | tokens < t) for t >= 1 of each sequence, from one prefill (T=1: vLLM's
        prompt logprobs skip the sampling processors)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in sequences], params, use_tqdm=False)
        return [[step[t].logprob for step, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, sequences)]

    def residual_streams(self, sequence: list[int]) -> list[torch.Tensor]:
        """The residual stream [tokens, hidden] after each decoder layer during one prefill
        (max_tokens=1: the prefill is the only forward). vLLM's Llama layers return
        (hidden, residual) with the add fused into the next norm, so the stream is their sum."""
        def attach(model):
            model._rlkit_streams = []
            model._rlkit_hooks = [layer.register_forward_hook(
                lambda _m, _in, out: model._rlkit_streams.append((out[0].float() + out[1].float()).cpu()))
                for layer in model.model.layers]

        def detach(model):
            for hook in model._rlkit_hooks:
                hook.remove()
            return model._rlkit_streams[:len(model.model.layers)]

        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.llm.apply_model(attach)
        self.llm.generate([TokensPrompt(prompt_token_ids=sequence)], SamplingParams(max_tokens=1), use_tqdm=False)
        streams, = self.llm.apply_model(detach)
        return [s[:len(sequence)] for s in streams]


class Megatron:
    """The policy's model as rlkit's bridge builds it, in this process (TP=PP=1)."""

    def __init__(self, model_dir: str, bf16: bool, fp32_lm_head: bool, attention_backend: str):
        from rlkit.bridge import open_bridge

        self.bridge = open_bridge("mbridge", model_dir, torch.bfloat16 if bf16 else torch.float32, attention_backend)
        self.model = self.bridge.build(bf16=bf16, wrap_with_ddp=False, fp32_lm_head=fp32_lm_head)
        self.bridge.load_hf_weights(self.model)
        self.module = self.model[0]  # bf16: inside Float16Module, whose forward casts the output
        self.module.eval()
        self.layers = getattr(self.module, "module", self.module).decoder.layers

    @torch.no_grad()
    def logits(self, sequence: list[int]) -> torch.Tensor:
        tokens = torch.tensor([sequence], device=DEVICE)
        positions = torch.arange(len(sequence), device=DEVICE)[None]
        return self.module(tokens, positions, None)[0].float()

    def token_logprobs(self, sequence: list[int], temperature: float) -> torch.Tensor:
        lp = torch.log_softmax(self.logits(sequence)[:-1] / temperature, -1)
        return lp.gather(-1, torch.tensor(sequence[1:], device=DEVICE)[:, None])[:, 0].cpu()

    @torch.no_grad()
    def residual_streams(self, sequence: list[int]) -> list[torch.Tensor]:
        streams = []
        hooks = [layer.register_forward_hook(lambda _m, _in, out: streams.append(out[0][:, 0].float().cpu()))
                 for layer in self.layers]
        self.logits(sequence)
        for hook in hooks:
            hook.remove()
        return streams


def _init_megatron():
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    else:  # a dry run of the Megatron half on a CPU machine
        from rlkit.workers.policy import cpu_compat
        cpu_compat.enable()
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method="tcp://127.0.0.1:29533",
                            rank=0, world_size=1, timeout=timedelta(seconds=120))
    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)


def _write(report: dict, path: str, start: float):
    report["seconds"] = time.perf_counter() - start
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="grpo_smollm2_gpu")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--layer-prompts", type=int, default=8, help="conversations compared layer by layer")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    from rlkit.algorithms.registry import load_algorithm
    from rlkit.models.resolve import resolve_model_dir
    from rlkit.models.tokenizer import load_tokenizer

    start = time.perf_counter()
    cfg, _ = load_config(args.recipe, [])
    model_dir = str(resolve_model_dir(cfg))
    tokenizer = load_tokenizer(model_dir)
    prompts = [p.token_ids for p in load_algorithm(cfg.algorithm.name).load_data(cfg, tokenizer).val[:args.num_prompts]]
    temperature, max_tokens = cfg.generation.temperature, cfg.generation.max_new_tokens

    # per temperature: (prompt length, prompt + response, vLLM's decode logprobs of the response)
    vllm = Vllm(model_dir, cfg)
    samples = {}
    for t in sorted({1.0, temperature}):
        responses, logprobs = vllm.sample(prompts, t, max_tokens)
        samples[t] = [(len(p), p + r, torch.tensor(lp)) for p, r, lp in zip(prompts, responses, logprobs) if r]
    scored = {("vllm_decode", t): torch.cat([lp for _, _, lp in rows]) for t, rows in samples.items()}
    # logprobs[i] scores token i + 1, so a response starts at prompt length - 1
    prefill = vllm.prefill_logprobs([s for _, s, _ in samples[1.0]])
    scored["vllm_prefill", 1.0] = torch.cat([torch.tensor(lp[n - 1:]) for (n, _, _), lp in zip(samples[1.0], prefill)])
    layer_sequences = [s for _, s, _ in samples[1.0][:args.layer_prompts]]

    _init_megatron()
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference is fp32 throughout
    policy = Megatron(model_dir, bf16=True, fp32_lm_head=cfg.policy.fp32_lm_head, attention_backend="sdpa")
    builds = [("megatron_fp32", Megatron(model_dir, bf16=False, fp32_lm_head=False, attention_backend="sdpa")),
              ("megatron_bf16_dot_product", Megatron(model_dir, bf16=True, fp32_lm_head=cfg.policy.fp32_lm_head,
                                                     attention_backend="local")),
              ("megatron_bf16_sdpa", policy)]
    for name, engine in builds:
        for t, rows in samples.items():
            scored[name, t] = torch.cat([engine.token_logprobs(s, t)[n - 1:] for n, s, _ in rows])

    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    report = {"model": model_dir, "recipe": args.recipe, "device": device,
              "response_tokens": {str(t): len(scored["vllm_decode", t]) for t in samples}, "logprobs": {}, "layers": {},
              # what each side reads from the checkpoint's config (vLLM reads the HF config as is)
              "hf_config": {k: getattr(policy.bridge.hf_config, k, None) for k in ["rms_norm_eps", "rope_theta"]},
              "megatron_config": {k: str(getattr(policy.bridge.transformer_config, k, None))
                                  for k in MEGATRON_NUMERICS}}
    for t in samples:
        names = [n for n, tt in scored if tt == t]
        report["logprobs"][str(t)] = {f"{a} vs {b}": _agreement(scored[a, t], scored[b, t])
                                      for i, a in enumerate(names) for b in names[i + 1:]}
    _write(report, args.out, start)
    for t, pairs in report["logprobs"].items():
        for pair, m in pairs.items():
            print(f"T={t} {pair}: mean|dlogp| {m['mean_abs']:.4f} max {m['max_abs']:.3f} "
                  f"token_mult_prob_error {m['token_mult_prob_error']:.4f}", flush=True)
    # the residual stream after each layer: vLLM's prefill, then each Megatron build
    streams = {"vllm_prefill": [vllm.residual_streams(s) for s in layer_sequences]}
    for name, engine in builds:
        streams[name] = [engine.residual_streams(s) for s in layer_sequences]
    names = list(streams)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            report["layers"][f"{a} vs {b}"] = [
                sum(_relative(sa[layer], sb[layer]) for sa, sb in zip(streams[a], streams[b])) / len(layer_sequences)
                for layer in range(len(streams[a][0]))]
    _write(report, args.out, start)
    for pair, per_layer in report["layers"].items():
        print(f"layers {pair}: " + " ".join(f"{x:.4f}" for x in per_layer[::5]) + f" last {per_layer[-1]:.4f}")


if __name__ == "__main__":
    main()
