"""Virtual pipeline stages (policy.virtual_pipeline_parallel_size=2 at PP=2: each rank holds two
chunks of one layer of a 4-layer tiny Qwen2, run by Megatron's interleaved schedule) give what one
rank holding every layer gives: the checkpoint exported bit for bit, in the refit plan's order;
logprobs with a micro-batch count that is a multiple of PP and one that is not; one SFT step (its
loss, gradient norm and the weights after it); and a distributed checkpoint of the trained chunks
that loads back into new workers bit for bit.

Tolerance 1e-5 as in test_policy_parity.py (fp32; the stages add the same numbers in the same
order, so the measured differences are far below it)."""

import pytest
import ray
import torch
from safetensors.torch import load_file

from rlkit.algorithms.objectives import NextTokenNLL
from rlkit.data.batch import Batch, batch_totals
from rlkit.models.resolve import resolve_model_dir
from rlkit.workers.policy.megatron import MegatronModelWorker as Policy

pytestmark = pytest.mark.integration
TOLERANCE = 1e-5
FOUR_LAYERS = ["policy.tiny_model.num_layers=4", "policy.micro_batch_size=4", "policy.train_global_batch_size=8"]
LAYOUTS = {"pp1": ["policy.num_workers=1"],
           "pp2-vpp2": ["policy.num_workers=2", "policy.pipeline_parallel_size=2",
                        "policy.virtual_pipeline_parallel_size=2"]}


def _rows(count: int, seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, 300, (count, 11), generator=g)
    mask = torch.zeros(count, 11)
    for row in range(count):
        mask[row, 1:int(torch.randint(4, 12, (1,), generator=g))] = 1.0
    return Batch({"input_ids": input_ids, "loss_mask": mask})


@pytest.fixture(scope="module")
def runs(model_workers, make_cfg, tmp_path_factory) -> dict[str, dict]:
    """Per layout: the export before training, logprobs of 8 rows (two micro-batches of 4) and of 12
    (three), the step's metrics, the weights and logprobs after; and what a fresh set of workers
    holds after loading the trained layout's distributed checkpoint."""
    rows, twelve = _rows(8, 0), _rows(12, 1)
    results = {}
    for name, layout in LAYOUTS.items():
        cfg, _ = make_cfg(*layout, *FOUR_LAYERS)
        model_dir = resolve_model_dir(cfg)
        policy = model_workers.start(cfg, model_dir)
        chunks = ray.get([actor.__ray_call__.remote(lambda worker: len(worker.model)) for actor in policy.workers.actors])
        assert chunks == [2, 2] if "vpp2" in name else [1], (name, chunks)
        results[name] = {"model_dir": model_dir, "manifest": policy.workers.every_rank(Policy.refit_manifest)[0],
                         "exported": policy.export_hf_weights(), "logprobs": policy.logprobs(rows),
                         "logprobs of 12": policy.logprobs(twelve),
                         "step": policy.train(rows, batch_totals(rows["loss_mask"]), NextTokenNLL()),
                         "weights": policy.export_hf_weights(), "logprobs after": policy.logprobs(rows)}
        checkpoint = tmp_path_factory.mktemp(f"dist_{name}")
        policy.save_checkpoint(str(checkpoint), "dist")
        policy.finish_checkpoint(wait=True)
        reloaded = model_workers.start(cfg, model_dir)
        reloaded.load_checkpoint(str(checkpoint), "dist")
        results[name]["reloaded"] = reloaded.export_hf_weights()
    return results


def test_the_export_is_the_checkpoint_bit_for_bit_in_the_refit_plan_order(runs):
    for name, run in runs.items():
        checkpoint = load_file(run["model_dir"] / "model.safetensors")
        assert [n for n, _, _ in run["manifest"]] == list(run["exported"]), name
        assert set(run["exported"]) == set(checkpoint), name
        for tensor_name, tensor in checkpoint.items():
            assert torch.equal(run["exported"][tensor_name], tensor), (name, tensor_name)


def test_logprobs_match_one_rank(runs):
    for field in ["logprobs", "logprobs of 12"]:
        assert (runs["pp2-vpp2"][field] - runs["pp1"][field]).abs().max().item() < TOLERANCE, field


def test_a_train_step_matches_one_rank(runs):
    one, virtual = runs["pp1"], runs["pp2-vpp2"]
    assert virtual["step"]["loss"] == pytest.approx(one["step"]["loss"], abs=TOLERANCE)
    assert virtual["step"]["grad_norm"] == pytest.approx(one["step"]["grad_norm"], rel=TOLERANCE)
    for name, weight in one["weights"].items():
        assert (virtual["weights"][name] - weight).abs().max().item() < TOLERANCE, name
    assert (virtual["logprobs after"] - one["logprobs after"]).abs().max().item() < TOLERANCE
    assert (one["logprobs after"] - one["logprobs"]).abs().max().item() > 100 * TOLERANCE  # the step did move them


def test_a_dist_checkpoint_of_virtual_stages_loads_back_bit_for_bit(runs):
    for name, run in runs.items():
        assert run["reloaded"].keys() == run["weights"].keys(), name
        for tensor_name, weight in run["weights"].items():
            assert torch.equal(run["reloaded"][tensor_name], weight), (name, tensor_name)
