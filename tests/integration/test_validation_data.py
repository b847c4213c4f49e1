"""data.val_path=null skips validation, on real workers: a 2-step RL run (GRPO, validating before
training and at its last step in the recipe) and a 2-step SFT run train, checkpoint their last step
and log no validation metric. Each used to stop at its first validation (`max() arg is an empty
sequence` in GRPO), or at its last step before the final checkpoint."""

import pytest

from rlkit.launch import run as launch
from rlkit.launch.config import load_config

pytestmark = pytest.mark.integration

TWO_STEPS = ("algorithm.num_steps=2", "algorithm.val_every=1", "data.val_path=null", "logger.plots=false")
TINY_GRPO_STEP = ("algorithm.prompts_per_step=4", "algorithm.group_size=4", "policy.train_global_batch_size=16",
                  "policy.micro_batch_size=4", "algorithm.warm_start.sft_steps=0")


@pytest.mark.parametrize("recipe, overrides", [("grpo_tiny_cpu", TINY_GRPO_STEP), ("sft_tiny_cpu", ())],
                         ids=["grpo", "sft"])
def test_null_val_path_trains_and_checkpoints_without_validating(warm_pool, cache_dir, tmp_path, caplog, recipe,
                                                                  overrides):
    with caplog.at_level("INFO", logger="rlkit"):
        cfg, resolved = load_config(recipe, [f"run.cache_dir={cache_dir}", f"run.output_dir={tmp_path}",
                                             *TWO_STEPS, *overrides])
        result = launch.train(cfg, resolved, pool=warm_pool)
    assert any("data.val_path=null: validation is skipped" in line for line in caplog.messages[:3]), caplog.messages[:3]
    assert [m["step"] for m in result.history] == [1, 2]
    assert not [k for m in result.history for k in m if k.startswith("val/")]
    assert (result.run_dir / "checkpoints" / "step_000002").is_dir()
