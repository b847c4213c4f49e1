"""vLLM behind rlkit: refit is bit-exact through CUDA IPC (colocated) and NCCL
(disaggregated), and generation logprobs match the trainer's after a refit.

The module-scoped workers hold GPUs until this module ends: tests that need the GPUs for
themselves live in other modules."""


import pytest
import torch

from rlkit.cluster.setup import start_workers
from rlkit.models.resolve import resolve_model_dir
from rlkit.cluster.refit_driver import RefitDriver
from rlkit.refit.plan import bucket_checksum


COLOCATED = ["cluster.placement=colocated", "refit=cuda_ipc"]
DISAGGREGATED = ["cluster.placement=disaggregated", "refit=nccl"]
LAYOUTS = [pytest.param(COLOCATED, id="cuda_ipc"), pytest.param(DISAGGREGATED, id="nccl", marks=pytest.mark.gpus(2))]


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
    driver = RefitDriver(cfg, workers.policy, workers.generation, workers.placement_group, sleepers=[])
    assert driver.plan.buckets[0].slots[0].dtype == "bfloat16"  # generation.precision=bf16: bf16 on the wire
    workers.generation.wake()
    yield workers, driver.plan, driver.transfer, model_dir
    workers.shutdown()


def test_refit_is_bit_exact(refit_setup):
    workers, plan, transport, _ = refit_setup
    for _ in range(2):  # the second round replays vLLM's loader and reuses the communicator
        metrics = transport(plan, True)
    print(f"refit metrics: {metrics}")
    assert metrics["refit/buckets"] == len(plan.buckets) > 1
    # TP=1 policy: rows copied straight from the parameters; every tensor's load replayed
    assert metrics["refit/direct_export"] == 1.0 and metrics["refit/replayable_fraction"] == 1.0
    exported = workers.policy.export_hf_weights()
    for checksums in workers.generation.weight_checksums():
        for name, checksum in checksums.items():
            expected = _expected_vllm_tensor(name, exported).cuda().contiguous()
            assert checksum == bucket_checksum(expected.view(-1).view(torch.uint8)), name


def test_generation_logprobs_match_policy(refit_setup):
    """token_mult_prob_error after a refit, on sampled answers to held-out prompts."""
    from transformers import AutoTokenizer

    from rlkit.data.batch import rollout_batch
    from rlkit.observability.logprob_agreement import logprob_error
    from rlkit.data.generation import SamplingParams

    workers, plan, transport, model_dir = refit_setup
    transport(plan, True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer(f"{a}+{b}=")["input_ids"] for a in range(8) for b in range(8)]
    generations = workers.generation.generate(prompt_ids, SamplingParams(16, 1.0, 1.0, 0, seed=0))
    rollout = rollout_batch(prompt_ids, generations, tokenizer.pad_token_id)
    metrics = logprob_error(workers.policy.logprobs(rollout), rollout["generation_logprobs"], rollout["response_mask"])
    print(f"logprob error after refit: {metrics}")
    assert metrics["refit/token_mult_prob_error"] <= 1.05
