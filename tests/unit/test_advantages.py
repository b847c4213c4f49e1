"""Advantage estimators against hand-computed numbers and explicit per-group, per-sequence, per-token
loop references; groups of uneven size (one-sample groups included) given as group ids, and the
registered estimators reading those ids."""

import math

import pytest
import torch

import threading
from types import SimpleNamespace

from rlkit.algorithms import grpo, reinforce_pp, rloo
from rlkit.algorithms.advantages import (explained_variance, gae_advantages, group_centered, group_index,
                                        grpo_advantages, reinforce_pp_advantages, rloo_advantages, whiten)
from token_masks import MASK, with_garbage

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
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2)
    torch.testing.assert_close(adv, torch.tensor([0.70710678, -0.70710678, -0.70710678, 0.70710678]),
                               atol=1e-5, rtol=0)


def test_hand_computed_dr_grpo():
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2, normalize_std=False)
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
    adv = grpo_advantages(torch.tensor([1, 0, 0, 1]), 2, normalize_std=False)
    assert adv.dtype == torch.float32 and adv.tolist() == [0.5, -0.5, -0.5, 0.5]


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.5, -2.0])
def test_equal_rewards_give_zero_advantage(value, normalize_std):
    adv = grpo_advantages(torch.full((8,), value), 4, normalize_std=normalize_std)
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


@pytest.mark.parametrize("estimator", [grpo_advantages, rloo_advantages, group_centered])
def test_group_size_one_gives_exactly_zero_not_nan(estimator):
    # a one-sample group has nothing to compare with (its unbiased std and its leave-one-out
    # baseline are undefined): advantage 0, never NaN
    assert estimator(torch.tensor([1.0, 0.0]), 1).tolist() == [0.0, 0.0]


# ---- groups of uneven size, as group ids -------------------------------------------------------

# groups (by id, samples anywhere): 7 -> [1, 0, 2] at 0, 2, 6 (mean 1, std 1); 3 -> [4, 2] at 1, 4
# (mean 3, std sqrt 2); 5 -> [5] alone at 3; 9 -> [3, 3] at 5, 7 (equal)
UNEVEN_REWARDS = torch.tensor([1.0, 4.0, 0.0, 5.0, 2.0, 3.0, 2.0, 3.0])
UNEVEN_IDS = torch.tensor([7, 3, 7, 5, 3, 9, 7, 9])
SQRT_HALF = math.sqrt(0.5)


@pytest.mark.parametrize("estimator, expected", [
    (lambda r, g: grpo_advantages(r, g), [0.0, SQRT_HALF, -1.0, 0.0, -SQRT_HALF, 0.0, 1.0, 0.0]),
    (lambda r, g: grpo_advantages(r, g, normalize_std=False), [0.0, 1.0, -1.0, 0.0, -1.0, 0.0, 1.0, 0.0]),
    # leave-one-out by hand: 1 - (0 + 2) / 2 = 0, 0 - (1 + 2) / 2 = -1.5, 2 - (1 + 0) / 2 = 1.5; 4 - 2, 2 - 4
    (rloo_advantages, [0.0, 2.0, -1.5, 0.0, -2.0, 0.0, 1.5, 0.0]),
    (group_centered, [0.0, 1.0, -1.0, 0.0, -1.0, 0.0, 1.0, 0.0]),
], ids=["grpo", "dr_grpo", "rloo", "group_centered"])
def test_uneven_groups_hand_computed(estimator, expected):
    adv = estimator(UNEVEN_REWARDS, UNEVEN_IDS)
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=0)
    assert adv[3].item() == 0.0 and adv[5].item() == 0.0 and adv[7].item() == 0.0  # one-sample, equal: exactly 0


def reference_by_ids(rewards: list[float], group_ids: list[int], estimator: str) -> list[float]:
    """Per group by id: GRPO, Dr.GRPO or RLOO; one-sample and equal groups 0."""
    out = []
    for i, r in enumerate(rewards):
        group = [rewards[j] for j, g in enumerate(group_ids) if g == group_ids[i]]
        mean = sum(group) / len(group)
        if len(group) < 2 or len(set(group)) == 1:
            out.append(0.0)
        elif estimator == "rloo":
            out.append(r - (sum(group) - r) / (len(group) - 1))
        elif estimator == "dr_grpo":
            out.append(r - mean)
        else:
            std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
            out.append((r - mean) / (std + EPS))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_uneven_groups_match_loop_reference(seed):
    g = torch.Generator().manual_seed(seed)
    group_ids = torch.randint(0, 9, (40,), generator=g)  # sizes vary, some groups of one, ids shuffled
    rewards = torch.randint(0, 3, (40,), generator=g).float() + 0.1 * torch.randn(40, generator=g).round()
    for name, actual in [("grpo", grpo_advantages(rewards, group_ids)),
                         ("dr_grpo", grpo_advantages(rewards, group_ids, normalize_std=False)),
                         ("rloo", rloo_advantages(rewards, group_ids))]:
        expected = reference_by_ids(rewards.tolist(), group_ids.tolist(), name)
        torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group_size", [2, 3, 8, 16])
def test_uniform_group_ids_give_the_group_size_result_bit_for_bit(group_size):
    """Uniform adjacent groups as ids or as a size: exactly the per-row reductions over
    rewards.view(-1, group_size) that GRPO and RLOO have always computed."""
    rewards = torch.randn(6 * group_size, generator=torch.Generator().manual_seed(group_size))
    ids = torch.arange(6).repeat_interleave(group_size)
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    grpo_view = (centered / (grouped.std(dim=1, keepdim=True) + EPS)).view(-1)
    rloo_view = (centered * (group_size / (group_size - 1))).view(-1)
    for groups in (group_size, ids):
        assert torch.equal(grpo_advantages(rewards, groups), grpo_view)
        assert torch.equal(grpo_advantages(rewards, groups, normalize_std=False), centered.view(-1))
        assert torch.equal(rloo_advantages(rewards, groups), rloo_view)


def test_group_index_from_either_form_and_bad_ids():
    assert group_index(2, 6).tolist() == [0, 0, 1, 1, 2, 2]
    assert group_index(torch.tensor([40, 7, 40, 12]), 4).tolist() == [2, 0, 2, 1]  # sorted ids
    with pytest.raises(ValueError, match="shape \\[3\\]"):
        group_index(torch.tensor([0, 1]), 3)
    with pytest.raises(ValueError, match="integer"):
        group_index(torch.tensor([0.0, 1.0, 1.0]), 3)


def test_reinforce_pp_baseline_centres_uneven_groups():
    # groups [2, 0] and [5] (alone: centred to 0): centred rewards 1, -1, 0, one token each;
    # whitened: mean 0, unbiased std 1
    mask = torch.ones(3, 1)
    adv = reinforce_pp_advantages(torch.tensor([2.0, 0.0, 5.0]), mask, None, 0.0, groups=torch.tensor([4, 4, 1]))
    torch.testing.assert_close(adv, torch.tensor([[1.0], [-1.0], [0.0]]))


def _trainer(algorithm: dict):
    """What a registered estimator touches of the trainer: its algorithm config and the policy's
    held-shard calls, recorded."""
    calls = []
    policy = SimpleNamespace(extend_held=lambda batch: calls.append(batch["advantages"]),
                             estimate_held=lambda estimator, scalar: calls.append(scalar))
    return SimpleNamespace(cfg=SimpleNamespace(algorithm=SimpleNamespace(**algorithm)), policy=policy), calls


@pytest.mark.parametrize("spec, algorithm, expected", [
    (grpo.ALGORITHM, {"group_size": 2, "normalize_std": False}, [0.0, 1.0, -1.0, 0.0, -1.0, 0.0, 1.0, 0.0]),
    (rloo.ALGORITHM, {"group_size": 2}, [0.0, 2.0, -1.5, 0.0, -2.0, 0.0, 1.5, 0.0]),
    (reinforce_pp.ALGORITHM, {"group_size": 2, "baseline": True, "kl_coef": 0.0, "kl_estimator": None,
                              "gamma": 1.0}, [0.0, 1.0, -1.0, 0.0, -1.0, 0.0, 1.0, 0.0]),
], ids=["grpo", "rloo", "reinforce_pp"])
def test_registered_estimators_use_the_rollouts_group_ids_not_group_size(spec, algorithm, expected):
    """The trainer hands each estimator the rollout's group ids; an estimator that assumed
    uniform groups of algorithm.group_size (2 here) would pair the wrong samples."""
    trainer, calls = _trainer(algorithm)
    spec.estimator(trainer, UNEVEN_REWARDS, UNEVEN_IDS)
    torch.testing.assert_close(calls[0], torch.tensor(expected), atol=1e-6, rtol=0)


# ---- token-level estimators: masks and loop references -----------------------------------------

REWARDS = torch.tensor([1.0, -0.5, 0.3, 0.3, 2.0, 0.0])  # groups of 2: the second has equal rewards


def reference_whiten(values: list[list[float]], mask: list[list[float]], eps: float) -> list[list[float]]:
    picked = [v for row, row_mask in zip(values, mask) for v, m in zip(row, row_mask) if m]
    if len(picked) < 2 or min(picked) == max(picked):
        return [[0.0] * len(row) for row in values]
    mean = sum(picked) / len(picked)
    std = math.sqrt(sum((v - mean) ** 2 for v in picked) / (len(picked) - 1))
    return [[(v - mean) / (std + eps) if m else 0.0 for v, m in zip(row, row_mask)]
            for row, row_mask in zip(values, mask)]


def reference_reinforce_pp(rewards, mask, kl, kl_coef, group_size, eps):
    """rewards: [B] list; mask, kl: [B][S] lists (kl may be None)."""
    if group_size is not None:
        centered = []
        for start in range(0, len(rewards), group_size):
            group = rewards[start:start + group_size]
            centered += [r - sum(group) / len(group) for r in group]
        rewards = centered
    returns = []
    for b, row_mask in enumerate(mask):
        token_rewards = [-kl_coef * kl[b][t] if m and kl is not None else 0.0 for t, m in enumerate(row_mask)]
        masked_positions = [t for t, m in enumerate(row_mask) if m]
        if masked_positions:
            token_rewards[masked_positions[-1]] += rewards[b]
        row = []
        for t, m in enumerate(row_mask):
            row.append(sum(token_rewards[u] for u in masked_positions if u >= t) if m else 0.0)
        returns.append(row)
    return reference_whiten(returns, mask, eps)


def reference_gae(rewards, values, mask, gamma, lam):
    """Per row: walk the masked positions backwards; the position after the last is terminal."""
    advantages, returns = [], []
    for row_rewards, row_values, row_mask in zip(rewards, values, mask):
        row_adv, row_ret = [0.0] * len(row_mask), [0.0] * len(row_mask)
        next_value, next_adv = 0.0, 0.0
        for t in reversed(range(len(row_mask))):
            if not row_mask[t]:
                continue
            delta = row_rewards[t] + gamma * next_value - row_values[t]
            row_adv[t] = delta + gamma * lam * next_adv
            row_ret[t] = row_adv[t] + row_values[t]
            next_value, next_adv = row_values[t], row_adv[t]
        advantages.append(row_adv)
        returns.append(row_ret)
    return advantages, returns


# ---- rloo -------------------------------------------------------------------------------------

def reference_rloo(rewards: list[float], group_size: int) -> list[float]:
    out = []
    for start in range(0, len(rewards), group_size):
        group = rewards[start:start + group_size]
        for i, r in enumerate(group):
            others = [group[j] for j in range(len(group)) if j != i]
            out.append(r - sum(others) / len(others))
    return out


def test_rloo_hand_computed():
    assert rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2).tolist() == [1.0, -1.0, -1.0, 1.0]
    # [3, 1, 2]: 3 - 1.5, 1 - 2.5, 2 - 2
    torch.testing.assert_close(rloo_advantages(torch.tensor([3.0, 1.0, 2.0]), 3), torch.tensor([1.5, -1.5, 0.0]))


@pytest.mark.parametrize("group_size", [2, 4, 8])
def test_rloo_matches_loop_reference(group_size):
    rewards = torch.randn(5 * group_size, generator=torch.Generator().manual_seed(group_size))
    actual = rloo_advantages(rewards, group_size)
    assert actual.dtype == torch.float32 and actual.shape == (5 * group_size,)
    torch.testing.assert_close(actual, torch.tensor(reference_rloo(rewards.tolist(), group_size)),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [0.0, 0.1, 0.7, 1 / 3, -2.0])
def test_rloo_equal_rewards_give_exactly_zero(value):
    rewards = torch.cat([torch.full((8,), value), torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])])
    adv = rloo_advantages(rewards, 8)
    assert adv[:8].tolist() == [0.0] * 8
    assert adv[8].item() == pytest.approx(1.0) and adv[9].item() == pytest.approx(-1 / 7)


@pytest.mark.parametrize("group_size", [0, 3])
def test_rloo_bad_group_size_raises(group_size):
    with pytest.raises(ValueError, match="groups of"):
        rloo_advantages(torch.zeros(4), group_size)


# ---- whiten -----------------------------------------------------------------------------------

def test_whiten_matches_loop_reference_and_is_standardized():
    values = 3 * torch.randn(MASK.shape, generator=torch.Generator().manual_seed(3)) + 5
    actual = whiten(with_garbage(values, MASK), MASK)
    torch.testing.assert_close(actual, torch.tensor(reference_whiten(values.tolist(), MASK.tolist(), 1e-8)),
                               atol=1e-5, rtol=1e-5)
    picked = actual[MASK.bool()]
    assert picked.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert picked.std().item() == pytest.approx(1.0, abs=1e-5)  # unbiased
    assert (actual[~MASK.bool()] == 0).all()


@pytest.mark.parametrize("mask", [torch.zeros(2, 3), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])])
def test_whiten_fewer_than_two_entries_gives_zeros(mask):
    values = with_garbage(torch.full((2, 3), 4.0), mask)
    assert whiten(values, mask).tolist() == [[0.0] * 3] * 2


SEVEN_TOKENS = torch.tensor([[0, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 0, 0, 1, 0, 0]],
                            dtype=torch.float32)
THREE_TOKENS = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 0]], dtype=torch.float32)


@pytest.mark.parametrize("value,mask", [(0.1, SEVEN_TOKENS), (0.7, SEVEN_TOKENS), (0.9, THREE_TOKENS), (0.1, MASK)])
def test_whiten_equal_entries_give_exactly_zero(value, mask):
    # float32: the mean of seven 0.1s (three 0.9s) is off by ~1e-8; dividing that by the ~1e-8
    # std of the equal residuals would give O(1) values
    values = with_garbage(torch.full(mask.shape, value), mask)
    assert (whiten(values, mask) == 0).all()


# ---- reinforce++ ------------------------------------------------------------------------------

def test_reinforce_pp_hand_computed():
    # returns: row 0 [2, 2, 0, 2] (the hole adds nothing), row 1 [-1, 0, 0, 0]; masked values
    # [2, 2, 2, -1]: mean 1.25, unbiased std 1.5 -> [0.5, 0.5, 0.5, -1.5]
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    adv = reinforce_pp_advantages(torch.tensor([2.0, -1.0]), mask, None, 0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0, 0.5], [-1.5, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("group_size", [None, 2, 3])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_reinforce_pp_matches_loop_reference(group_size, kl_coef):
    kl = torch.rand(MASK.shape, generator=torch.Generator().manual_seed(4))
    actual = reinforce_pp_advantages(REWARDS, MASK, with_garbage(kl, MASK), kl_coef, group_size)
    expected = reference_reinforce_pp(REWARDS.tolist(), MASK.tolist(), kl.tolist(), kl_coef, group_size, 1e-8)
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert (actual[~MASK.bool()] == 0).all() and (actual[3] == 0).all()  # padding, zero-length row


def test_reinforce_pp_without_kl_matches_zero_kl():
    without = reinforce_pp_advantages(REWARDS, MASK, None, 0.5)
    torch.testing.assert_close(without, reinforce_pp_advantages(REWARDS, MASK, torch.zeros(MASK.shape), 0.5))
    torch.testing.assert_close(without, torch.tensor(
        reference_reinforce_pp(REWARDS.tolist(), MASK.tolist(), None, 0.0, None, 1e-8)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value,mask", [(0.1, SEVEN_TOKENS), (0.9, THREE_TOKENS), (0.1, MASK)])
def test_reinforce_pp_equal_rewards_give_zero(value, mask):
    rewards = torch.full((mask.shape[0],), value)
    assert (reinforce_pp_advantages(rewards, mask, None, 0.0) == 0).all()
    # baseline variant: every group is equal, so every centered reward is exactly 0
    assert (reinforce_pp_advantages(rewards, mask, None, 0.0, groups=2) == 0).all()


@pytest.mark.parametrize("mask", [torch.zeros(2, 4), torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])])
def test_reinforce_pp_fewer_than_two_tokens_gives_zeros(mask):
    adv = reinforce_pp_advantages(torch.tensor([1.0, 3.0]), mask, torch.rand(2, 4), 0.1)
    assert adv.tolist() == [[0.0] * 4] * 2


# ---- gae --------------------------------------------------------------------------------------

@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 1.0)])
def test_gae_matches_loop_reference(gamma, lam):
    gen = torch.Generator().manual_seed(5)
    rewards, values = torch.randn(MASK.shape, generator=gen), torch.randn(MASK.shape, generator=gen)
    advantages, returns = gae_advantages(with_garbage(rewards, MASK), with_garbage(values, MASK), MASK, gamma, lam)
    expected_adv, expected_ret = reference_gae(rewards.tolist(), values.tolist(), MASK.tolist(), gamma, lam)
    torch.testing.assert_close(advantages, torch.tensor(expected_adv), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns, torch.tensor(expected_ret), atol=1e-5, rtol=1e-5)
    assert (advantages[~MASK.bool()] == 0).all() and (returns[~MASK.bool()] == 0).all()


def test_gae_hand_computed_skips_the_hole():
    # masked positions 0 and 2: t=2 terminal: A = 1 - 0.25 = 0.75;
    # t=0: delta = 0 + 0.9 * 0.25 - 0.5 = -0.275, A = -0.275 + 0.9 * 0.8 * 0.75 = 0.265
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    advantages, returns = gae_advantages(torch.tensor([[0.0, 99.0, 1.0]]), torch.tensor([[0.5, 99.0, 0.25]]), mask,
                                         gamma=0.9, lam=0.8)
    torch.testing.assert_close(advantages, torch.tensor([[0.265, 0.0, 0.75]]))
    torch.testing.assert_close(returns, torch.tensor([[0.765, 0.0, 1.0]]))


def test_gae_undiscounted_with_zero_values_is_reward_to_go():
    rewards = torch.randn(MASK.shape, generator=torch.Generator().manual_seed(6))
    advantages, returns = gae_advantages(rewards, torch.zeros(MASK.shape), MASK, 1.0, 1.0)
    expected = [[sum(r for u, (r, mu) in enumerate(zip(row, row_mask)) if mu and u >= t) if m else 0.0
                 for t, m in enumerate(row_mask)] for row, row_mask in zip(rewards.tolist(), MASK.tolist())]
    torch.testing.assert_close(advantages, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(returns, advantages)


# ---- the same estimators over data-parallel shards (each worker holds a slice of the batch) -------
def run_sharded(fn, shards: list) -> list:
    """fn(shard, reduce) on each shard in its own thread, as on data-parallel workers: reduce(t, op)
    combines t over every shard (all of them call it in the same order, like an all-reduce)."""
    barrier, slots, results = threading.Barrier(len(shards)), [None] * len(shards), [None] * len(shards)
    ops = {"sum": lambda ts: sum(ts[1:], ts[0]), "min": lambda ts: torch.stack(ts).amin(),
           "max": lambda ts: torch.stack(ts).amax()}

    def reduce_for(i):
        def reduce(tensor, op):
            slots[i] = tensor
            barrier.wait()
            combined = ops[op](list(slots))
            barrier.wait()
            return combined
        return reduce

    def work(i):
        results[i] = fn(shards[i], reduce_for(i))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(shards))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_whiten_over_shards_equals_whiten_of_the_whole_batch():
    values, mask = torch.randn(8, 6, generator=torch.Generator().manual_seed(3)), torch.ones(8, 6)
    mask[1, 4:] = 0
    mask[5, :] = 0
    whole = whiten(values, mask)
    parts = run_sharded(lambda shard, reduce: whiten(shard[0], shard[1], reduce=reduce),
                        list(zip(values.split(2), mask.split(2))))
    torch.testing.assert_close(torch.cat(parts), whole)


def test_reinforce_pp_over_shards_equals_the_whole_batch():
    g = torch.Generator().manual_seed(4)
    rewards, kl, mask = torch.rand(8, generator=g), torch.randn(8, 5, generator=g), torch.ones(8, 5)
    mask[2, 3:] = 0
    whole = reinforce_pp_advantages(rewards, mask, kl, 0.1)
    parts = run_sharded(lambda s, reduce: reinforce_pp_advantages(s[0], s[1], s[2], 0.1, reduce=reduce),
                        list(zip(rewards.split(4), mask.split(4), kl.split(4))))
    torch.testing.assert_close(torch.cat(parts), whole)


def test_explained_variance_over_shards_equals_the_whole_batch():
    g = torch.Generator().manual_seed(5)
    values, returns, mask = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g), torch.ones(6, 4)
    whole = explained_variance(values, returns, mask)
    m = mask.bool()
    assert whole == pytest.approx(1 - ((returns[m] - values[m]).var() / returns[m].var()).item(), rel=1e-6)
    parts = run_sharded(lambda s, reduce: explained_variance(s[0], s[1], s[2], reduce),
                        list(zip(values.split(3), returns.split(3), mask.split(3))))
    assert parts == [pytest.approx(whole, rel=1e-9)] * 2  # two shards of 3 rows
