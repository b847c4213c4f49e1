"""Learning-rate schedules: warmup, then constant, linear or cosine decay to lr * min_ratio at the
last optimizer step; and their config errors."""

import math

import pytest

from rlkit.algorithms.lr_schedule import LearningRateSchedule
from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config


def test_warmup_then_constant():
    lr = LearningRateSchedule(1.0, total_steps=10, warmup_steps=4)
    assert [lr(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decay_ends_at_the_minimum_on_the_last_step():
    lr = LearningRateSchedule(2.0, total_steps=7, kind="linear", warmup_steps=2, min_ratio=0.1)
    assert [lr(s) for s in range(7)] == pytest.approx([1.0, 2.0, 2.0, 1.55, 1.1, 0.65, 0.2])
    assert lr(100) == pytest.approx(0.2)  # past the end it stays at the minimum


def test_cosine_decay_is_half_way_at_the_middle():
    lr = LearningRateSchedule(1.0, total_steps=11, kind="cosine")
    assert lr(0) == 1.0 and lr(5) == pytest.approx(0.5) and lr(10) == pytest.approx(0.0, abs=1e-12)
    assert lr(2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.2)))


def test_one_step_runs_decay_straight_to_the_minimum():
    assert LearningRateSchedule(1.0, total_steps=1, kind="cosine", min_ratio=0.3)(0) == pytest.approx(0.3)


@pytest.mark.parametrize("override, fragment", [("policy.optimizer.lr_schedule=step", "must be one of"),
                                                ("policy.optimizer.warmup_steps=-1",
                                                 "policy.optimizer.warmup_steps: must be >= 0"),
                                                ("policy.optimizer.min_lr_ratio=1.5",
                                                 "policy.optimizer.min_lr_ratio: must lie in [0, 1]")])
def test_bad_schedules_are_config_errors(override, fragment):
    with pytest.raises(ConfigError, match="^policy.optimizer") as error:
        load_config("grpo_tiny_cpu", [override])
    assert fragment in str(error.value)
