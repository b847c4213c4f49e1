"""How sparse delta refit's buckets are on a real model: an HF checkpoint trained by Adam in fp32
(SFT steps on generated GSM8K-format word problems at an RL learning rate), exported in bf16
through a RefitPlan after every step and encoded by refit.delta's sender against the version
before. Prints and writes, per step, the fraction of bf16 elements that changed, the bytes a
delta refit sends against a dense one, and the seconds encoding took (CPU or GPU, where it runs).

    python benchmarks/delta_sparsity.py --model <HF dir> --steps 5 --lr 1e-5 --out delta.json
"""

import argparse
import json
import random
import time

import torch

from rlkit.config.schema import ArithmeticSetConfig
from rlkit.data.word_problems import word_problem
from rlkit.refit.delta import DeltaSender
from rlkit.refit.plan import RefitPlan


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--out")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    weights = dict(model.named_parameters())  # tied weights once, as the exporter sends them
    plan = RefitPlan.build([(n, tuple(t.shape), "float32") for n, t in weights.items()],
                           int(args.bucket_mb * 2**20), transfer_dtype="bfloat16")
    sender, rng = DeltaSender(), random.Random(0)
    problems = ArithmeticSetConfig(train_size=1, val_size=1, max_operand=20, operations=["+", "-"], seed=0)

    def refit(base_held: bool) -> dict:
        sender.begin(plan, base_held)
        for bucket in plan.buckets:
            packed = plan.pack(bucket.index, {s.name: [(weights[s.name].detach(), 0)] for s in bucket.slots},
                               with_checksum=False, zero_padding=True)
            sender.encode(packed)
        return sender.metrics()

    rows = [{"step": 0, **refit(base_held=False)}]
    for step in range(1, args.steps + 1):
        rows_text = [word_problem(rng, problems) for _ in range(args.batch)]
        texts = [f"{r['question']}\n{r['answer']}" for r in rows_text]
        batch = tokenizer(texts, return_tensors="pt", padding=True).to(device)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        start = time.perf_counter()
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        trained = time.perf_counter() - start
        rows.append({"step": step, "loss": loss.item(), "train_seconds": trained, **refit(base_held=True)})
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"model": args.model.rstrip("/").split("/")[-1], "device": device, "lr": args.lr,
                       "batch": args.batch, "bucket_mb": args.bucket_mb, "buckets": len(plan.buckets),
                       "steps": rows}, f, indent=1)


if __name__ == "__main__":
    main()
