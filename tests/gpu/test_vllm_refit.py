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
TWO_ENGINES = ["policy.num_workers=2", "generation.num_workers=2"]
TP2_ENGINE = ["policy.num_workers=2", "generation.num_workers=1", "generation.vllm.tensor_parallel_size=2"]
ONE_GROUP = ["refit.broadcast_groups=one"]
LAYOUTS = [pytest.param(COLOCATED, id="cuda_ipc"), pytest.param(DISAGGREGATED, id="nccl", marks=pytest.mark.gpus(2)),
           pytest.param(COLOCATED + TWO_ENGINES, id="two-engines-cuda_ipc", marks=pytest.mark.gpus(2)),
           pytest.param(COLOCATED + TP2_ENGINE, id="tp2-engine-cuda_ipc", marks=pytest.mark.gpus(2)),
           # disaggregated: one policy GPU feeds an engine on two more; two policy ranks feed two engines,
           # through one communicator (policy rank 0 to both) or spread (rank i to engine i)
           pytest.param(DISAGGREGATED + ["generation.vllm.tensor_parallel_size=2"], id="tp2-engine-nccl",
                        marks=pytest.mark.gpus(3)),
           pytest.param(DISAGGREGATED + TWO_ENGINES + ONE_GROUP, id="two-engines-nccl-one-group",
                        marks=pytest.mark.gpus(4)),
           pytest.param(DISAGGREGATED + TWO_ENGINES, id="two-engines-nccl-spread", marks=pytest.mark.gpus(4)),
           # refit.delta over nccl, at a learning rate where a step changes few bf16 weights
           pytest.param(DISAGGREGATED + ["refit.delta=true", "policy.optimizer.lr=1e-5"], id="nccl-delta",
                        marks=pytest.mark.gpus(2))]
# vLLM's row-parallel layers split the HF weight's dim 1; the other layers split dim 0, norms none
ROW_PARALLEL = (".o_proj.", ".down_proj.")


def _expected_vllm_tensor(name: str, exported: dict[str, torch.Tensor], rank: int = 0, gpus: int = 1) -> torch.Tensor:
    """The tensor vLLM's process `rank` of an engine of `gpus` GPUs should hold under `name`,
    from the policy's HF-named export: a fused tensor is its parts' shards side by side."""
    fused = {".qkv_proj.": ("q_proj", "k_proj", "v_proj"), ".gate_up_proj.": ("gate_proj", "up_proj")}
    parts = next(([name.replace(marker.strip("."), p) for p in names] for marker, names in fused.items()
                  if marker in name), [name])
    if name == "lm_head.weight" and name not in exported:  # tied embeddings
        parts = ["model.embed_tokens.weight"]
    tensors = [exported[part] for part in parts]
    if gpus > 1 and "norm" not in name:  # norms are whole on every GPU
        dim = 1 if any(marker in name for marker in ROW_PARALLEL) and tensors[0].dim() > 1 else 0
        tensors = [t.chunk(gpus, dim)[rank] for t in tensors]
    return torch.cat(tensors)


@pytest.fixture(scope="module", params=LAYOUTS)
def refit_setup(request, ray_cluster, make_cfg):
    """Policy + vLLM workers and a many-bucket plan, shared by the refit checks of one transport."""
    cfg, _ = make_cfg(*request.param, "refit.bucket_mb=0.25")  # many buckets for the tiny model
    model_dir = resolve_model_dir(cfg)
    workers = start_workers(cfg, str(model_dir))
    driver = RefitDriver(cfg, workers.policy, workers.generation, workers.placement_group, sleepers=[])
    assert driver.plan.buckets[0].slots[0].dtype == "bfloat16"  # generation.precision=bf16: bf16 on the wire
    workers.generation.wake()
    yield workers, driver.plan, driver.transfer, model_dir, cfg.generation.vllm.tensor_parallel_size
    workers.shutdown()


def test_refit_is_bit_exact(refit_setup):
    workers, plan, transport, _, gpus = refit_setup
    for _ in range(2):  # the second round replays vLLM's loader and reuses the communicator
        metrics = transport(plan, True)
    print(f"refit metrics: {metrics}")
    assert metrics["refit/buckets"] == len(plan.buckets) > 1
    # TP=1 policy: rows copied straight from the parameters; every tensor's load replayed
    assert metrics["refit/direct_export"] == 1.0 and metrics["refit/replayable_fraction"] == 1.0
    _assert_engines_hold_the_export(workers, gpus)


def test_delta_refits_after_training_steps_are_bit_exact(refit_setup):
    """refit.delta (nccl): after each training step the buckets travel as their changed elements,
    and every engine holds exactly the policy's export (a corrupted delta, a restarted receiver:
    tests/unit/test_refit_delta_frames.py)."""
    from rlkit.algorithms.objectives import NextTokenNLL
    from rlkit.data.batch import Batch, batch_totals

    workers, plan, transport, _, gpus = refit_setup
    if not transport.delta:  # the module's workers are per layout: only nccl-delta's send deltas
        pytest.skip("only the nccl-delta layout sends deltas; the others' refits are checked above")
    transport(plan, True)  # the receivers' first copies
    for step in range(2):
        input_ids = torch.randint(0, 300, (8, 16), generator=torch.Generator().manual_seed(step))
        mask = torch.ones(input_ids.shape)
        mask[:, 0] = 0
        workers.policy.train(Batch({"input_ids": input_ids, "loss_mask": mask}), batch_totals(mask), NextTokenNLL())
        metrics = transport(plan, True)
        print(f"delta refit after step {step}: {metrics}")
        assert metrics["refit/delta_redone"] == 0.0
        assert 0 < metrics["refit/delta_bytes"] < 0.5 * metrics["refit/dense_bytes"]
        _assert_engines_hold_the_export(workers, gpus)


def _assert_engines_hold_the_export(workers, gpus: int):
    exported = workers.policy.export_hf_weights()
    checked = 0
    for process, checksums in enumerate(workers.generation.weight_checksums()):
        for name, checksum in checksums.items():
            if gpus > 1 and ("embed_tokens" in name or "lm_head" in name):
                continue  # vocabulary shards are padded to vLLM's multiple of 64 rows
            expected = _expected_vllm_tensor(name, exported, process % gpus, gpus).cuda().contiguous()
            assert checksum == bucket_checksum(expected.view(-1).view(torch.uint8)), (process, name)
            checked += 1
    assert checked > 0


def test_generation_logprobs_match_policy(refit_setup):
    """token_mult_prob_error after a refit, on sampled answers to held-out prompts."""
    from transformers import AutoTokenizer

    from rlkit.data.batch import rollout_batch
    from rlkit.observability.logprob_agreement import logprob_error
    from rlkit.data.generation import SamplingParams

    workers, plan, transport, model_dir, _ = refit_setup
    transport(plan, True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = [tokenizer(f"{a}+{b}=")["input_ids"] for a in range(8) for b in range(8)]
    generations = workers.generation.generate(prompt_ids, SamplingParams(16, 1.0, 1.0, 0, seed=0))
    rollout = rollout_batch(prompt_ids, generations, tokenizer.pad_token_id)
    metrics = logprob_error(workers.policy.logprobs(rollout), rollout["generation_logprobs"], rollout["response_mask"])
    print(f"logprob error after refit: {metrics}")
    assert metrics["refit/token_mult_prob_error"] <= 1.05


def test_a_request_is_sampled_alike_alone_and_beside_others(refit_setup):
    """env_runner.flow=per_trajectory sends requests as trajectories make them: a request's sample
    (its own seed) is the same whatever vLLM batches it with. Its logprobs may differ in the last
    bits (vLLM's kernels are not batch-invariant)."""
    import ray

    from rlkit.data.generation import SamplingParams
    from rlkit.workers.generation.base import GenerationWorker as Engine

    workers, plan, transport, _, _ = refit_setup
    transport(plan, True)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12]]
    params = [SamplingParams(16, 1.0, 1.0, 0, seed=seed) for seed in (11, 22, 33)]
    alone, = ray.get(workers.generation.workers.submit(Engine.generate_requests, prompts[:1], params[:1], ranks=[0]))
    beside, = ray.get(workers.generation.workers.submit(Engine.generate_requests, prompts[::-1], params[::-1],
                                                         ranks=[0]))
    assert beside.token_ids[2] == alone.token_ids[0]
    assert torch.allclose(torch.tensor(beside.logprobs[2]), torch.tensor(alone.logprobs[0]), atol=1e-3)
