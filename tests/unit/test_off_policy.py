"""Off-policy correction against the generation engine's logprobs, on hand-computed cases:
truncated importance weights, sequence masking by the geometric-mean ratio, their metrics, how
the weights enter the policy loss, and the keys' defaults (their validation: test_loss_variants.py)."""

import math

import pytest
import torch

from rlkit.algorithms.losses import ClippedPolicyLossConfig, clipped_policy_loss
from rlkit.algorithms.objectives import PolicyGradient
from rlkit.algorithms.off_policy import OffPolicyCorrection, off_policy_metrics, off_policy_weights
from rlkit.data.batch import Batch, batch_totals
from rlkit.launch.config import load_config

LN = math.log

# two sequences of 3 slots; row 0 has 3 response tokens, row 1 has 2 and one padding slot
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
GEN = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, 0.0]])
# old - gen: row 0 log 3, log 0.5, 0 (ratios 3, 0.5, 1); row 1 log 1.5, log 1.5, padding holds -inf
OLD = GEN + torch.tensor([[LN(3.0), LN(0.5), 0.0], [LN(1.5), LN(1.5), -math.inf]])


def weights(correction, **bounds):
    b = {"tis_cap": 2.0, "seq_mask_low": 0.9, "seq_mask_high": 1.2, **bounds}
    return off_policy_weights(OLD, GEN, MASK, correction, b["tis_cap"], b["seq_mask_low"], b["seq_mask_high"])


def test_token_tis_caps_each_tokens_ratio():
    w, sums = weights("token_tis")
    assert torch.allclose(w, torch.tensor([[2.0, 0.5, 1.0], [1.5, 1.5, 0.0]]))  # 3 capped to 2; padding 0
    assert sums["units"] == 5 and sums["corrected"] == 1  # one token of five over the cap
    assert sums["ratio_sum"] == pytest.approx(3 + 0.5 + 1 + 1.5 + 1.5)  # before truncation
    assert (sums["ratio_min"], sums["ratio_max"]) == (pytest.approx(0.5), pytest.approx(3.0))


def test_seq_mask_drops_sequences_by_geometric_mean_ratio():
    # row 0: exp(mean(log 3, log 0.5, 0)) = 1.5^(1/3) = 1.1447 (kept in [0.9, 1.2]); row 1: 1.5 (dropped)
    w, sums = weights("seq_mask")
    assert torch.equal(w, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))
    assert sums["units"] == 2 and sums["corrected"] == 1
    assert sums["ratio_sum"] == pytest.approx(1.5 ** (1 / 3) + 1.5)
    assert (sums["ratio_min"], sums["ratio_max"]) == (pytest.approx(1.5 ** (1 / 3)), pytest.approx(1.5))
    # the bounds are inclusive; below the low bound drops too
    assert torch.equal(weights("seq_mask", seq_mask_high=1.5)[0], MASK)
    assert torch.equal(weights("seq_mask", seq_mask_low=1.15, seq_mask_high=1.5)[0], MASK * torch.tensor([[0.0], [1.0]]))


def test_on_policy_rollout_gets_weight_one_and_empty_rows_no_unit():
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])  # row 1 has no response token
    lp = torch.tensor([[-0.3, -2.0], [0.0, 0.0]])
    for correction, units in (("token_tis", 2), ("seq_mask", 1)):
        w, sums = off_policy_weights(lp, lp, mask, correction, 1.0, 1.0, 1.0)
        assert torch.equal(w, mask) and sums["units"] == units and sums["corrected"] == 0


def test_extreme_log_ratios_stay_finite():
    mask = torch.ones(1, 2)
    w, sums = off_policy_weights(torch.tensor([[0.0, -1e4]]), torch.tensor([[-1e4, 0.0]]), mask, "token_tis",
                                 2.0, 0.9, 1.1)
    assert torch.equal(w, torch.tensor([[2.0, math.exp(-20.0)]]))  # log-ratios clamped to [-20, 20]
    assert sums["ratio_max"] == pytest.approx(math.exp(20.0))


def test_metrics_combine_shards():
    shards = [weights("token_tis")[1], {"units": 3, "ratio_sum": 3.0, "corrected": 2, "ratio_min": 0.25,
                                        "ratio_max": 4.0}]
    m = off_policy_metrics(shards, "token_tis")
    assert m == {"train/importance_weight_mean": pytest.approx((7.5 + 3.0) / 8),
                 "train/importance_weight_min": 0.25, "train/importance_weight_max": 4.0,
                 "train/tis_clip_fraction": pytest.approx(3 / 8)}
    assert off_policy_metrics([weights("seq_mask")[1]], "seq_mask")["train/seq_mask_fraction"] == 0.5
    assert off_policy_metrics([{"units": 0, "ratio_sum": 0.0, "corrected": 0, "ratio_min": math.inf,
                                "ratio_max": -math.inf}], "seq_mask") == {}


def test_unknown_correction_names_the_choices():
    with pytest.raises(ValueError, match="'tis'.*token_tis.*seq_mask"):
        weights("tis")


def test_weights_multiply_the_clipped_term_not_the_kl():
    # lp = old: ratio 1, advantage 1, so the clipped term is -w per token; the KL term is unweighted
    lp = torch.zeros(1, 3, requires_grad=True)
    old, mask, w = torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([[2.0, 0.5, 0.0]])
    ref = torch.full((1, 3), -1.0)  # k3 = e^(ref - lp) - (ref - lp) - 1 = e^-1 per token
    cfg = ClippedPolicyLossConfig(0.2, 0.28, 0.1, "token-mean")
    loss, _ = clipped_policy_loss(lp, old, torch.ones(1), mask, cfg, batch_totals(mask), ref, w)
    assert loss.item() == pytest.approx((-(2.0 + 0.5 + 0.0) + 3 * 0.1 * math.exp(-1)) / 3)
    loss.backward()
    # d/dlp of -w r A is -w; of 0.1 k3 is 0.1 (1 - e^(ref - lp)); token-mean over 3
    expected = (-w + 0.1 * (1 - math.exp(-1))) / 3
    assert torch.allclose(lp.grad, expected)
    unweighted, _ = clipped_policy_loss(lp, old, torch.ones(1), mask, cfg, batch_totals(mask), ref)
    assert unweighted.item() == pytest.approx((-3 + 3 * 0.1 * math.exp(-1)) / 3)


def test_objective_declares_and_reads_the_weights():
    loss = ClippedPolicyLossConfig(0.2, 0.28, 0.0, "token-mean")
    assert "off_policy_weights" not in PolicyGradient(loss).fields
    weighted = PolicyGradient(loss, off_policy_weighted=True)
    assert "off_policy_weights" in weighted.fields
    mask = torch.ones(1, 2)
    batch = Batch({"response_mask": mask, "old_logprobs": torch.zeros(1, 2), "advantages": torch.ones(1),
                   "off_policy_weights": torch.tensor([[1.0, 0.0]])})
    assert weighted(torch.zeros(1, 2), batch, batch_totals(mask))[0].item() == pytest.approx(-0.5)
    assert PolicyGradient(loss)(torch.zeros(1, 2), batch, batch_totals(mask))[0].item() == pytest.approx(-1.0)


def test_held_shard_binding_adds_the_weights_field():
    held = Batch({"response_mask": MASK, "old_logprobs": OLD, "generation_logprobs": GEN})
    correction = OffPolicyCorrection("token_tis", 2.0, 0.9, 1.2)
    assert set(correction.fields) <= set(held.tensors)
    fields, sums = correction(held, torch.zeros(2), reduce=None)
    assert torch.equal(fields["off_policy_weights"], weights("token_tis")[0]) and sums["corrected"] == 1


def test_default_is_off_and_every_rl_algorithm_has_the_keys():
    for recipe in ("grpo_tiny_cpu", "rloo_tiny_cpu", "reinforce_pp_tiny_cpu", "ppo_tiny_cpu"):
        a = load_config(recipe, [])[0].algorithm
        assert (a.off_policy_correction, a.tis_cap, a.seq_mask_low, a.seq_mask_high) == ("none", 2.0, 0.999, 1.002)
    a = load_config("grpo_tiny_cpu", ["algorithm.off_policy_correction=seq_mask"])[0].algorithm
    assert a.off_policy_correction == "seq_mask"
