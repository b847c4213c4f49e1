"""Refit dense against refit.delta over the object-store transport (refit=cpu: every byte goes
through Ray's object store, as it does between nodes without a GPU link), on a real training
trajectory: GRPO steps of a pretrained model on generated GSM8K-format word problems at the GPU
recipe's learning rate, the generation worker holding bf16 weights as vLLM does. The same steps
run twice, dense then delta; per step, the refit's seconds and bytes, and for the delta run the
changed fraction and the encode and apply seconds.

    python benchmarks/delta_refit.py --model <SmolLM2-135M-Instruct dir> --steps 6 --out delta_refit.json
"""

import argparse
import json
import statistics
import tempfile

KEYS = ("timing/refit_transfer", "refit/bytes", "refit/delta_bytes", "refit/dense_bytes", "refit/delta_fraction",
        "timing/refit_delta_encode", "timing/refit_delta_apply", "refit/delta_redone", "train/reward")


def run(model: str, steps: int, lr: float, delta: bool, output_dir: str) -> list[dict]:
    from rlkit.launch.config import load_config
    from rlkit.launch.run import train

    cfg, resolved = load_config("grpo_tiny_cpu", [
        f"policy.model_path={model}", "data=word_problems", "env=math", "data.synthetic.train_size=256",
        "data.synthetic.val_size=2", f"algorithm.num_steps={steps}", "algorithm.val_every=1000",
        "algorithm.val_before_training=false", "algorithm.prompts_per_step=2", "algorithm.group_size=4",
        "policy.num_workers=1", "generation.num_workers=1", "policy.train_global_batch_size=8",
        "policy.micro_batch_size=8", "generation.max_new_tokens=24", "env_runner.max_total_tokens=24",
        "generation.precision=bf16", "refit.bucket_mb=64", f"policy.optimizer.lr={lr}",
        f"refit.delta={str(delta).lower()}", "checkpoint.every=0", "checkpoint.save_format=hf",
        f"run.output_dir={output_dir}",
        f"run.name={'delta' if delta else 'dense'}"])
    history = train(cfg, resolved).history
    return [{"step": row["step"], **{k: row[k] for k in KEYS if k in row}} for row in history]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as output_dir:
        for mode in ("dense", "delta"):
            rows[mode] = run(args.model, args.steps, args.lr, mode == "delta", output_dir)
    later = {mode: [r for r in rows[mode] if r["step"] > 1] for mode in rows}  # step 1's refit is dense in both
    summary = {mode: {"refit_s": statistics.median(r["timing/refit_transfer"] for r in later[mode]),
                      "bytes": statistics.median(r.get("refit/delta_bytes", r["refit/bytes"]) for r in later[mode])}
               for mode in later}
    summary["delta_over_dense"] = {k: summary["delta"][k] / summary["dense"][k] for k in ("refit_s", "bytes")}
    print(json.dumps(summary, indent=1))
    for mode in rows:
        for r in rows[mode]:
            print(mode, json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model.rstrip("/").split("/")[-1], "lr": args.lr, "steps": rows,
                       "median_of_later_steps": summary}, f, indent=1)


if __name__ == "__main__":
    main()
