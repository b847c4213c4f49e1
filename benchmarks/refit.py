"""Refit time and effective GB/s for Qwen3-shaped ~1.5B and ~7B models, both GPU transports,
next to the hardware limits measured in the same run.

  python benchmarks/refit.py --sizes 1.5b,7b --out refit.json

cuda_ipc: policy and vLLM colocated on GPU 0, ratio against device copy bandwidth.
nccl:     policy on GPU 0, vLLM on GPU 1, ratio against NCCL broadcast bandwidth.
TRANSPORTS names the layouts of several GPUs (two engines, an engine of two GPUs).
A refit is the whole thing: export from Megatron, packing, transport, loading into vLLM.
nccl-delta: refit.delta over nccl; before each timed refit --changed of every policy weight's
elements change (a training step's worth), and the delta's bytes, share and encode/apply seconds
are reported beside the time (compare with nccl, the dense refit, in the same run).
Each bucket size (--bucket-mb) is measured on the same workers after one refit that learns the
plan through vLLM's own loader (reported as first_refit_s).

Constrained link (--link-gbit, CPU): dense refit against refit.delta over the object-store
transport, between two Ray nodes whose link is capped (benchmarks/link.py), on a pretrained
model's training steps:

  python benchmarks/refit.py --link-gbit 1,10 --model <SmolLM2-135M-Instruct dir> --steps 5 --out link.json

The policy (Megatron, fp32) sits on one node and an HF generation worker holding bf16 weights on
the other. Each step is one Adam step of next-token loss on generated GSM8K-format word problems
at the GPU recipe's learning rate; after it the weights go across twice, as a delta (against the
version sent before) and dense, each timed; a run of steps per cap, on workers of their own.
"""

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import broadcast_bandwidth, copy_bandwidth, model_checkpoint  # noqa: E402
from link import link_cap, token_env, two_local_nodes  # noqa: E402

TRANSPORTS = {"cuda_ipc": ["cluster.placement=colocated", "refit=cuda_ipc"],
              "nccl": ["cluster.placement=disaggregated", "refit=nccl"],
              # two GPUs, colocated: two policy ranks feed two engines, or one engine spread over both GPUs
              "cuda_ipc-two-engines": ["cluster.placement=colocated", "refit=cuda_ipc", "policy.num_workers=2",
                                       "generation.num_workers=2"],
              "cuda_ipc-tp2-engine": ["cluster.placement=colocated", "refit=cuda_ipc", "policy.num_workers=2",
                                      "generation.num_workers=1", "generation.vllm.tensor_parallel_size=2"],
              # disaggregated: a TP=2 engine on GPUs 1-2 fed by the policy on GPU 0 (three GPUs); two engines
              # (GPUs 2, 3) fed by two policy ranks (GPUs 0, 1), through one communicator or spread (rank i to engine i)
              "nccl-tp2-engine": ["cluster.placement=disaggregated", "refit=nccl",
                                  "generation.vllm.tensor_parallel_size=2"],
              "nccl-two-engines-one-group": ["cluster.placement=disaggregated", "refit=nccl", "policy.num_workers=2",
                                             "generation.num_workers=2", "refit.broadcast_groups=one"],
              "nccl-two-engines-spread": ["cluster.placement=disaggregated", "refit=nccl", "policy.num_workers=2",
                                          "generation.num_workers=2", "refit.broadcast_groups=spread"],
              # refit.delta over nccl: before each timed refit --changed of every weight's elements change
              "nccl-delta": ["cluster.placement=disaggregated", "refit=nccl", "refit.delta=true"]}


def change_weights(workers, fraction: float, seed: int) -> None:
    """A training step's worth of change for a delta refit: `fraction` of every policy parameter's
    elements, chosen at random, scaled by 1 + 2**-6 (a step of a few units in bf16's last place)."""
    import ray
    import torch

    def change(worker):
        generator = torch.Generator(device="cuda").manual_seed(seed + worker.rank)
        with torch.no_grad():
            for param in (p for chunk in worker.model for p in chunk.parameters()):
                flat = param.data.view(-1)
                picked = torch.rand(flat.numel(), device=flat.device, generator=generator) < fraction
                flat[picked] *= 1 + 2**-6

    ray.get([actor.__ray_call__.remote(change) for actor in workers.policy.workers.actors])


def measure(model_dir: Path, transport: str, rounds: int, bucket_mbs: list[int], changed: float = 0.03) -> list[dict]:
    """One set of workers per transport; every bucket size is its own plan on them. With
    refit.delta (nccl-delta) each timed refit follows change_weights(changed)."""
    from rlkit.cluster.setup import start_workers
    from rlkit.launch.config import load_config
    from rlkit.cluster.refit_driver import RefitDriver
    from rlkit.refit.plan import RefitPlan

    cfg, _ = load_config("grpo_tiny_gpu", [f"policy.model_path={model_dir}", *TRANSPORTS[transport],
                                           "refit.verify_checksums=false", "generation.vllm.max_model_len=1024",
                                           "generation.vllm.gpu_memory_utilization=0.3"])
    start = time.perf_counter()
    workers = start_workers(cfg, str(model_dir))
    setup_s = time.perf_counter() - start
    rows = []
    try:
        driver = RefitDriver(cfg, workers.policy, workers.generation, workers.placement_group, sleepers=[])
        refit = driver.transfer
        workers.generation.wake()
        for bucket_mb in bucket_mbs:
            plan = RefitPlan.build(driver.manifest, bucket_mb << 20, transfer_dtype="bfloat16")
            learn_s = refit(plan, False)["timing/refit_transfer"]  # the first refit of a plan goes through vLLM's loader
            results = []
            for round_ in range(rounds):
                if cfg.refit.delta:
                    change_weights(workers, changed, seed=round_)
                results.append(refit(plan, False))
            checked = refit(plan, True)["timing/refit_transfer"]  # with checksums on, for the record
            median = statistics.median(r["timing/refit_transfer"] for r in results)
            agreement = logprob_agreement(workers, model_dir)  # after the checksummed refit
            rows.append({
                "transport": transport, "bucket_mb": bucket_mb, "gbytes": plan.total_bytes / 1e9,
                "buckets": len(plan.buckets), "seconds": median, "gbytes_per_s": plan.total_bytes / median / 1e9,
                # the sender's host time (export, packing); the rest is transport and vLLM's side
                "export_host_s": statistics.median(r["timing/refit_export_host"] for r in results),
                "pack_host_s": statistics.median(r["timing/refit_pack_host"] for r in results),
                "direct_export": results[-1]["refit/direct_export"],
                "replayable_fraction": results[-1]["refit/replayable_fraction"],
                "first_refit_s": learn_s, "seconds_with_checksums": checked, "setup_s": setup_s,
                "token_mult_prob_error": agreement,
                **({"changed": changed,
                    "delta_fraction": statistics.median(r["refit/delta_fraction"] for r in results),
                    "delta_gbytes": statistics.median(r["refit/delta_bytes"] for r in results) / 1e9,
                    "encode_s": statistics.median(r["timing/refit_delta_encode"] for r in results),
                    "apply_s": statistics.median(r["timing/refit_delta_apply"] for r in results)}
                   if cfg.refit.delta else {})})
    finally:
        workers.shutdown()
    return rows


def logprob_agreement(workers, model_dir: Path) -> float:
    """token_mult_prob_error of vLLM's sampled tokens under the policy, after a refit: misplaced
    or stale weights in vLLM would show here, on a random-init model most of all."""
    from transformers import AutoTokenizer

    from rlkit.data.batch import rollout_batch
    from rlkit.observability.logprob_agreement import logprob_error
    from rlkit.data.generation import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(f"{a}+{b}=")["input_ids"] for a in range(4) for b in range(4)]
    rollout = rollout_batch(prompts, workers.generation.generate(prompts, SamplingParams(16, 1.0, 1.0, 0, seed=0)),
                            tokenizer.pad_token_id)
    error = logprob_error(workers.policy.logprobs(rollout), rollout["generation_logprobs"], rollout["response_mask"])
    return error["refit/token_mult_prob_error"]


def word_problem_batch(tokenizer, rng: random.Random, rows: int):
    """`rows` generated word problems with their worked answers, as next-token training rows."""
    from delta_sparsity import word_problem_texts
    from rlkit.data.batch import Batch

    encoded = tokenizer(word_problem_texts(rng, rows), return_tensors="pt", padding=True)
    return Batch({"input_ids": encoded["input_ids"]}), encoded["attention_mask"].float()


def link_refits(model_dir: Path, gbit: float | None, steps: int, bucket_mb: float, lr: float, rows: int) -> list[dict]:
    """One run of `steps` training steps with the link into the generation worker's node capped at
    `gbit` Gbit/s (None: loopback's own speed); per step, the delta refit's and the dense refit's
    figures. Step 0 is the first refit (dense under either)."""
    import ray
    from transformers import AutoTokenizer

    from rlkit.algorithms.objectives import NextTokenNLL
    from rlkit.cluster.refit_driver import ObjectStoreTransfer, RefitDriver
    from rlkit.cluster.setup import start_workers
    from rlkit.data.batch import batch_totals
    from rlkit.launch.config import load_config

    rng, tokenizer = random.Random(0), AutoTokenizer.from_pretrained(model_dir)
    with tempfile.TemporaryDirectory() as logs, two_local_nodes(dict(os.environ), Path(logs)) as address:
        cfg, _ = load_config("grpo_tiny_cpu", [
            f"cluster.address={address}", "cluster.placement=disaggregated", "policy.num_workers=1",
            "generation.num_workers=1", f"policy.model_path={model_dir}", "generation.precision=bf16",
            "refit.delta=true", f"refit.bucket_mb={bucket_mb}", f"policy.optimizer.lr={lr}",
            f"policy.train_global_batch_size={rows}", f"policy.micro_batch_size={rows}"])
        workers = start_workers(cfg, str(model_dir))
        try:
            [engine_node] = set(workers.generation.workers.node_ips())
            driver = RefitDriver(cfg, workers.policy, workers.generation, workers.placement_group, sleepers=[])
            dense = ObjectStoreTransfer(workers.policy, workers.generation)
            results = []
            with link_cap(engine_node, gbit):
                for step in range(steps + 1):
                    trained = {}
                    if step:
                        batch, mask = word_problem_batch(tokenizer, rng, rows)
                        trained = workers.policy.train(batch.with_fields(loss_mask=mask), batch_totals(mask),
                                                       NextTokenNLL())
                    delta, full = driver.push_weights(), dense(driver.plan, driver.verify)
                    results.append({
                        "link_gbit": gbit, "step": step, "loss": trained.get("loss"),
                        "grad_norm": trained.get("grad_norm"), "dense_bytes": full["refit/bytes"],
                        "delta_bytes": delta["refit/delta_bytes"], "delta_fraction": delta["refit/delta_fraction"],
                        "dense_s": full["timing/refit_transfer"], "delta_s": delta["timing/refit_transfer"],
                        "encode_s": delta["timing/refit_delta_encode"], "apply_s": delta["timing/refit_delta_apply"],
                        "buckets": delta["refit/buckets"]})
                    print(json.dumps(results[-1]), flush=True)
            return results
        finally:
            workers.shutdown()
            ray.shutdown()


def link_main(args) -> None:
    os.environ.update(token_env())  # before ray is imported: this driver joins the nodes with their token
    rows = []
    for gbit in args.link_gbit.split(","):
        rows += link_refits(Path(args.model), None if gbit == "none" else float(gbit), args.steps,
                            float(args.bucket_mb), args.lr, args.rows)
        Path(args.out).write_text(json.dumps({"model": Path(args.model).name, "lr": args.lr, "rows": rows}, indent=1))
    print("\n| link Gbit/s | step | changed bf16 elements | delta MB / dense MB | delta refit s | dense refit s "
          "| encode / apply s |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['link_gbit'] or 'loopback'} | {r['step']} | {r['delta_fraction']:.2%} | "
              f"{r['delta_bytes'] / 1e6:.1f} / {r['dense_bytes'] / 1e6:.1f} | {r['delta_s']:.2f} | {r['dense_s']:.2f} | "
              f"{r['encode_s']:.2f} / {r['apply_s']:.2f} |")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1.5b,7b")
    parser.add_argument("--transports", default="cuda_ipc,nccl")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bucket-mb", help="comma-separated, each measured (default 512,2048); --link-gbit: one "
                        "(default 64)")
    parser.add_argument("--checkpoints", default=tempfile.gettempdir() + "/rlkit_bench")
    parser.add_argument("--out", default="refit.json")
    parser.add_argument("--link-gbit", help="constrained-link mode: comma-separated caps in Gbit/s ('none': uncapped)")
    parser.add_argument("--model", help="--link-gbit: an HF model directory (the policy's starting weights)")
    parser.add_argument("--steps", type=int, default=5, help="--link-gbit: training steps per cap")
    parser.add_argument("--lr", type=float, default=1e-5, help="--link-gbit: Adam's learning rate")
    parser.add_argument("--rows", type=int, default=8, help="--link-gbit: word problems per training step")
    parser.add_argument("--changed", type=float, default=0.03, help="nccl-delta: the share of every weight's "
                        "elements changed before each timed refit (3%%: a SmolLM2 GRPO step's, measured on an H100)")
    args = parser.parse_args()
    if args.link_gbit:
        if not args.model:
            parser.error("--link-gbit needs --model, the HF directory of the policy's weights")
        args.bucket_mb = args.bucket_mb or "64"
        return link_main(args)
    args.bucket_mb = args.bucket_mb or "512,2048"
    import ray

    limits = {"copy_gbytes_per_s": copy_bandwidth(), "broadcast_gbytes_per_s": broadcast_bandwidth()}
    print(f"limits: {limits}", flush=True)
    ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1")
    rows = []
    for size in args.sizes.split(","):
        model_dir = model_checkpoint(f"qwen3-{size}", Path(args.checkpoints))
        for transport in args.transports.split(","):
            if transport.startswith("nccl") and limits["broadcast_gbytes_per_s"] is None:
                continue
            bucket_mbs = [int(mb) for mb in args.bucket_mb.split(",")]
            for row in measure(model_dir, transport, args.rounds, bucket_mbs, args.changed):
                limit = limits["copy_gbytes_per_s" if transport.startswith("cuda_ipc") else "broadcast_gbytes_per_s"]
                rows.append({"model": f"qwen3-{size}", **row, "limit_gbytes_per_s": limit,
                             "ratio": row["gbytes_per_s"] / limit})
                print(json.dumps(rows[-1]), flush=True)
                Path(args.out).write_text(json.dumps({"limits": limits, "rows": rows}, indent=1))  # kept if cut short
    print("\n| model | transport | bucket MB | GB | buckets | refit s | export / pack (host) s | GB/s | limit GB/s "
          "| ratio |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['transport']} | {r['bucket_mb']} | {r['gbytes']:.2f} | {r['buckets']} | "
              f"{r['seconds']:.4f} | {r['export_host_s']:.4f} / {r['pack_host_s']:.4f} | {r['gbytes_per_s']:.1f} | "
              f"{r['limit_gbytes_per_s']:.0f} | {r['ratio']:.1%} |")
    print("sender export direct:", {r["direct_export"] for r in rows},
          "| vLLM load replayed:", {r["replayable_fraction"] for r in rows},
          "| token_mult_prob_error:", [round(r["token_mult_prob_error"], 4) for r in rows])
    ray.shutdown()


if __name__ == "__main__":
    main()
