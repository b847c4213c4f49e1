"""grpo_advantages against hand-computed numbers and an explicit per-group loop reference."""

import math

import pytest
import torch

from rlkit.algorithms.advantages import ADVANTAGE_ESTIMATORS, grpo_advantages

EPS = 1e-6


def reference_grpo(rewards: list[float], group_size: int, normalize_std: bool) -> list[float]:
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))  # unbiased
        for r in group:
            out.append((r - mean) / (std + EPS) if normalize_std else r - mean)
    return out


def test_hand_computed_std_normalized():
    # groups [1, 0] and [0, 1]: mean 0.5, unbiased std sqrt(0.5) -> +-0.5 / 0.7071 = +-0.7071
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    torch.testing.assert_close(adv, torch.tensor([0.70710678, -0.70710678, -0.70710678, 0.70710678]),
                               atol=1e-5, rtol=0)


def test_hand_computed_dr_grpo():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2, normalize_std=False)
    assert adv.tolist() == [0.5, -0.5, -0.5, 0.5]


def test_hand_computed_group_of_three_with_an_equal_group():
    rewards = torch.tensor([3.0, 1.0, 2.0, 5.0, 5.0, 5.0])  # group 1: mean 2, std 1; group 2: all equal
    torch.testing.assert_close(grpo_advantages(rewards, 3), torch.tensor([1.0, -1.0, 0.0, 0.0, 0.0, 0.0]),
                               atol=1e-5, rtol=0)
    assert grpo_advantages(rewards, 3, normalize_std=False).tolist() == [1.0, -1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_matches_loop_reference(group_size, normalize_std):
    gen = torch.Generator().manual_seed(group_size)
    rewards = torch.randn(5 * group_size, generator=gen)
    expected = reference_grpo(rewards.tolist(), group_size, normalize_std)
    actual = grpo_advantages(rewards, group_size, normalize_std=normalize_std)
    assert actual.dtype == torch.float32 and actual.shape == (5 * group_size,)
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-5, rtol=1e-5)


def test_integer_rewards_are_accepted():
    adv = grpo_advantages(torch.tensor([1, 0, 0, 1]), group_size=2, normalize_std=False)
    assert adv.dtype == torch.float32 and adv.tolist() == [0.5, -0.5, -0.5, 0.5]


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.5, -2.0])
def test_equal_rewards_give_zero_advantage(value, normalize_std):
    adv = grpo_advantages(torch.full((8,), value), group_size=4, normalize_std=normalize_std)
    assert torch.isfinite(adv).all()
    assert adv.tolist() == [0.0] * 8


@pytest.mark.parametrize("value", [0.1, 0.7])
def test_equal_non_dyadic_rewards_give_zero_advantage(value):
    # BUG: in float32 the mean of eight copies of 0.1 is not exactly 0.1, so every sample is
    # centered to the same ~7e-9, the std of those equal residuals is ~8e-9, and dividing
    # by (std + 1e-6) blows it up to a uniform ~-0.0074 (0.7: ~0.056) instead of 0.
    rewards = torch.full((8,), value)
    assert grpo_advantages(rewards, 8, normalize_std=False).abs().max() < 1e-6  # Dr.GRPO: fine
    adv = grpo_advantages(rewards, 8)
    assert adv.abs().max() < 1e-6, f"equal rewards {value} gave advantages {adv.tolist()}, expected 0"


@pytest.mark.parametrize("group_size", [3, 5])
def test_group_size_not_dividing_raises(group_size):
    with pytest.raises(ValueError, match="groups of"):
        grpo_advantages(torch.zeros(4), group_size)


def test_group_size_zero_raises_value_error():
    # BUG: `rewards.numel() % 0` raises ZeroDivisionError before the ValueError check.
    with pytest.raises(ValueError):
        grpo_advantages(torch.zeros(4), 0)


def test_group_size_one_is_rejected_or_zero_not_nan():
    # BUG: a group of one sample has an undefined unbiased std; the result is NaN, which
    # would silently poison the loss. Expected: a ValueError or advantage 0.
    try:
        adv = grpo_advantages(torch.tensor([1.0, 0.0]), 1)
    except ValueError:
        return
    assert torch.isfinite(adv).all(), f"group_size=1 gave {adv.tolist()}"


def test_registry():
    assert ADVANTAGE_ESTIMATORS["grpo"] is grpo_advantages
