"""benchmarks/async_grpo.py: the overrides of each mode and the summary of a run (pure)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import async_grpo  # noqa: E402


def test_each_mode_is_disaggregated_and_async_ones_are_corrected():
    sync = async_grpo.overrides(0, 12, "nccl", Path("/c"))
    stale = async_grpo.overrides(2, 12, "nccl", Path("/c"))
    assert "cluster.placement=disaggregated" in sync and "refit=nccl" in sync
    assert "algorithm.max_staleness=0" in sync and "algorithm.off_policy_correction=none" in sync
    assert "algorithm.max_staleness=2" in stale and "algorithm.off_policy_correction=token_tis" in stale
    assert "run.cache_dir=/c" in stale and "algorithm.val_every=6" in stale


def test_summary_takes_medians_after_the_first_step_and_keeps_the_curves():
    def step(n, seconds, wait, reward, **more):
        return {"step": n, "timing/step": seconds, "timing/rollout_wait": wait, "train/reward": reward,
                "train/staleness": min(n - 1, 1), **more}
    history = [{"step": 0, "val/accuracy": 0.1, "timing/step": 9.0},
               step(1, 50.0, 40.0, 0.1), step(2, 10.0, 1.0, 0.2), step(3, 14.0, 3.0, 0.3, **{"val/accuracy": 0.3}),
               step(4, 12.0, 2.0, 0.4)]
    summary = async_grpo.summarize(history)
    assert summary["median"]["timing/step"] == 12.0 and summary["median"]["timing/rollout_wait"] == 2.0
    assert summary["median"]["timing/generate"] == 0.0  # a phase the run did not log
    assert summary["train_reward"] == [0.1, 0.2, 0.3, 0.4] and summary["staleness"] == [0, 1, 1, 1]
    assert summary["val_accuracy"] == {0: 0.1, 3: 0.3}
