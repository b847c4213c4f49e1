"""A policy loss of one's own trains: two GRPO steps on the tiny CPU recipe with the loss that
tests/unit/test_loss_door.py defines, named as a user names theirs (algorithm.policy_loss=
module:attribute, its module found from the directory the run starts in: the repository root, where
pytest runs). The policy workers import it by that name and minimise it: its own sum comes back as
train/pushed_tokens, and the clipped loss's clip fraction does not."""

import pytest

from rlkit.launch.run import train

pytestmark = pytest.mark.integration

LOSS = "tests.unit.test_loss_door:gpg_loss"
REWARD = "tests.integration.test_own_policy_loss.odd_length"  # environments are named by dotted path


def odd_length(response: str, metadata: dict) -> float:
    """A reward a random model earns half the time, so groups differ and advantages are not 0."""
    return float(len(response) % 2)


def test_a_loss_of_ones_own_trains_two_grpo_steps(make_cfg, warm_pool):
    cfg, resolved = make_cfg(f"algorithm.policy_loss={LOSS}", f"env._target_={REWARD}", "run.name=own_policy_loss",
                             "checkpoint.enabled=false", "algorithm.num_steps=2", "algorithm.val_before_training=false",
                             "algorithm.val_every=2", "algorithm.prompts_per_step=8", "algorithm.group_size=4",
                             "policy.train_global_batch_size=16", "policy.micro_batch_size=4")
    history = train(cfg, resolved, pool=warm_pool).history
    assert [m["step"] for m in history] == [1, 2]
    for metrics in history:
        assert 0 < metrics["train/pushed_tokens"] <= 1 and "train/clip_fraction" not in metrics
        assert metrics["train/grad_norm"] > 0
