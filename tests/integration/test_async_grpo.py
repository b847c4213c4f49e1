"""Async GRPO (algorithm.max_staleness=2, disaggregated) on a real local Ray cluster: every step
trains on a rollout from the weight version the schedule names, the engines' logprobs then
differ from the trainer's by the staleness, and a run killed with SIGKILL resumes to exactly the
uninterrupted run's metrics, the rollouts generated ahead restored from the checkpoint; with
episodes turn by turn together and each on its own (env_runner.flow)."""

import logging
import sys

import pytest
import torch

from rlkit.algorithms.async_rollouts import PENDING_ROLLOUTS, generation_version
from rlkit.launch.config import load_config
from rlkit.launch.run import train
from run_metrics import last_logged_step
from test_checkpoint import compared, kill_when

pytestmark = pytest.mark.integration
ASYNC = ["algorithm.num_steps=6", "checkpoint.every=2", "algorithm.val_every=3", "algorithm.prompts_per_step=8",
         "policy.train_global_batch_size=64", "algorithm.warm_start.sft_steps=60", "algorithm.kl_coef=0.01",
         "cluster.placement=disaggregated", "algorithm.max_staleness=2", "algorithm.off_policy_correction=token_tis",
         "run.name=grpo_async", "logger.plots=false"]


def train_command(out_dir, cache_dir, flow):
    return [sys.executable, "-m", "rlkit.cli", "train", "--config-name", "grpo_tiny_cpu", *ASYNC,
            f"env_runner.flow={flow}", f"run.output_dir={out_dir}", f"run.cache_dir={cache_dir}"]


def run_config(out_dir, cache_dir, flow):
    """The command's config, for the runs this process makes itself."""
    return load_config("grpo_tiny_cpu", [*ASYNC, f"env_runner.flow={flow}", f"run.output_dir={out_dir}",
                                         f"run.cache_dir={cache_dir}"])


@pytest.fixture(scope="module", params=["per_turn", "per_trajectory"])
def flow(request):
    return request.param


@pytest.fixture(scope="module")
def uninterrupted(warm_pool, tmp_path_factory, cache_dir, flow):
    out = tmp_path_factory.mktemp("async_uninterrupted")
    return train(*run_config(out, cache_dir, flow), pool=warm_pool).run_dir


def test_each_step_trains_on_the_scheduled_weight_version(uninterrupted):
    metrics = compared(uninterrupted / "metrics.jsonl")
    versions = [metrics[step]["train/weight_version"] for step in range(1, 7)]
    assert versions == [generation_version(step, 2) for step in range(1, 7)] == [0, 0, 1, 1, 3, 3]
    assert [metrics[step]["train/staleness"] for step in range(1, 7)] == [0, 1, 1, 2, 1, 2]
    assert all(metrics[step]["train/grad_norm"] > 0.1 for step in range(1, 7))  # every step moves the weights
    # on-policy at step 1 the engine's logprobs are the trainer's up to float noise; a stale
    # rollout's are not, and the truncated importance weights see it
    assert metrics[1]["refit/logprob_abs_error_max"] < 1e-4
    assert metrics[1]["train/importance_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    for step in range(2, 7):
        assert metrics[step]["refit/logprob_abs_error_max"] > 0.1, step
    # a checkpoint holds the rollouts generated ahead of it, from the versions they were made with
    pending = torch.load(uninterrupted / "checkpoints" / "step_000004" / PENDING_ROLLOUTS, weights_only=False)
    assert {step: rollout.weight_version for step, rollout in pending.items()} == {5: 3, 6: 3}


def test_sigkill_then_resume_matches_uninterrupted(uninterrupted, warm_pool, tmp_path, cache_dir, flow, caplog):
    """Killed after step 3: the rollouts of steps 3 and 4 were generated ahead (from version 1)
    and saved with step 2's checkpoint; the resumed run (the same command, here in this process on
    the pool's workers: see test_checkpoint.resumed) trains on them, then goes on."""
    run_dir = tmp_path / "grpo_async"
    kill_when(train_command(tmp_path, cache_dir, flow), lambda: last_logged_step(run_dir) >= 3, "after step 3",
              tmp_path / "run.log")
    with caplog.at_level(logging.INFO, logger="rlkit"):
        train(*run_config(tmp_path, cache_dir, flow), pool=warm_pool)
    assert "continuing after step 2" in caplog.text
    assert compared(run_dir / "metrics.jsonl") == compared(uninterrupted / "metrics.jsonl")
