"""One GRPO workload, end to end, on rlkit and on its peers, one after the other on the same GPUs:
the seconds from the launch to the first step, the first step, the steady steps (the median over
steps 2..N) and their phases, tokens/s per GPU of the whole step, MFU per phase, peak memory, and
how much of the step is not generation, logprob or training compute.

    python3 benchmarks/e2e.py --model smollm2 --out e2e_smollm2.json
    python3 benchmarks/e2e.py --model smollm2 --trl --compare verl.json --out e2e.json   (TRL here, verl's result added)
    python3 benchmarks/e2e.py --model qwen2.5-7b --gpus 4 --layout colocated --response-tokens 1024 \\
        --micro-batch-per-gpu 4 --out e2e_7b.json                                       (4 GPUs: DP=4, 4 engines)
    python3 benchmarks/e2e.py --model qwen2.5-7b --gpus 4 --layout async --policy-gpus 2 ...  (2 + 2 GPUs, staleness 1)
    python3 benchmarks/e2e.py --model tiny-qwen2 --recipe grpo_tiny_cpu --steps 3 ...     (a CPU dry run)

Models: smollm2 (rlkit pretrained smollm2-135m-instruct), tiny (grpo_tiny_cpu's), and the random
checkpoints of benchmarks/common.py's MODELS (qwen2.5-7b, llama3.1-8b, qwen3-moe-16b-a3b, ...,
tiny-qwen2 / tiny-llama / tiny-qwen3-moe for CPU), made once in --cache-dir. Before a run on
GPUs, what training the model holds per GPU is estimated (common.training_memory_gb); a layout
whose weights, gradients, Adam state and a micro-batch's activations exceed one GPU is refused.

The workload is the same on every side: the same model directory and prompts (rlkit's generated
word problems, each padded with a fixed preamble to exactly --max-prompt-tokens tokens, read
through rlkit's data path from a JSONL file), prompts x samples, a fixed response length (EOS
ignored), micro-batch and optimizer settings. Phases, named alike for every framework:
  generate      sampling the responses (rlkit: timing/generate)
  logprobs      the policy's (and the reference's) logprobs of the rollout
  train         the optimizer steps
  weight_sync   refit plus the colocated hand-over: models to host and back, engines asleep/awake
  other         the rest of the step (rewards, advantages, driver work); in the async layout
                generation overlaps training, so the phases may add up to more than the step
"""

import argparse
import json
import os
import shutil
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from e2e_workload import (LAYOUTS, Layout, Workload, add_workload_args, layout_overrides,  # noqa: E402
                          workload_of, workload_prompts)
from common import model_dir_for  # noqa: E402
from process_group import run_logged  # noqa: E402

# rlkit metric -> phase (several add up); the step is timing/step
RLKIT_PHASES = {"generate": ["timing/generate"], "logprobs": ["timing/logprobs"], "train": ["timing/train"],
                "weight_sync": ["timing/refit", "timing/reclaim"]}
# reported beside the phases when the run logs them (medians over the same steps)
RLKIT_FIGURES = ["timing/generate_tokens_per_s", "timing/logprobs_tokens_per_s", "timing/train_tokens_per_s",
                 "timing/generate_mfu", "timing/logprobs_mfu", "timing/train_mfu", "memory/policy_peak_gb",
                 "memory/policy_offloaded_gb", "timing/policy_sleep", "timing/policy_wake",
                 "timing/policy_sleep_gbytes_per_s", "timing/policy_wake_gbytes_per_s",
                 "timing/pinned_d2h_gbytes_per_s", "timing/pinned_h2d_gbytes_per_s", "timing/refit_transfer",
                 "timing/rollout_wait", "train/staleness"]


def rlkit_overrides(w: Workload, model_dir: Path, prompts: Path, run_dir: Path, cache_dir: Path,
                    vllm: bool) -> list[str]:
    """rlkit's overrides for the workload: its prompts file read through the data path (no
    validation), fixed-length responses, the batch and optimizer settings."""
    overrides = [
        f"policy.model_path={model_dir}", f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}",
        f"run.cache_dir={cache_dir}", f"algorithm.num_steps={w.steps}", f"algorithm.val_every={10 ** 6}",
        "checkpoint.enabled=false", "algorithm.val_before_training=false",
        f"algorithm.prompts_per_step={w.prompts_per_step}", f"algorithm.group_size={w.group_size}",
        f"algorithm.kl_coef={w.kl_coef}", "algorithm.warm_start.sft_steps=0",
        "env=math", "data=word_problems", f"data.train_path={prompts}", "data.val_path=null", "data.synthetic=null",
        f"data.max_prompt_tokens={w.max_prompt_tokens}",
        f"generation.max_new_tokens={w.response_tokens}", "generation.ignore_eos=true", "generation.temperature=1.0",
        f"env_runner.max_total_tokens={w.response_tokens}", f"policy.micro_batch_size={w.micro_batch_per_gpu}",
        "policy.max_tokens_per_microbatch=0", f"policy.train_global_batch_size={w.train_global_batch}",
        f"policy.optimizer.lr={w.lr}", "policy.optimizer.warmup_steps=0",
        # a step of NeMo-RL's 8B workload trains on 8.4M tokens: minutes in one call
        "cluster.call_timeout_s=3600"]
    if vllm:
        overrides += [f"generation.vllm.max_model_len={w.max_prompt_tokens + w.response_tokens}",
                      f"generation.vllm.gpu_memory_utilization={w.gpu_memory_utilization}",
                      f"generation.vllm.enforce_eager={str(w.enforce_eager).lower()}",
                      f"generation.vllm.seed_per_request={str(w.seed_per_request).lower()}"]
    return overrides


def run_rlkit(w: Workload, layout: Layout, recipe: str, model_dir: Path, prompts: Path, work_dir: Path,
              cache_dir: Path, timeout_s: int, vllm: bool, extra: list[str]) -> dict:
    """rlkit's run of the workload: its phases per step and the figures it logs. A run stopped at
    its time limit reports the steps it finished."""
    run_dir = work_dir / "rlkit_run"
    command = [sys.executable, "-m", "rlkit.cli", "train", "--config-name", recipe,
               *rlkit_overrides(w, model_dir, prompts, run_dir, cache_dir, vllm),
               *layout_overrides(layout, vllm), *extra]
    shutil.rmtree(run_dir, ignore_errors=True)  # a finished run there would only say so
    log = work_dir / "rlkit.log"
    returncode, timed_out = run_logged(command, None, ROOT, log, timeout_s)
    metrics = run_dir / "metrics.jsonl"
    rows = list(map(json.loads, metrics.read_text().splitlines())) if metrics.is_file() else []
    steps = [m for m in rows if m["step"] >= 1]
    if not steps or (returncode and not timed_out):
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"rlkit ran {len(steps)} steps (returncode {returncode}, timed out: {timed_out}); "
                           f"the end of {log}:\n{tail}")
    per_step = [{**{phase: sum(m.get(k, 0.0) for k in keys) for phase, keys in RLKIT_PHASES.items()},
                 "step": m["timing/step"], "tokens_per_s_per_gpu": w.tokens_per_step / m["timing/step"] / layout.gpus,
                 **{k: m[k] for k in RLKIT_FIGURES if k in m}} for m in steps]
    startup = {k.removeprefix("timing/startup/"): v for k, v in rows[0].items() if k.startswith("timing/startup/")}
    return {"framework": "rlkit", "command": " ".join(command[1:]), "returncode": returncode, "timed_out": timed_out,
            "to_first_step_s": startup.get("total"), "first_step_s": per_step[0]["step"], "startup": startup,
            **summary(per_step)}


def summary(per_step: list[dict]) -> dict:
    """Medians over the steady steps (2..N: step 1 pays for compilation and first allocations) of
    each phase, of `other` (step minus the named phases) and of the share of the step outside model
    compute, each taken per step first: a median of phases from different steps would not add up."""
    per_step = [{**s, "other": s["step"] - sum(s[p] for p in ("generate", "logprobs", "train", "weight_sync")),
                 "outside_compute_fraction": 1 - sum(s[p] for p in ("generate", "logprobs", "train")) / s["step"]}
                for s in per_step]
    steady = per_step[1:] or per_step
    medians = {k: statistics.median(s[k] for s in steady if k in s) for k in steady[0]}
    return {"steps": per_step, "steady_steps": len(steady), "median": medians,
            "outside_compute_fraction": medians.pop("outside_compute_fraction")}


def memory_estimate(name: str, w: Workload, layout: Layout, device_gb: float | None) -> dict | None:
    """What training holds per policy GPU (common.training_memory_gb) for the models of
    common.MODELS. A layout whose weights, gradients, Adam state and one micro-batch's activations
    exceed device_gb (one GPU's memory; None on CPU) stops here, before a checkpoint is written or
    a worker starts."""
    from common import MODELS, model_config, training_memory_gb

    name = {"qwen3-1.7b": "qwen3-1.5b"}.get(name, name)
    if name not in MODELS:
        return None
    estimate = training_memory_gb(model_config(name), layout.policy_ranks, layout.tp, layout.ep,
                                  w.micro_batch_per_gpu * (w.max_prompt_tokens + w.response_tokens))
    if device_gb is not None and estimate["total"] > device_gb:
        raise SystemExit(f"e2e: {name} on {layout.policy_ranks} policy GPUs (TP={layout.tp}, EP={layout.ep}) would hold "
                         f"about {estimate['total']:.0f} GB per GPU ({estimate['state']:.0f} of weights, gradients and "
                         f"Adam state, {estimate['activations']:.0f} of a micro-batch's activations), over one GPU's "
                         f"{device_gb:.0f} GB; give the policy more GPUs, raise --tp / --ep, lower "
                         f"--micro-batch-per-gpu, or take a smaller model")
    return {**estimate, "device": device_gb}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny | a name of benchmarks/common.py's MODELS")
    parser.add_argument("--recipe", default="grpo_smollm2_gpu", help="the rlkit recipe the workload overrides")
    parser.add_argument("--layout", default="colocated", help=" | ".join(LAYOUTS))
    parser.add_argument("--gpus", type=int, default=0, help="devices the run uses (0: every GPU, or 2 on CPU)")
    parser.add_argument("--policy-gpus", type=int, default=0, help="disaggregated / async: the policy's (0: half)")
    parser.add_argument("--tp", type=int, default=1, help="the policy's tensor parallelism")
    parser.add_argument("--ep", type=int, default=1, help="the policy's expert parallelism (MoE)")
    parser.add_argument("--engine-tp", type=int, default=1, help="GPUs per vLLM engine")
    parser.add_argument("--staleness", type=int, default=1, help="async: rollouts at most this many steps old")
    parser.add_argument("--work-dir", default="/tmp/rlkit_e2e")
    parser.add_argument("--cache-dir", help="where models are made and kept (default: WORK_DIR/cache)")
    parser.add_argument("--out", required=True, help="JSON with every framework's phases and the ratios")
    parser.add_argument("--timeout", type=int, default=540, help="seconds per framework")
    parser.add_argument("--rlkit-overrides", nargs="*", default=[],
                        help="extra rlkit key=value (e.g. policy.offload=none)")
    parser.add_argument("--compare", nargs="*", default=[],
                        help="peers' results (benchmarks/e2e_verl.py or e2e_trl.py --out): added, with the ratios")
    parser.add_argument("--rlkit-result", help="an earlier e2e.py --out: its rlkit run, not a new one, is compared")
    parser.add_argument("--trl", action="store_true", help="run TRL's GRPOTrainer on the workload after rlkit")
    add_workload_args(parser)
    return parser.parse_args()


def run_workload(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """rlkit's run of the workload in the layout asked for (and TRL's after it with --trl): the
    result, and the peers run here."""
    import torch

    on_gpu = torch.cuda.is_available()
    workload = workload_of(args)
    layout = Layout(args.layout, args.gpus or (torch.cuda.device_count() if on_gpu else 2), args.policy_gpus,
                    args.tp, args.ep, args.engine_tp, args.staleness)
    try:
        layout_overrides(layout, on_gpu)
    except ValueError as e:
        raise SystemExit(f"e2e: {e}") from None
    device_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if on_gpu else None
    estimate = memory_estimate(args.model, workload, layout, device_gb)
    work_dir = Path(args.work_dir).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    cache_dir = Path(args.cache_dir).resolve() if args.cache_dir else work_dir / "cache"
    model_dir = model_dir_for(args.model, cache_dir)
    data_overrides = [o for o in args.rlkit_overrides if o.startswith("data.")]
    prompts_file = work_dir / "prompts" / f"{args.model}_{workload.max_prompt_tokens}.jsonl"
    prompts = workload_prompts(workload, args.recipe, model_dir, prompts_file, data_overrides)
    build = model_dir / "build_seconds.txt"
    result = {"machine": torch.cuda.get_device_name() if on_gpu else "cpu", "model": args.model,
              "workload": asdict(workload), "layout": asdict(layout), "tokens_per_step": workload.tokens_per_step,
              "memory_estimate_gb": estimate,
              "checkpoint_build_s": float(build.read_text()) if build.is_file() else None,
              "rlkit": run_rlkit(workload, layout, args.recipe, model_dir, prompts, work_dir, cache_dir, args.timeout,
                                 vllm=on_gpu, extra=args.rlkit_overrides)}
    if not args.trl:
        return result, []
    from e2e_trl import run_trl
    return result, [run_trl(workload, model_dir, work_dir / "trl", args.timeout, args.recipe, prompts)]


def main():
    args = parse_args()
    result, peers = (json.loads(Path(args.rlkit_result).read_text()), []) if args.rlkit_result else run_workload(args)
    peers += [json.loads(Path(path).read_text()) for path in args.compare]
    result["peers"] = {peer["framework"]: peer for peer in peers}
    result["ratio_rlkit_over_peer"] = {peer["framework"]: ratios(result["rlkit"], peer) for peer in peers}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, run in [("rlkit", result["rlkit"]), *result["peers"].items()]:
        print(f"{name}: launch to first step {run.get('to_first_step_s') or float('nan'):.1f} s, first step "
              f"{run.get('first_step_s', float('nan')):.2f} s, {run.get('steady_steps', '?')} steady steps: " +
              " ".join(f"{k} {v:.3g}" for k, v in run["median"].items()))


def ratios(rlkit: dict, peer: dict) -> dict:
    """rlkit's figure over the peer's: start-up, first step and each steady phase both report."""
    both = {k: (rlkit["median"][k], v) for k, v in peer["median"].items() if k in rlkit["median"]}
    both.update({k: (rlkit[k], peer[k]) for k in ("to_first_step_s", "first_step_s") if rlkit.get(k) and peer.get(k)})
    return {k: mine / theirs for k, (mine, theirs) in both.items() if theirs}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
