"""Async against synchronous GRPO on one workload, in one benchmark run: the same recipe in
disaggregated placement with algorithm.max_staleness 0 (on-policy) and each staleness asked for
(token_tis correction when > 0). Per mode: the median over steps 2..N of the step time, of the
step's wait for its rollout and of the phases; the ratio of each step time to the synchronous one;
and the learning curves (training reward per step, validation accuracy).

    python3 benchmarks/async_grpo.py --staleness 0,1 --out async_smollm2.json                  (2 GPUs)
    python3 benchmarks/async_grpo.py --recipe grpo_tiny_cpu --refit cpu --steps 4 --out x.json  (CPU dry run)

Runs already in --out (same recipe and steps) are kept, so the modes can be run one per call
where a call's time is limited; the ratios are over every run there.
"""

import argparse
import json
import os
import statistics
from pathlib import Path

from train_runs import add_run_options, train

PHASES = ["timing/step", "timing/rollout_wait", "timing/generate", "timing/logprobs", "timing/train", "timing/refit"]


def overrides(staleness: int, steps: int, refit: str, cache_dir: Path) -> list[str]:
    return ["cluster.placement=disaggregated", f"refit={refit}", f"algorithm.max_staleness={staleness}",
            f"algorithm.off_policy_correction={'token_tis' if staleness else 'none'}",
            f"algorithm.num_steps={steps}", f"algorithm.val_every={max(steps // 2, 1)}", "checkpoint.every=0",
            f"run.cache_dir={cache_dir}"]


def summarize(history: list[dict]) -> dict:
    """Medians of the phases over the steps after the first (it pays for compilation and first
    allocations), and the learning curves."""
    steps = [m for m in history if m["step"] >= 1]
    steady = steps[1:] or steps
    return {"median": {k: statistics.median(m.get(k, 0.0) for m in steady) for k in PHASES},
            "train_reward": [m["train/reward"] for m in steps],
            "staleness": [m["train/staleness"] for m in steps],
            "val_accuracy": {m["step"]: m["val/accuracy"] for m in history if "val/accuracy" in m}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", default="grpo_smollm2_gpu")
    parser.add_argument("--staleness", default="0,1", help="comma-separated max_staleness values to run")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--refit", default="nccl", help="nccl (GPUs) | cpu")
    add_run_options(parser, "/tmp/rlkit_async", 280)
    args = parser.parse_args()
    work_dir, out = Path(args.work_dir), Path(args.out)
    workload = {"recipe": args.recipe, "steps": args.steps}
    earlier = json.loads(out.read_text()) if out.is_file() else {}
    runs = {int(k): v for k, v in earlier["runs"].items()} if {k: earlier.get(k) for k in workload} == workload else {}
    result = {**workload, "runs": runs}
    for staleness in map(int, args.staleness.split(",")):
        command, history = train(args.recipe, [*overrides(staleness, args.steps, args.refit, Path(args.cache_dir)),
                                               *args.extra], work_dir, f"staleness_{staleness}", args.timeout)
        result["runs"][staleness] = {"command": command, **summarize(history)}
    sync_step = result["runs"][0]["median"]["timing/step"] if 0 in result["runs"] else float("nan")
    for staleness, run in sorted(result["runs"].items()):
        run["step_over_sync"] = run["median"]["timing/step"] / sync_step
        print(f"max_staleness {staleness}: step {run['median']['timing/step']:.3g} s ({run['step_over_sync']:.2f}x sync), "
              f"rollout wait {run['median']['timing/rollout_wait']:.3g} s, generate "
              f"{run['median']['timing/generate']:.3g} s, train {run['median']['timing/train']:.3g} s; "
              f"reward {' '.join(f'{r:.3f}' for r in run['train_reward'])}; val {run['val_accuracy']}")
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
