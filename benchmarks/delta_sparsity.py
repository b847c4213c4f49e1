"""How sparse delta refit's buckets are on a real model: the weights of successive training
steps, exported in bf16 through a RefitPlan and encoded by refit.delta's sender against the
version before. Prints and writes, per step, the fraction of bf16 elements that changed, the
bytes a delta refit sends against a dense one, and the seconds encoding took (CPU or GPU, where
it runs). The steps are either

  a real run's: the HF weights of every checkpoint of an `rlkit train` run saved with
  checkpoint.save_format=hf checkpoint.every=1 checkpoint.keep_last=0 (what its refits sent):
    python benchmarks/delta_sparsity.py --checkpoints outputs/<run>/checkpoints --out delta.json

  or SFT steps by Adam in fp32 on generated GSM8K-format word problems at an RL learning rate:
    python benchmarks/delta_sparsity.py --model <HF dir> --steps 5 --lr 1e-5 --out delta.json
"""

import argparse
import json
import random
import time
from pathlib import Path

import torch

from rlkit.config.schema import ArithmeticSetConfig
from rlkit.data.word_problems import word_problem
from rlkit.refit.delta import DeltaSender
from rlkit.refit.plan import RefitPlan


class DeltaMeter:
    """refit.delta's sender over one plan of `weights`' names and shapes (bf16 on the wire)."""

    def __init__(self, weights: dict[str, torch.Tensor], bucket_mb: float):
        self.plan = RefitPlan.build([(n, tuple(t.shape), "float32") for n, t in weights.items()],
                                    int(bucket_mb * 2**20), transfer_dtype="bfloat16")
        self.sender = DeltaSender()

    def refit(self, weights: dict[str, torch.Tensor], base_held: bool) -> dict:
        self.sender.begin(self.plan, base_held)
        for bucket in self.plan.buckets:
            packed = self.plan.pack(bucket.index, {s.name: [(weights[s.name].detach(), 0)] for s in bucket.slots},
                                    with_checksum=False, zero_padding=True)
            self.sender.encode(packed)
        return self.sender.metrics()


def _print_row(row: dict) -> None:
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)


def checkpoint_steps(checkpoints: Path, device: str):
    """(step, {HF name: tensor}) of every complete checkpoint under `checkpoints`, oldest first."""
    from safetensors.torch import load_file

    steps = sorted(p for p in checkpoints.glob("step_[0-9]*") if p.name[5:].isdigit())
    if len(steps) < 2:
        raise SystemExit(f"--checkpoints: {checkpoints} holds {len(steps)} complete checkpoints; a delta needs two "
                         "(train with checkpoint.save_format=hf checkpoint.every=1 checkpoint.keep_last=0)")
    for step_dir in steps:
        files = sorted((step_dir / "policy" / "hf").glob("*.safetensors"))
        if not files:
            raise SystemExit(f"--checkpoints: {step_dir} has no policy/hf/*.safetensors; the run must save "
                             "checkpoint.save_format=hf")
        weights = {}
        for file in files:
            weights.update(load_file(file, device=device))
        yield int(step_dir.name[5:]), weights


def from_checkpoints(args, device: str) -> tuple[dict, list[dict]]:
    rows, meter = [], None
    for step, weights in checkpoint_steps(Path(args.checkpoints), device):
        meter = meter or DeltaMeter(weights, args.bucket_mb)
        rows.append({"step": step, **meter.refit(weights, base_held=bool(rows))})
        _print_row(rows[-1])
    return {"checkpoints": str(args.checkpoints), "buckets": len(meter.plan.buckets)}, rows


def word_problem_texts(rng: random.Random, rows: int) -> list[str]:
    """`rows` generated word problems, each with its worked answer, as next-token training text."""
    problems = ArithmeticSetConfig(train_size=1, val_size=1, max_operand=20, operations=["+", "-"], seed=0)
    return [f"{p['question']}\n{p['answer']}" for p in (word_problem(rng, problems) for _ in range(rows))]


def from_sft(args, device: str) -> tuple[dict, list[dict]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    weights = dict(model.named_parameters())  # tied weights once, as the exporter sends them
    meter, rng = DeltaMeter(weights, args.bucket_mb), random.Random(0)
    rows = [{"step": 0, **meter.refit(weights, base_held=False)}]
    for step in range(1, args.steps + 1):
        batch = tokenizer(word_problem_texts(rng, args.batch), return_tensors="pt", padding=True).to(device)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        start = time.perf_counter()
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        trained = time.perf_counter() - start
        rows.append({"step": step, "loss": loss.item(), "train_seconds": trained, **meter.refit(weights, True)})
        _print_row(rows[-1])
    source = {"model": args.model.rstrip("/").split("/")[-1], "lr": args.lr, "batch": args.batch,
              "buckets": len(meter.plan.buckets)}
    return source, rows


def main():
    parser = argparse.ArgumentParser()
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoints", help="a run's checkpoints directory (HF format, one per step)")
    source.add_argument("--model", help="an HF model directory, trained here by SFT steps")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    described, rows = (from_checkpoints if args.checkpoints else from_sft)(args, device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**described, "device": device, "bucket_mb": args.bucket_mb, "steps": rows}, f, indent=1)


if __name__ == "__main__":
    main()
