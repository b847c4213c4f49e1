"""Advantage estimators against hand-computed numbers and explicit per-group, per-sequence, per-token
loop references."""

import math

import pytest
import torch

import threading

from rlkit.algorithms.advantages import (explained_variance, gae_advantages, grpo_advantages, reinforce_pp_advantages,
                                        rloo_advantages, whiten)
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


@pytest.mark.parametrize("group_size", [0, 1, 3])
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
    assert (reinforce_pp_advantages(rewards, mask, None, 0.0, group_size=2) == 0).all()


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
