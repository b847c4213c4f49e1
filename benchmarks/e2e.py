"""One GRPO workload, end to end, on rlkit and on its peers, one after the other on the same GPU:
the seconds from the launch to the first step, the first step, the steady steps (the median over
steps 2..N) and their phases, tokens/s, MFU, and how much of the step is not generation, logprob
or training compute.

    python3 benchmarks/e2e.py --model smollm2 --out e2e_smollm2.json
    python3 benchmarks/e2e.py --model smollm2 --trl --compare verl.json --out e2e.json   (TRL run here, verl's result added)
    python3 benchmarks/e2e.py --model qwen3-1.7b --response-tokens 1024 --out e2e_1.7b.json
    python3 benchmarks/e2e.py --model tiny --recipe grpo_tiny_cpu --steps 3 ...     (a CPU dry run)

The workload is the same on both sides: the same model directory and prompts (rlkit's generated
word problems), prompts x samples, a fixed response length (EOS ignored), micro-batch and
optimizer settings. Phases, named alike for every framework:
  generate      sampling the responses (rlkit: timing/generate)
  logprobs      the policy's (and the reference's) logprobs of the rollout
  train         the optimizer steps
  weight_sync   refit plus the colocated hand-over: models to host and back, engines asleep/awake
  other         the rest of the step (rewards, advantages, driver work)
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from e2e_workload import Workload  # noqa: E402


# rlkit metric -> phase (several add up); the step is timing/step
RLKIT_PHASES = {"generate": ["timing/generate"], "logprobs": ["timing/logprobs"], "train": ["timing/train"],
                "weight_sync": ["timing/refit", "timing/reclaim"]}
# reported beside the phases when the run logs them (medians over the same steps)
RLKIT_FIGURES = ["timing/generate_tokens_per_s", "timing/logprobs_tokens_per_s", "timing/train_tokens_per_s",
                 "timing/generate_mfu", "timing/logprobs_mfu", "timing/train_mfu", "memory/policy_peak_gb",
                 "memory/policy_offloaded_gb", "timing/policy_sleep", "timing/policy_wake",
                 "timing/policy_sleep_gbytes_per_s", "timing/policy_wake_gbytes_per_s",
                 "timing/pinned_d2h_gbytes_per_s", "timing/pinned_h2d_gbytes_per_s", "timing/refit_transfer"]


def rlkit_overrides(w: Workload, model_dir: Path, run_dir: Path, cache_dir: Path, vllm: bool) -> list[str]:
    overrides = [
        f"policy.model_path={model_dir}", f"run.output_dir={run_dir.parent}", f"run.name={run_dir.name}",
        f"run.cache_dir={cache_dir}", f"algorithm.num_steps={w.steps}", f"algorithm.val_every={10 ** 6}",
        "checkpoint.every=0", "algorithm.val_before_training=false", f"algorithm.prompts_per_step={w.prompts_per_step}",
        f"algorithm.group_size={w.group_size}", f"algorithm.kl_coef={w.kl_coef}", "algorithm.warm_start.sft_steps=0",
        f"generation.max_new_tokens={w.response_tokens}", "generation.ignore_eos=true", "generation.temperature=1.0",
        f"env_runner.max_total_tokens={w.response_tokens}", f"data.max_prompt_tokens={w.max_prompt_tokens}",
        "data.val_size=8", f"policy.micro_batch_size={w.micro_batch_per_gpu}", "policy.max_tokens_per_microbatch=0",
        f"policy.train_global_batch_size={w.train_global_batch}", f"policy.optimizer.lr={w.lr}",
        "policy.optimizer.warmup_steps=0"]
    if vllm:
        overrides += [f"generation.vllm.max_model_len={w.max_prompt_tokens + w.response_tokens}",
                      f"generation.vllm.gpu_memory_utilization={w.gpu_memory_utilization}",
                      f"generation.vllm.enforce_eager={str(w.enforce_eager).lower()}",
                      f"generation.vllm.seed_per_request={str(w.seed_per_request).lower()}"]
    return overrides


def run_rlkit(w: Workload, recipe: str, model_dir: Path, work_dir: Path, timeout_s: int, vllm: bool,
              extra: list[str]) -> dict:
    """rlkit's run of the workload: its phases per step and the figures it logs."""
    run_dir = work_dir / "rlkit_run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a finished run there would only say so
    command = [sys.executable, "-m", "rlkit.cli", "train", "--config-name", recipe,
               *rlkit_overrides(w, model_dir, run_dir, work_dir / "cache", vllm), *extra]
    with open(work_dir / "rlkit.log", "w") as log:
        subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=True, cwd=ROOT)
    rows = list(map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()))
    steps = [m for m in rows if m["step"] >= 1]
    per_step = [{**{phase: sum(m.get(k, 0.0) for k in keys) for phase, keys in RLKIT_PHASES.items()},
                 "step": m["timing/step"], **{k: m[k] for k in RLKIT_FIGURES if k in m}} for m in steps]
    startup = {k.removeprefix("timing/startup/"): v for k, v in rows[0].items() if k.startswith("timing/startup/")}
    return {"framework": "rlkit", "command": " ".join(command[1:]), "to_first_step_s": startup["total"],
            "first_step_s": per_step[0]["step"], "startup": startup, **summary(per_step)}


def summary(per_step: list[dict]) -> dict:
    """Medians over the steady steps (2..N: step 1 pays for compilation and first allocations) of
    each phase, of `other` (step minus the named phases) and of the share of the step outside model
    compute, each taken per step first: a median of phases from different steps would not add up."""
    per_step = [{**s, "other": s["step"] - sum(s[p] for p in ("generate", "logprobs", "train", "weight_sync")),
                 "outside_compute_fraction": 1 - sum(s[p] for p in ("generate", "logprobs", "train")) / s["step"]}
                for s in per_step]
    steady = per_step[1:] or per_step
    medians = {k: statistics.median(s[k] for s in steady) for k in steady[0]}
    return {"steps": per_step, "median": medians, "outside_compute_fraction": medians.pop("outside_compute_fraction")}


def model_dir_for(name: str, cache_dir: Path) -> Path:
    if name == "smollm2":
        from rlkit.models.pretrained import smollm2_135m_instruct
        return smollm2_135m_instruct(cache_dir)
    if name == "qwen3-1.7b":
        from common import qwen3_checkpoint
        return qwen3_checkpoint("1.5b", cache_dir / "models")
    if name == "tiny":
        from rlkit.launch.config import load_config
        from rlkit.models.resolve import resolve_model_dir
        cfg, _ = load_config("grpo_tiny_cpu", [f"run.cache_dir={cache_dir}"])
        return resolve_model_dir(cfg)
    raise SystemExit(f"--model: one of smollm2, qwen3-1.7b, tiny (got: {name})")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 | qwen3-1.7b (random, Qwen3-1.7B's shape) | tiny")
    parser.add_argument("--recipe", default="grpo_smollm2_gpu", help="the rlkit recipe the workload overrides")
    parser.add_argument("--work-dir", default="/tmp/rlkit_e2e")
    parser.add_argument("--out", required=True, help="JSON with both frameworks' phases and the ratios")
    parser.add_argument("--timeout", type=int, default=540, help="seconds per framework")
    parser.add_argument("--rlkit-overrides", nargs="*", default=[], help="extra rlkit key=value (e.g. policy.offload=none)")
    parser.add_argument("--compare", nargs="*", default=[],
                        help="peers' results (benchmarks/e2e_verl.py or e2e_trl.py --out): added, with the ratios")
    parser.add_argument("--trl", action="store_true", help="run TRL's GRPOTrainer on the workload after rlkit")
    for field, value in asdict(Workload()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value) if not isinstance(value, bool)
                            else lambda s: s.lower() == "true", default=value)
    args = parser.parse_args()
    workload = Workload(**{f: getattr(args, f) for f in asdict(Workload())})
    work_dir = Path(args.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    model_dir = model_dir_for(args.model, work_dir / "cache")
    import torch
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    result = {"machine": device, "model": args.model, "workload": asdict(workload),
              "rlkit": run_rlkit(workload, args.recipe, model_dir, work_dir, args.timeout,
                                 vllm=torch.cuda.is_available(), extra=args.rlkit_overrides)}
    peers = [json.loads(Path(path).read_text()) for path in args.compare]
    if args.trl:
        from e2e_trl import run_trl
        peers.append(run_trl(workload, model_dir, work_dir / "trl", args.timeout, args.recipe))
    result["peers"] = {peer["framework"]: peer for peer in peers}
    result["ratio_rlkit_over_peer"] = {peer["framework"]: ratios(result["rlkit"], peer) for peer in peers}
    Path(args.out).write_text(json.dumps(result, indent=1))
    for name, run in [("rlkit", result["rlkit"]), *result["peers"].items()]:
        print(f"{name}: launch to first step {run.get('to_first_step_s', float('nan')):.1f} s, first step "
              f"{run.get('first_step_s', float('nan')):.2f} s, steady " +
              " ".join(f"{k} {v:.3g}" for k, v in run["median"].items()))


def ratios(rlkit: dict, peer: dict) -> dict:
    """rlkit's figure over the peer's: start-up, first step and each steady phase both report."""
    both = {k: (rlkit["median"][k], v) for k, v in peer["median"].items() if k in rlkit["median"]}
    both.update({k: (rlkit[k], peer[k]) for k in ("to_first_step_s", "first_step_s") if k in rlkit and k in peer})
    return {k: mine / theirs for k, (mine, theirs) in both.items() if theirs}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
