"""policy.bridge=megatron_bridge (NVIDIA's Megatron-Bridge through rlkit/bridge/megatron_bridge_backend.py):
every architecture rlkit runs loads into Megatron with HF's token logprobs (tolerance as in
test_policy_parity.py) and exports the checkpoint it loaded bit for bit, in the one order the refit
plan was built on; for each architecture (Qwen2 with tied embeddings, Qwen3, Llama, Qwen3-MoE,
GLM-4-MoE) at TP=1, TP=2 and PP=2 (GLM-4-MoE's dense first layer then on one stage, its MoE layer on
the other). A Qwen3 checkpoint with RoPE base 1e6 (transformers 5 keeps it in rope_parameters, the
bridge's config mapping did not: 10000 was used) and GLM-4-MoE (half of each head rotated, from the
same place) check the RoPE settings. A short GRPO run through the launch path trains with it: the
weights move, and the generation workers' logprobs after each refit equal the policy's to float
noise."""

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_policy_parity import TOLERANCE, _hf_logprobs

from rlkit.bridge.base import BRIDGES
from rlkit.data.batch import Batch
from rlkit.launch.run import train
from rlkit.models.resolve import resolve_model_dir
from rlkit.workers.policy.megatron import MegatronModelWorker as Policy

pytestmark = pytest.mark.integration
BRIDGE = "policy.bridge=megatron_bridge"
ROPE_BASE = 1e6
ONE_RANK = ["policy.num_workers=1"]
# a tiny model's 4 attention heads, 2 key/value heads (TINY_HEADS) and 2 layers (policy.tiny_model) split in two
SPLITS = {"tp2": ["policy.num_workers=2", "policy.tensor_parallel_size=2"],
          "pp2": ["policy.num_workers=2", "policy.pipeline_parallel_size=2"]}
# (model: tiny://<arch>, or "rope-base": tiny Qwen3 with RoPE base ROPE_BASE; overrides)
LAYOUTS = {"qwen2-tied-tp1": ("tiny://qwen2", ONE_RANK),
           "qwen3-rope-base-tp1": ("rope-base", ONE_RANK),
           "llama-tp1": ("tiny://llama", ONE_RANK),
           "qwen3-moe-tp1": ("tiny://qwen3_moe", ONE_RANK),
           "glm4-moe-tp1": ("tiny://glm4_moe", ONE_RANK),
           # every architecture the bridge accepts, at each split
           **{f"{arch.replace('_', '-')}-{split}": (f"tiny://{arch}", overrides)
              for arch in BRIDGES["megatron_bridge"].model_types for split, overrides in SPLITS.items()}}


def _rope_base_checkpoint(make_cfg, directory):
    """tiny://qwen3's weights under a config whose RoPE base is ROPE_BASE."""
    cfg, _ = make_cfg("policy.model_path=tiny://qwen3")
    shutil.copytree(resolve_model_dir(cfg), directory)
    config = json.loads((directory / "config.json").read_text())
    assert config["rope_parameters"]["rope_theta"] == 10000.0  # the default, about to change
    config["rope_parameters"]["rope_theta"] = ROPE_BASE
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module", params=list(LAYOUTS))
def bridged(request, model_workers, make_cfg, tmp_path_factory):
    """(model directory, policy workers) of one layout."""
    model, overrides = LAYOUTS[request.param]
    if model == "rope-base":
        model = str(_rope_base_checkpoint(make_cfg, tmp_path_factory.mktemp("rope") / "qwen3"))
    cfg, _ = make_cfg(BRIDGE, f"policy.model_path={model}", *overrides, "policy.micro_batch_size=4")
    model_dir = resolve_model_dir(cfg)
    return model_dir, model_workers.start(cfg, model_dir)


def test_logprobs_match_hf(bridged):
    model_dir, policy = bridged
    input_ids = torch.randint(0, 300, (8, 12), generator=torch.Generator().manual_seed(0))
    reference = _hf_logprobs(model_dir, input_ids)
    logprobs = policy.logprobs(Batch({"input_ids": input_ids}))
    assert logprobs.shape == reference.shape
    assert (logprobs - reference).abs().max().item() < TOLERANCE


def test_export_returns_the_checkpoint_bit_exact_in_the_refit_plan_order(bridged):
    """The refit manifest (the plan's names and order, taken from one export) is the order of a
    later export, and the export is the checkpoint: every tensor, no other (no lm_head where the
    embedding is tied), each bit for bit."""
    model_dir, policy = bridged
    manifest = policy.workers.every_rank(Policy.refit_manifest)[0]
    exported = policy.export_hf_weights()
    checkpoint = load_file(model_dir / "model.safetensors")
    assert [name for name, _, _ in manifest] == list(exported)
    assert set(exported) == set(checkpoint)
    for name, tensor in checkpoint.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name


def test_grpo_trains_through_the_launch_path(warm_pool, make_cfg):
    """Three GRPO steps at DP=2 with HF generation workers and a KL reference (loaded through the
    bridge from the checkpoint directory). A random model earns no reward, so an entropy bonus
    gives the steps a gradient; the checkpoint written at the end (through the bridge's HF save)
    holds other weights than the start."""
    cfg, resolved = make_cfg(BRIDGE, "algorithm.num_steps=3", "algorithm.val_every=10", "algorithm.prompts_per_step=8",
                             "algorithm.group_size=4", "algorithm.entropy_coef=0.01", "algorithm.kl_coef=0.01",
                             "policy.train_global_batch_size=16", "policy.micro_batch_size=4",
                             "generation.num_workers=2", "checkpoint.save_format=hf", "run.name=grpo_megatron_bridge")
    result = train(cfg, resolved, pool=warm_pool)
    assert len(result.history) == 4  # validation before training + 3 steps
    for metrics in result.history[1:]:
        assert math.isfinite(metrics["train/loss"]) and metrics["train/grad_norm"] > 0
        # the generation workers hold exactly the policy's weights after each refit
        assert metrics["refit/logprob_abs_error_max"] < 1e-4
    assert result.history[-1]["train/kl"] > 0  # the policy left the reference
    # refits copied the parameters' rows: at TP=1 the bridge's conversions only move rows (export_rows)
    refits = [metrics["refit/direct_export"] for metrics in result.history if "refit/direct_export" in metrics]
    assert len(refits) >= 3 and set(refits) == {1.0}
    start = load_file(resolve_model_dir(cfg) / "model.safetensors")
    saved = sorted((result.run_dir / "checkpoints").glob("step_*/policy/hf/*.safetensors"))[-1]
    trained = load_file(saved)
    assert set(trained) == set(start)
    moved = [name for name in start if not torch.equal(trained[name], start[name])]
    assert len(moved) > len(start) // 2, moved
