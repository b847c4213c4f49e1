"""vLLM behind rlkit: refit is bit-exact through CUDA IPC (colocated) and NCCL
(disaggregated), generation logprobs match the trainer's, and GRPO runs end to end."""

import math

import pytest
import torch

from rlkit.algorithms.grpo import run_grpo
from rlkit.cluster.setup import start_workers
from rlkit.models.resolve import resolve_model_dir
from rlkit.refit.plan import RefitPlan, bucket_checksum
from rlkit.refit.transports import TRANSPORTS


def needs_gpus(n: int):
    return pytest.mark.skipif(torch.cuda.device_count() < n, reason=f"needs {n} GPUs")


COLOCATED = ["cluster.placement=colocated", "refit=cuda_ipc"]
DISAGGREGATED = ["cluster.placement=disaggregated", "refit=nccl"]
LAYOUTS = [pytest.param(COLOCATED, id="cuda_ipc"), pytest.param(DISAGGREGATED, id="nccl", marks=needs_gpus(2))]


def _expected_vllm_tensor(name: str, exported: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tensor vLLM should hold under `name`, from the policy's HF-named export."""
    fused = {".qkv_proj.": ("q_proj", "k_proj", "v_proj"), ".gate_up_proj.": ("gate_proj", "up_proj")}
    for marker, parts in fused.items():
        if marker in name:
            return torch.cat([exported[name.replace(marker.strip("."), p)] for p in parts])
    if name == "lm_head.weight" and name not in exported:  # tied embeddings
        return exported["model.embed_tokens.weight"]
    return exported[name]


@pytest.fixture(scope="module", params=LAYOUTS)
def refit_setup(request, ray_cluster, make_cfg):
    """Policy + vLLM workers and a many-bucket plan, shared by the refit checks of one transport."""
    cfg, _ = make_cfg(*request.param, "refit.bucket_mb=0.25")  # many buckets for the tiny model
    model_dir = resolve_model_dir(cfg)
    workers = start_workers(cfg, str(model_dir))
    plan = RefitPlan.build(workers.policy.rank0("refit_manifest"), int(cfg.refit.bucket_mb * 2**20),
                           transfer_dtype="bfloat16")
    transport = TRANSPORTS[cfg.refit.transport](workers.policy, workers.generation, workers.placement_group)
    workers.generation.call("wake")
    yield workers, plan, transport, model_dir
    workers.shutdown()


def test_refit_is_bit_exact(refit_setup):
    workers, plan, transport, _ = refit_setup
    for _ in range(2):  # the second round reuses buffers and the communicator
        metrics = transport(plan, True)
    assert metrics["refit/buckets"] == len(plan.buckets) > 1
    exported = workers.policy.rank0("export_hf_weights")
    for checksums in workers.generation.call("weight_checksums"):
        for name, checksum in checksums.items():
            expected = _expected_vllm_tensor(name, exported).cuda().contiguous()
            assert checksum == bucket_checksum(expected.view(-1).view(torch.uint8)), name


def test_generation_logprobs_match_policy(refit_setup):
    """token_mult_prob_error after a refit, on sampled answers to held-out prompts."""
    from transformers import AutoTokenizer

    from rlkit.data.rollout import rollout_batch
    from rlkit.refit.verify import logprob_error
    from rlkit.workers.generation.base import SamplingParams

    workers, plan, transport, model_dir = refit_setup
    transport(plan, True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer(f"{a}+{b}=")["input_ids"] for a in range(8) for b in range(8)]
    generations = workers.generation.generate(prompt_ids, SamplingParams(16, 1.0, 1.0, 0, seed=0))
    rollout = rollout_batch(prompt_ids, generations, tokenizer.pad_token_id)
    metrics = logprob_error(workers.policy.logprobs(rollout), rollout["generation_logprobs"], rollout["response_mask"])
    print(f"logprob error after refit: {metrics}")
    assert metrics["refit/token_mult_prob_error"] <= 1.05


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grpo_with_vllm(ray_cluster, make_cfg, layout):
    cfg, resolved = make_cfg(*layout, "algorithm.num_steps=3", "algorithm.val_every=3",
                             "algorithm.warm_start.sft_steps=20", f"run.name=gpu_{layout[1]}")
    result = run_grpo(cfg, resolved)
    assert len(result.history) == 4
    for metrics in result.history[1:]:
        assert all(math.isfinite(metrics[k]) for k in ["train/reward", "train/grad_norm", "train/entropy"])
        assert metrics["refit/token_mult_prob_error"] <= 1.05
    print(f"GRPO {cfg.refit.transport}: " + ", ".join(
        f"step {i}: reward {m['train/reward']:.3f} mult_err {m['refit/token_mult_prob_error']:.4f}"
        for i, m in enumerate(result.history[1:], 1)))


@needs_gpus(2)
@pytest.mark.parametrize("layout", [["policy.tensor_parallel_size=2"], ["policy.pipeline_parallel_size=2"]],
                         ids=["tp2", "pp2"])
def test_megatron_nccl_parallel_train_step(ray_cluster, make_cfg, layout):
    """Megatron on NCCL, bf16, DDP + distributed optimizer at TP=2 / PP=2 over 2 GPUs: logprobs
    match TP=1 and a train step runs."""
    from rlkit.algorithms.losses import batch_totals
    from rlkit.data.batch import Batch

    g = torch.Generator().manual_seed(0)
    batch = Batch({"input_ids": torch.randint(0, 300, (16, 12), generator=g)})
    results = {}
    for name, overrides in [("ref", ["policy.num_workers=1"]), ("par", ["policy.num_workers=2", *layout])]:
        cfg, _ = make_cfg(*DISAGGREGATED, *overrides, "policy.micro_batch_size=4")
        workers = start_workers(cfg, str(resolve_model_dir(cfg)), with_generation=False)
        try:
            results[name] = workers.policy.logprobs(batch)
            mask = torch.ones(16, 12)
            metrics = workers.policy.train(batch.with_fields(loss_mask=mask), batch_totals(mask), "sft")
            assert math.isfinite(metrics["loss"]) and metrics["grad_norm"] > 0
        finally:
            workers.shutdown()
    # bf16 forward passes with different reduction orders: within a few bf16 ulps of logprob
    assert (results["ref"] - results["par"]).abs().max().item() < 0.1
