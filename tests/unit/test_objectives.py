"""Objectives (what a worker minimises) against plain loop references: DPO pairs laid out as
alternating rows with filler pairs (IPO's per-token averages and summed rewards, LD-DPO's
weights on policy and reference alike), and PPO's per-token rewards."""

import math

import torch

from rlkit.algorithms.losses import DPOLossConfig
from rlkit.algorithms.objectives import DirectPreference
from rlkit.algorithms.advantages import explained_variance, token_rewards
from rlkit.data.batch import Batch, BatchTotals


def _pairs_batch(num_pairs: int, filler_pairs: int, seq: int = 6):
    g = torch.Generator().manual_seed(0)
    rows = 2 * (num_pairs + filler_pairs)
    logprobs = -torch.rand(rows, seq, generator=g) * 3
    reference = -torch.rand(rows, seq, generator=g) * 3
    mask = torch.zeros(rows, seq)
    for r in range(2 * num_pairs):
        mask[r, 2 + r % 3:] = 1.0  # responses of different lengths after a prompt
    logprobs[2 * num_pairs:] = float("nan")  # filler rows: padding may hold anything
    return logprobs, Batch({"loss_mask": mask, "reference_logprobs": reference}), mask


def test_direct_preference_matches_a_per_pair_loop_and_ignores_filler_pairs():
    beta, smoothing, sft_weight = 0.3, 0.1, 0.5
    logprobs, batch, mask = _pairs_batch(num_pairs=3, filler_pairs=1)
    totals = BatchTotals(num_tokens=float(mask[0::2].sum()), num_sequences=3.0)
    loss, sums = DirectPreference(DPOLossConfig(beta, smoothing, "sigmoid", sft_weight))(logprobs, batch, totals)

    def seq(r, values):
        return sum(values[r, t].item() for t in range(mask.shape[1]) if mask[r, t])

    expected, correct = 0.0, 0
    for p in range(3):
        c, r = 2 * p, 2 * p + 1
        h = (seq(c, logprobs) - seq(c, batch["reference_logprobs"])) - (seq(r, logprobs) - seq(r, batch["reference_logprobs"]))
        expected += -(1 - smoothing) * math.log(1 / (1 + math.exp(-beta * h))) \
            - smoothing * math.log(1 / (1 + math.exp(beta * h)))
        correct += h > 0
    expected /= 3
    expected += sft_weight * -sum(seq(2 * p, logprobs) for p in range(3)) / totals.num_tokens
    assert math.isfinite(loss.item()) and abs(loss.item() - expected) < 1e-5
    assert sums["accuracy"].item() == correct


def test_ipo_uses_per_token_averages():
    logprobs, batch, mask = _pairs_batch(num_pairs=2, filler_pairs=0)
    loss, sums = DirectPreference(DPOLossConfig(0.5, 0.0, "ipo", 0.0))(logprobs, batch, BatchTotals(1.0, 2.0))

    def avg(r, values):
        kept = [values[r, t].item() for t in range(mask.shape[1]) if mask[r, t]]
        return sum(kept) / len(kept)

    expected = 0.0
    for p in range(2):
        c, r = 2 * p, 2 * p + 1
        h = (avg(c, logprobs) - avg(c, batch["reference_logprobs"])) - (avg(r, logprobs) - avg(r, batch["reference_logprobs"]))
        expected += (h - 1 / (2 * 0.5)) ** 2
    assert abs(loss.item() - expected / 2) < 1e-5

    def total(r, values):
        return sum(values[r, t].item() for t in range(mask.shape[1]) if mask[r, t])

    # the reward metrics and logprobs are on sums, as for every loss type (TRL's convention)
    reward_chosen = sum(0.5 * (total(c, logprobs) - total(c, batch["reference_logprobs"])) for c in (0, 2))
    assert abs(sums["reward_chosen"].item() - reward_chosen) < 1e-5
    assert abs(sums["chosen_logprob"].item() - (total(0, logprobs) + total(2, logprobs))) < 1e-5


def test_ld_dpo_weights_the_verbose_tokens_of_policy_and_reference_alike():
    alpha, beta = 0.3, 0.2
    logprobs, batch, mask = _pairs_batch(num_pairs=3, filler_pairs=1)  # pairs of 4 and 3, 2 and 4, 3 and 2 tokens
    totals = BatchTotals(num_tokens=float(mask[0::2].sum()), num_sequences=3.0)
    loss, _ = DirectPreference(DPOLossConfig(beta, 0.0, "sigmoid", 0.0, alpha))(logprobs, batch, totals)

    def ld(r, values, public):
        kept = [values[r, t].item() for t in range(mask.shape[1]) if mask[r, t]]
        return sum(kept[:public]) + alpha * sum(kept[public:])

    expected, reference = 0.0, batch["reference_logprobs"]
    for p in range(3):
        c, r = 2 * p, 2 * p + 1
        public = int(min(mask[c].sum(), mask[r].sum()))
        h = (ld(c, logprobs, public) - ld(c, reference, public)) - (ld(r, logprobs, public) - ld(r, reference, public))
        expected += math.log1p(math.exp(-beta * h))
    assert math.isfinite(loss.item()) and abs(loss.item() - expected / 3) < 1e-5


def test_token_rewards_put_the_reward_on_the_last_response_token():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0],   # multi-turn: an observation hole, then padding
                         [0, 0, 1, 1, 1, 1],
                         [0, 0, 0, 0, 0, 0]],  # zero-length response
                        dtype=torch.float32)
    rewards = torch.tensor([1.0, 0.5, 2.0])
    kl = torch.full(mask.shape, 0.1)
    kl[0, 5] = float("inf")  # padding may hold anything
    out = token_rewards(rewards, mask, kl)
    for b in range(3):
        last = max([t for t in range(6) if mask[b, t]], default=None)
        for t in range(6):
            expected = (rewards[b].item() if t == last else 0.0) - (0.1 if mask[b, t] else 0.0)
            assert abs(out[b, t].item() - expected) < 1e-6, (b, t)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    assert explained_variance(returns, returns, mask) == 1.0
    assert abs(explained_variance(torch.full_like(returns, 2.0), returns, mask)) < 1e-6
