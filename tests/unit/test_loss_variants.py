"""Loss variants against hand-computed cases: KL estimators (k3 clamped as verl clamps it; the
straight-through k1+ / k3+), dual-clip, GSPO-token's sequence ratio, the log-ratio bounds, the
entropy bonus, the aggregation modes and how sequence means count empty responses, REINFORCE++
with a discount, DPO hinge / robust / sigmoid_norm, cDPO smoothing, LD-DPO, and the config keys
that select them."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlkit.algorithms.advantages import reinforce_pp_advantages, whiten
from rlkit.algorithms.losses import (KL_ESTIMATORS, ClippedPolicyLossConfig, DPOLossConfig, aggregate,
                                     clipped_policy_loss, dpo_loss, kl_estimate, preference_logprobs,
                                     sequence_logprobs)
from rlkit.algorithms.objectives import PolicyGradient
from rlkit.data.batch import Batch
from rlkit.workers.policy.token_head import token_logprobs_and_entropy
from rlkit.algorithms.policy_gradient import kl_estimator, max_response_tokens
from rlkit.config.schema import ConfigError
from rlkit.data.batch import BatchTotals, batch_totals
from rlkit.launch.config import load_config


def policy_cfg(**changes):
    return ClippedPolicyLossConfig(**{"clip_low": 0.2, "clip_high": 0.28, "kl_coef": 0.0, "aggregation": "token-mean",
                                      **changes})


# ---- KL estimators ----------------------------------------------------------------------------

# lp = 0, ref = log 2, so x = lp - ref = -log 2: (estimator, value, d value / d lp); the "+"
# variants have k1's / k3's value and k2's gradient x
LOG2 = math.log(2)
KL_CASES = [("k1", -LOG2, 1.0), ("k2", 0.5 * LOG2 ** 2, -LOG2), ("abs", LOG2, -1.0),
            ("k3", 1 - LOG2, 1 - 2.0), ("low_var_kl", 1 - LOG2, 1 - 2.0),
            ("k1+", -LOG2, -LOG2), ("k3+", 1 - LOG2, -LOG2)]


@pytest.mark.parametrize("estimator, value, grad", KL_CASES, ids=[c[0] for c in KL_CASES])
def test_kl_estimators_hand_values_and_gradients(estimator, value, grad):
    lp = torch.tensor(0.0, requires_grad=True)
    kl = kl_estimate(lp, torch.tensor(LOG2), estimator)
    kl.backward()
    assert kl.item() == pytest.approx(value, abs=1e-6)
    assert lp.grad.item() == pytest.approx(grad, abs=1e-6)
    assert {c[0] for c in KL_CASES} == set(KL_ESTIMATORS)


# ref - lp: (k3 value, d k3 / d lp), with verl's clamps: ref - lp to [-20, 20], the value to <= 10
K3_CLAMP_CASES = [
    (2.0, math.exp(2) - 3, 1 - math.exp(2)),  # no clamp binds: e^2 - 2 - 1, gradient 1 - e^2
    (4.0, 10.0, 0.0),  # unclamped 49.6 with gradient -53.6; clamped to 10, no gradient
    (-4.0, math.exp(-4) + 3, 1 - math.exp(-4)),  # below the reference's logprob: small, no clamp
    (25.0, 10.0, 0.0),  # log-ratio clamped to 20, then the value to 10
    (-25.0, 10.0, 0.0),  # log-ratio clamped to -20: e^-20 + 19, then the value to 10
]


@pytest.mark.parametrize("estimator", ["k3", "low_var_kl"])
@pytest.mark.parametrize("ref_minus_lp, value, grad", K3_CLAMP_CASES)
def test_k3_is_clamped_as_verl_clamps_it(estimator, ref_minus_lp, value, grad):
    lp = torch.tensor(0.0, requires_grad=True)
    kl = kl_estimate(lp, torch.tensor(ref_minus_lp), estimator)
    kl.backward()
    assert kl.item() == pytest.approx(value, rel=1e-6)
    assert lp.grad.item() == pytest.approx(grad, rel=1e-6, abs=1e-7)


# (estimator, lp - ref, value, d value / d lp): the straight-through variants off the first case
STRAIGHT_THROUGH_CASES = [
    ("k1+", 0.5, 0.5, 0.5),  # k1 = x = 0.5; k2's gradient x = 0.5 (k1's own would be 1)
    ("k3+", 0.5, math.exp(-0.5) - 0.5, 0.5),  # k3 = e^-x + x - 1; gradient x (k3's own: 1 - e^-x)
    ("k3+", -4.0, 10.0, -4.0),  # k3's clamp binds (value 10, k3's gradient 0); k2's gradient still flows
]


@pytest.mark.parametrize("estimator, x, value, grad", STRAIGHT_THROUGH_CASES)
def test_straight_through_estimators_take_the_value_of_one_and_the_gradient_of_k2(estimator, x, value, grad):
    lp = torch.tensor(x, requires_grad=True)
    kl = kl_estimate(lp, torch.tensor(0.0), estimator)
    kl.backward()
    assert kl.item() == pytest.approx(value, rel=1e-6)
    assert lp.grad.item() == pytest.approx(grad, rel=1e-6)


def test_straight_through_values_are_exactly_the_base_estimators():
    g = torch.Generator().manual_seed(5)
    lp, ref = -3 * torch.rand(4, 6, generator=g), -3 * torch.rand(4, 6, generator=g)
    for plus, base in [("k1+", "k1"), ("k3+", "k3")]:
        assert torch.equal(kl_estimate(lp, ref, plus), kl_estimate(lp, ref, base))


def test_unknown_kl_estimator_names_the_choices():
    with pytest.raises(ValueError) as info:
        kl_estimate(torch.zeros(1), torch.zeros(1), "k4")
    assert "'k4'" in str(info.value) and all(name in str(info.value) for name in KL_ESTIMATORS)


def test_policy_loss_uses_the_chosen_estimator():
    lp, ref, mask = torch.tensor([[0.0, -1.0]]), torch.tensor([[LOG2, -1.5]]), torch.ones(1, 2)
    sums = {e: clipped_policy_loss(lp, lp, torch.zeros(1), mask, policy_cfg(kl_coef=0.5, kl_estimator=e),
                                   batch_totals(mask), ref)[1]["kl"].item() for e in ("k1", "k2")}
    assert sums["k1"] == pytest.approx(-LOG2 + 0.5, abs=1e-6)
    assert sums["k2"] == pytest.approx(0.5 * LOG2 ** 2 + 0.5 * 0.25, abs=1e-6)


# ---- dual-clip --------------------------------------------------------------------------------

# (ratio, advantage, per-token loss with dual_clip_c = 3, dual-clipped?); clip_low 0.2, clip_high 0.28
DUAL_CASES = [
    (5.0, -1.0, 3.0, True),     # PPO's loss 5 is capped at -c A = 3: no gradient
    (4.0, -0.5, 1.5, True),     # 2 capped at 1.5
    (2.0, -1.0, 2.0, False),    # under the cap: PPO's loss, gradient -r A
    (5.0, 1.0, -1.28, False),   # positive advantage: dual-clip does not apply (clipped at 1 + clip_high)
    (0.5, -1.0, 0.8, False),    # clipped at 1 - clip_low, below the cap
]


def test_dual_clip_hand_cases_and_gradients():
    ratios = torch.tensor([[r for r, _, _, _ in DUAL_CASES]])
    advantages = torch.tensor([[a for _, a, _, _ in DUAL_CASES]])
    logprobs = torch.log(ratios).requires_grad_(True)
    mask, n = torch.ones_like(ratios), len(DUAL_CASES)
    loss, sums = clipped_policy_loss(logprobs, torch.zeros_like(ratios), advantages, mask,
                                     policy_cfg(dual_clip_c=3.0), batch_totals(mask))
    assert loss.item() == pytest.approx(sum(e for _, _, e, _ in DUAL_CASES) / n, abs=1e-6)
    assert sums["dual_clipped_tokens"].item() == 2.0
    loss.backward()
    expected_grad = [0.0, 0.0, 2.0 / n, 0.0, 0.0]  # only the unclipped token moves: d(-r A)/d lp = -r A
    torch.testing.assert_close(logprobs.grad, torch.tensor([expected_grad]))
    # off (None): PPO's losses, 5 and 2 for the first two tokens, and no dual-clip count
    off, off_sums = clipped_policy_loss(logprobs, torch.zeros_like(ratios), advantages, mask, policy_cfg(),
                                        batch_totals(mask))
    assert off.item() == pytest.approx((5.0 + 2.0 + 2.0 - 1.28 + 0.8) / n, abs=1e-6)
    assert "dual_clipped_tokens" not in off_sums


# ---- GSPO sequence ratio ----------------------------------------------------------------------

def test_sequence_ratio_is_the_geometric_mean_clipped_per_sequence():
    # row 0: token log-ratios 0.2, -0.1, 0.5 (then padding): s = exp(0.2); row 1: an empty response
    delta = torch.tensor([[0.2, -0.1, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    s = math.exp(0.2)
    totals = batch_totals(mask)  # 2 sequences: the empty one counts in the mean with loss 0
    for advantage, clip, expected_token_loss, grad in [
            (1.0, 0.3, -s, -s / 3),  # inside the range: -s A, gradient -s A / |y| per token
            (1.0, 4e-4, -(1 + 4e-4), 0.0),  # GSPO's clip: s above 1 + 4e-4, clipped as a whole
            (-1.0, 4e-4, s, s / 3)]:  # negative advantage: the unclipped term is the larger loss
        logprobs = delta.clone().requires_grad_(True)
        cfg = policy_cfg(clip_low=min(clip, 3e-4), clip_high=clip, importance_ratio="sequence",
                         aggregation="seq-mean-token-mean")
        loss, sums = clipped_policy_loss(logprobs, torch.zeros_like(delta), torch.tensor([advantage, 1.0]), mask,
                                         cfg, totals)
        loss.backward()
        assert loss.item() == pytest.approx(expected_token_loss / 2, rel=1e-6)
        assert sums["ratio"].item() == pytest.approx(3 * s, rel=1e-6)
        torch.testing.assert_close(logprobs.grad, torch.tensor([[grad / 2] * 3 + [0.0], [0.0] * 4]))


def test_sequence_ratio_of_one_token_is_the_token_ratio():
    logprobs, old, mask = torch.tensor([[-0.5], [-2.0]]), torch.tensor([[-0.7], [-1.0]]), torch.ones(2, 1)
    advantages = torch.tensor([1.0, -1.0])
    token, _ = clipped_policy_loss(logprobs, old, advantages, mask, policy_cfg(), batch_totals(mask))
    sequence, _ = clipped_policy_loss(logprobs, old, advantages, mask, policy_cfg(importance_ratio="sequence"),
                                      batch_totals(mask))
    assert sequence.item() == token.item()


def test_unknown_importance_ratio_names_the_choices():
    mask = torch.ones(1, 1)
    with pytest.raises(ValueError, match="'tokens'.*token.*sequence"):
        clipped_policy_loss(mask, mask, mask[0], mask, policy_cfg(importance_ratio="tokens"), batch_totals(mask))


def test_gspo_token_gives_each_token_its_own_advantage():
    """Token-level advantages under the sequence ratio: the gradient of -A_t s_t at s = 1 is
    -A_t per token (over the 2 tokens of token-mean), not 0 as through the sequence's mean."""
    logprobs = torch.zeros(1, 2, requires_grad=True)
    mask = torch.ones(1, 2)
    loss, _ = clipped_policy_loss(logprobs, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), mask,
                                  policy_cfg(importance_ratio="sequence"), batch_totals(mask))
    loss.backward()
    assert loss.item() == 0.0
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.5, 0.5]]))


def test_gspo_token_hand_values_off_the_old_policy():
    # token log-ratios 0.2, -0.4: s = exp(-0.1) at both tokens (inside [0.8, 1.28]); A = 2, -1
    logprobs = torch.tensor([[0.2, -0.4]], requires_grad=True)
    mask, s = torch.ones(1, 2), math.exp(-0.1)
    loss, sums = clipped_policy_loss(logprobs, torch.zeros(1, 2), torch.tensor([[2.0, -1.0]]), mask,
                                     policy_cfg(importance_ratio="sequence"), batch_totals(mask))
    loss.backward()
    assert loss.item() == pytest.approx(-(2.0 - 1.0) * s / 2, rel=1e-6)
    assert sums["ratio"].item() == pytest.approx(2 * s, rel=1e-6)
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0 * s / 2, 1.0 * s / 2]]))


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_gspo_token_equals_the_sequence_mean_ratio_for_sequence_advantages(aggregation):
    """One advantage per sequence: GSPO-token's loss and gradient are GSPO's, whose ratio is
    exp of the sequence's mean log-ratio with the gradient flowing through that mean."""
    g = torch.Generator().manual_seed(6)
    delta = 0.05 * torch.randn(3, 5, generator=g)
    mask = torch.tensor([[1.0] * 5, [1.0, 1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0, 0.0]])
    advantages, totals = torch.tensor([1.0, -2.0, 0.5]), batch_totals(mask)
    logprobs = delta.clone().requires_grad_(True)
    loss, _ = clipped_policy_loss(logprobs, torch.zeros_like(delta), advantages, mask,
                                  policy_cfg(importance_ratio="sequence", aggregation=aggregation), totals)
    loss.backward()
    reference = delta.clone().requires_grad_(True)
    ratio = torch.exp(sequence_logprobs(reference, mask, average=True)).unsqueeze(1).expand_as(delta)
    per_token = -torch.minimum(ratio * advantages.unsqueeze(1), ratio.clamp(0.8, 1.28) * advantages.unsqueeze(1))
    expected = aggregate(per_token, mask, aggregation, totals)
    expected.backward()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    torch.testing.assert_close(logprobs.grad, reference.grad)


# (importance ratio, log-ratio, advantage, loss): token log-ratios are bounded to [-20, 20] and
# GSPO's sequence log-ratio above at 10, as verl bounds them; where the bound binds: no gradient
BOUND_CASES = [
    ("token", 100.0, 1.0, -1.28),  # clipped at 1 + clip_high; exp(100) is inf in float32
    ("token", 100.0, -1.0, math.exp(20)),  # the unclipped branch, bounded at exp(20)
    ("token", -100.0, -1.0, 0.8),  # clipped at 1 - clip_low
    ("sequence", 100.0, 1.0, -1.28),
    ("sequence", 100.0, -1.0, math.exp(10)),
]


@pytest.mark.parametrize("importance_ratio, log_ratio, advantage, expected", BOUND_CASES)
def test_log_ratio_is_bounded_so_the_gradient_stays_finite(importance_ratio, log_ratio, advantage, expected):
    logprobs = torch.tensor([[log_ratio]], requires_grad=True)
    mask = torch.ones(1, 1)
    loss, _ = clipped_policy_loss(logprobs, torch.zeros(1, 1), torch.tensor([advantage]), mask,
                                  policy_cfg(importance_ratio=importance_ratio), batch_totals(mask))
    loss.backward()
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert logprobs.grad.item() == 0.0


def test_token_ratio_within_the_bound_is_unchanged_bit_for_bit():
    """The bound changes nothing below it: the loss and gradient of the unbounded formula."""
    g = torch.Generator().manual_seed(7)
    delta, advantages = 0.5 * torch.randn(4, 6, generator=g), torch.randn(4, generator=g)
    mask = (torch.rand(4, 6, generator=g) > 0.3).float()
    bounded = delta.clone().requires_grad_(True)
    loss, _ = clipped_policy_loss(bounded, torch.zeros_like(delta), advantages, mask, policy_cfg(), batch_totals(mask))
    loss.backward()
    plain = delta.clone().requires_grad_(True)
    ratio, a = torch.exp(plain), advantages.unsqueeze(1).expand_as(delta)
    expected = aggregate(-torch.minimum(ratio * a, torch.clamp(ratio, 0.8, 1.28) * a), mask, "token-mean",
                         batch_totals(mask))
    expected.backward()
    assert torch.equal(loss, expected) and torch.equal(bounded.grad, plain.grad)


# ---- entropy bonus ----------------------------------------------------------------------------

@pytest.mark.parametrize("aggregation, entropy_term, entropy_grad", [
    ("token-mean", (1.0 + 2.0 + 4.0) / 3, [[1 / 3, 1 / 3, 0.0], [1 / 3, 0.0, 0.0]]),
    ("seq-mean-token-mean", ((1.0 + 2.0) / 2 + 4.0) / 2, [[1 / 4, 1 / 4, 0.0], [1 / 2, 0.0, 0.0]])])
def test_entropy_bonus_is_aggregated_like_the_loss_and_carries_gradient(aggregation, entropy_term, entropy_grad):
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    entropy = torch.tensor([[1.0, 2.0, float("nan")], [4.0, 9.0, 9.0]], requires_grad=True)  # padding: anything
    logprobs, advantages, totals = torch.zeros(2, 3), torch.tensor([1.0, -1.0]), batch_totals(mask)
    without, _ = clipped_policy_loss(logprobs, logprobs, advantages, mask, policy_cfg(aggregation=aggregation), totals)
    loss, _ = clipped_policy_loss(logprobs, logprobs, advantages, mask,
                                  policy_cfg(aggregation=aggregation, entropy_coef=0.01), totals, entropy=entropy)
    loss.backward()
    assert loss.item() == pytest.approx(without.item() - 0.01 * entropy_term, rel=1e-6)
    torch.testing.assert_close(entropy.grad, -0.01 * torch.tensor(entropy_grad))


def test_entropy_coef_zero_leaves_the_loss_bit_identical_and_reads_no_entropy():
    logprobs, old = torch.randn(3, 4, generator=torch.Generator().manual_seed(8)), torch.zeros(3, 4)
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), torch.ones(3, 4)
    plain, _ = clipped_policy_loss(logprobs, old, adv, mask, policy_cfg(), batch_totals(mask))
    with_entropy, _ = clipped_policy_loss(logprobs, old, adv, mask, policy_cfg(), batch_totals(mask),
                                          entropy=torch.full((3, 4), 5.0))
    assert torch.equal(plain, with_entropy)
    with pytest.raises(ValueError, match="entropy"):
        clipped_policy_loss(logprobs, old, adv, mask, policy_cfg(entropy_coef=0.1), batch_totals(mask))


def test_policy_gradient_objective_takes_the_entropy_with_its_gradient_from_the_logits():
    """The worker puts the entropy it computes from the logits into the micro-batch's `entropy`
    field when the objective asks for it (uses_entropy); its gradient reaches the logits."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 3, 5, generator=g, requires_grad=True)
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    batch = Batch({"response_mask": mask, "old_logprobs": torch.zeros(2, 3), "advantages": torch.zeros(2)})
    objective = PolicyGradient(policy_cfg(entropy_coef=0.5))
    assert objective.uses_entropy and not PolicyGradient(policy_cfg()).uses_entropy
    _, entropy = token_logprobs_and_entropy(logits, torch.zeros(2, 3, dtype=torch.long), 1.0, entropy=True,
                                            entropy_grad=True)
    loss, _ = objective(torch.zeros(2, 3), batch.with_fields(entropy=entropy), batch_totals(mask))
    loss.backward()
    # zero advantages: the loss is the bonus alone, -0.5 x the token mean of the 3 masked entropies
    assert loss.item() == pytest.approx(-0.5 * entropy.detach()[mask.bool()].mean().item(), rel=1e-6)
    assert logits.grad[mask.bool()].abs().sum() > 0 and (logits.grad[~mask.bool()] == 0).all()


# ---- aggregation modes and empty responses ----------------------------------------------------

VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row: an empty response


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 10 / 4), ("token-sum", 10.0), ("seq-mean-token-mean", (2 + 4 + 0) / 3),
    ("seq-mean-token-sum", (6 + 4 + 0) / 3), ("seq-mean-token-sum-norm", (6 + 4 + 0) / 3 / 5)])
def test_aggregation_hand_values(mode, expected):
    assert aggregate(VALUES, MASK, mode, batch_totals(MASK), max_response_tokens=5).item() == pytest.approx(expected)


def test_sequence_means_count_empty_responses_in_the_denominator():
    """An empty response adds 0 to a sequence mean's numerator and 1 to its denominator; token
    modes do not see it."""
    with_empty, without = (VALUES, MASK), (VALUES[:2], MASK[:2])
    for mode, scale in [("token-mean", 1.0), ("token-sum", 1.0), ("seq-mean-token-mean", 2 / 3),
                        ("seq-mean-token-sum", 2 / 3), ("seq-mean-token-sum-norm", 2 / 3)]:
        a = aggregate(*with_empty, mode, batch_totals(with_empty[1]), max_response_tokens=5)
        b = aggregate(*without, mode, batch_totals(without[1]), max_response_tokens=5)
        assert a.item() == pytest.approx(scale * b.item()), mode


def test_sum_norm_needs_its_constant():
    with pytest.raises(ValueError, match="max_response_tokens"):
        aggregate(VALUES, MASK, "seq-mean-token-sum-norm", BatchTotals(4.0, 3.0))


# ---- REINFORCE++ with a discount --------------------------------------------------------------

def test_reinforce_pp_discounted_returns_hand_computed():
    # row 0: response tokens at 1, 2 and 4 (3 is an observation: no step); row 1: tokens 0 and 1
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0]], dtype=torch.float32)
    kl = torch.tensor([[9.0, 0.2, 0.4, float("inf"), 0.6, float("nan")], [0.1, 0.3, 9.0, 9.0, 9.0, 9.0]])
    rewards = torch.tensor([1.0, 2.0])
    # gamma 0.5, kl_coef 1: token rewards row 0: -0.2, -0.4, 1 - 0.6; row 1: -0.1, 2 - 0.3
    returns = torch.zeros(2, 6)
    returns[0, 4] = 0.4
    returns[0, 2] = -0.4 + 0.5 * 0.4
    returns[0, 1] = -0.2 + 0.5 * returns[0, 2]
    returns[1, 1] = 1.7
    returns[1, 0] = -0.1 + 0.5 * 1.7
    actual = reinforce_pp_advantages(rewards, mask, kl, 1.0, gamma=0.5)
    torch.testing.assert_close(actual, whiten(returns, mask))
    # gamma 0: each token sees only its own reward
    only_own = torch.tensor([[0, -0.2, -0.4, 0, 0.4, 0], [-0.1, 1.7, 0, 0, 0, 0]])
    torch.testing.assert_close(reinforce_pp_advantages(rewards, mask, kl, 1.0, gamma=0.0), whiten(only_own, mask))
    # gamma 1 is the undiscounted default
    assert torch.equal(reinforce_pp_advantages(rewards, mask, kl, 1.0, gamma=1.0),
                       reinforce_pp_advantages(rewards, mask, kl, 1.0))


# ---- DPO hinge, robust, cDPO ------------------------------------------------------------------

def dpo(loss_type, margin, beta=1.0, label_smoothing=0.0):
    """(loss, d loss / d chosen) for one pair whose log-ratio margin h is `margin`."""
    chosen = torch.tensor([margin], requires_grad=True)
    zero, one = torch.zeros(1), torch.ones(1)
    loss, _ = dpo_loss(chosen, zero, zero, zero, one, one, DPOLossConfig(beta, label_smoothing, loss_type, 0.0))
    loss.backward()
    return loss.item(), chosen.grad.item()


def test_hinge_hand_values():
    assert dpo("hinge", 1.0, beta=0.5) == pytest.approx((0.5, -0.5))  # max(0, 1 - 0.5): gradient -beta
    assert dpo("hinge", 3.0, beta=0.5) == (0.0, 0.0)  # margin met: no loss, no gradient


def test_robust_is_unbiased_under_flipped_labels():
    """Chowdhury et al.: averaged over a label flipped with probability eps, the robust loss is the
    clean DPO loss -logsigmoid(z)."""
    eps, z = 0.2, 1.0
    robust, flipped = dpo("robust", z, label_smoothing=eps)[0], dpo("robust", -z, label_smoothing=eps)[0]
    assert (1 - eps) * robust + eps * flipped == pytest.approx(-F.logsigmoid(torch.tensor(z)).item(), abs=1e-6)
    # by hand: (-(0.8) logsigmoid(1) + 0.2 logsigmoid(-1)) / 0.6
    ls = F.logsigmoid(torch.tensor([z, -z])).tolist()
    assert robust == pytest.approx((-0.8 * ls[0] + 0.2 * ls[1]) / 0.6, abs=1e-6)
    assert dpo("robust", 0.7)[0] == pytest.approx(dpo("sigmoid", 0.7)[0], abs=1e-7)  # eps = 0: DPO


def test_cdpo_smoothing_is_cross_entropy_against_a_soft_label():
    eps, z = 0.1, 0.8
    expected = F.binary_cross_entropy_with_logits(torch.tensor(z), torch.tensor(1 - eps)).item()
    assert dpo("sigmoid", z, label_smoothing=eps)[0] == pytest.approx(expected, abs=1e-6)
    # its gradient vanishes where sigmoid(z) = 1 - eps: the loss stops pushing past odds of 9 to 1
    assert dpo("sigmoid", math.log(9), label_smoothing=eps)[1] == pytest.approx(0.0, abs=1e-6)


def test_sigmoid_norm_and_ipo_use_per_token_log_ratios_and_report_summed_rewards():
    # chosen: log-ratio 2 over 4 tokens (0.5 per token); rejected: -1 over 2 tokens (-0.5 per token)
    two, minus_one, zero = torch.tensor([2.0]), torch.tensor([-1.0]), torch.zeros(1)
    lengths = (torch.tensor([4.0]), torch.tensor([2.0]))
    norm, _ = dpo_loss(two, minus_one, zero, zero, *lengths, DPOLossConfig(1.0, 0.0, "sigmoid_norm", 0.0))
    assert norm.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)  # -logsigmoid(0.5 + 0.5)
    plain, _ = dpo_loss(two, minus_one, zero, zero, *lengths, DPOLossConfig(1.0, 0.0, "sigmoid", 0.0))
    assert plain.item() == pytest.approx(math.log1p(math.exp(-3.0)), abs=1e-6)  # sums: h = 2 + 1
    # IPO at its target: the per-token margin 1 is 1 / (2 beta) with beta 0.5, so no loss
    ipo, metrics = dpo_loss(two, minus_one, zero, zero, *lengths, DPOLossConfig(0.5, 0.0, "ipo", 0.0))
    assert ipo.item() == 0.0
    # the rewards are beta x the summed log-ratios (TRL's rewards/*), whatever the loss type
    rewards = [metrics[k].item() for k in ("reward_chosen", "reward_rejected", "reward_margin", "accuracy")]
    assert rewards == [1.0, -0.5, 1.5, 1.0]


def test_ld_dpo_down_weights_the_longer_responses_verbose_tokens():
    nan, inf = float("nan"), float("inf")
    # pair 0: a prompt token, then 4 chosen and 2 rejected response tokens: public length 2.
    # pair 1 (multi-turn holes): 3 chosen tokens, 1 rejected: public length 1, counted over masked tokens
    mask = torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0], [1, 0, 1, 1, 0], [0, 0, 0, 1, 0]], dtype=torch.float32)
    token_logprobs = torch.tensor([[9.0, -1.0, -2.0, -3.0, -4.0], [9.0, -5.0, -6.0, nan, inf],
                                   [-1.0, 9.0, -2.0, -4.0, nan], [9.0, 9.0, 9.0, -7.0, inf]], requires_grad=True)
    logps = preference_logprobs(token_logprobs, mask, 0.5)
    assert logps.tolist() == [-1 - 2 + 0.5 * (-3 - 4), -11.0, -1 + 0.5 * (-2 - 4), -7.0]
    logps.sum().backward()
    assert token_logprobs.grad.tolist() == [[0, 1, 1, 0.5, 0.5], [0, 1, 1, 0, 0], [1, 0, 0.5, 0.5, 0], [0, 0, 0, 1, 0]]
    assert preference_logprobs(token_logprobs, mask, 0.0).tolist() == [-3.0, -11.0, -1.0, -7.0]
    # alpha 1 is DPO: the plain sums, bit for bit
    assert torch.equal(preference_logprobs(token_logprobs, mask, 1.0),
                       sequence_logprobs(token_logprobs, mask, average=False))


# ---- config keys ------------------------------------------------------------------------------

@pytest.mark.parametrize("recipe, overrides, key, fragments", [
    ("grpo_tiny_cpu", ["algorithm.kl_estimator=k4"], "algorithm.kl_estimator", ["'k1'", "'low_var_kl'", "'k4'"]),
    ("grpo_tiny_cpu", ["algorithm.importance_ratio=tokens"], "algorithm.importance_ratio",
     ["'token'", "'sequence'", "'tokens'"]),
    ("grpo_tiny_cpu", ["algorithm.loss_aggregation=sum"], "algorithm.loss_aggregation",
     ["'token-sum'", "'seq-mean-token-sum-norm'"]),
    ("rloo_tiny_cpu", ["algorithm.dual_clip_c=1.0"], "algorithm.dual_clip_c", ["must be > 1", "(got: 1.0)"]),
    ("reinforce_pp_tiny_cpu", ["algorithm.gamma=1.5"], "algorithm.gamma", ["[0, 1]", "(got: 1.5)"]),
    ("dpo_tiny_cpu", ["algorithm.loss_type=hinge", "algorithm.label_smoothing=0.1"], "algorithm.label_smoothing",
     ["loss_type=hinge"]),
    ("grpo_tiny_cpu", ["+algorithm.clip_ratio_c=3.0"], "algorithm.clip_ratio_c", ["unknown key"]),
    ("grpo_tiny_cpu", ["algorithm.kl_estimator=k2+"], "algorithm.kl_estimator", ["'k1+'", "'k3+'", "'k2+'"]),
    ("rloo_tiny_cpu", ["algorithm.entropy_coef=-0.01"], "algorithm.entropy_coef", ["must be >= 0", "(got: -0.01)"]),
    ("dpo_tiny_cpu", ["algorithm.ld_alpha=1.5"], "algorithm.ld_alpha", ["[0, 1]", "(got: 1.5)"]),
    ("dpo_tiny_cpu", ["algorithm.loss_type=sigmoid_norm", "algorithm.label_smoothing=0.1"],
     "algorithm.label_smoothing", ["loss_type=sigmoid_norm"]),
    ("grpo_tiny_cpu", ["algorithm.off_policy_correction=tis"], "algorithm.off_policy_correction",
     ["'token_tis'", "'seq_mask'"]),
    ("ppo_tiny_cpu", ["algorithm.tis_cap=0.5"], "algorithm.tis_cap", ["must be >= 1", "(got: 0.5)"]),
    ("grpo_tiny_cpu", ["algorithm.seq_mask_low=1.01"], "algorithm.seq_mask_low / seq_mask_high", ["(got: 1.01, 1.002)"]),
    ("rloo_tiny_cpu", ["algorithm.seq_mask_high=0.99"], "algorithm.seq_mask_low / seq_mask_high", ["(got: 0.999, 0.99)"]),
    ("grpo_tiny_cpu", ["algorithm.dynamic_sampling=true", "algorithm.dynamic_sampling_max_rounds=-1"],
     "algorithm.dynamic_sampling", ["(got: 8, -1)"]),
    ("grpo_tiny_cpu", ["algorithm.overlong_buffer=7"], "algorithm.overlong_buffer / overlong_penalty_factor",
     ["budget 6", "(got: 7, 1.0)"]),
    ("reinforce_pp_tiny_cpu", ["algorithm.overlong_penalty_factor=-1.0"],
     "algorithm.overlong_buffer / overlong_penalty_factor", ["(got: 0, -1.0)"]),
])
def test_variant_keys_are_validated(recipe, overrides, key, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    message = str(info.value)
    assert message.startswith(f"{key}: ") and all(f in message for f in fragments), message


def test_variant_keys_load_and_defaults_keep_todays_loss():
    cfg, _ = load_config("grpo_tiny_cpu", ["algorithm.dual_clip_c=3.0", "algorithm.importance_ratio=sequence",
                                           "algorithm.kl_estimator=low_var_kl",
                                           "algorithm.loss_aggregation=seq-mean-token-sum-norm"])
    assert (cfg.algorithm.dual_clip_c, cfg.algorithm.importance_ratio) == (3.0, "sequence")
    assert load_config("dpo_tiny_cpu", ["algorithm.loss_type=robust", "algorithm.label_smoothing=0.1"])[0]
    dpo = load_config("dpo_tiny_cpu", ["algorithm.loss_type=sigmoid_norm", "algorithm.ld_alpha=0.5"])[0].algorithm
    assert (dpo.loss_type, dpo.ld_alpha) == ("sigmoid_norm", 0.5)
    assert load_config("dpo_tiny_cpu", [])[0].algorithm.ld_alpha == 1.0  # DPO
    plus = load_config("ppo_tiny_cpu", ["algorithm.kl_estimator=k3+", "algorithm.entropy_coef=0.001"])[0].algorithm
    assert (plus.kl_estimator, plus.entropy_coef) == ("k3+", 0.001)
    for recipe in ("grpo_tiny_cpu", "rloo_tiny_cpu", "reinforce_pp_tiny_cpu", "ppo_tiny_cpu"):
        assert load_config(recipe, [])[0].algorithm.entropy_coef == 0.0  # every RL recipe has it, off
    a = load_config("grpo_tiny_cpu", [])[0].algorithm
    assert (a.dual_clip_c, a.importance_ratio, a.kl_estimator) == (None, "token", None)
    ppo = load_config("ppo_tiny_cpu", [])[0].algorithm
    assert (kl_estimator(a, in_loss=True), kl_estimator(ppo, in_loss=False)) == ("k3", "k1")  # null: as before
    assert load_config("reinforce_pp_tiny_cpu", [])[0].algorithm.gamma == 1.0


def test_max_response_tokens_is_the_longest_response_a_sample_can_have():
    single, _ = load_config("grpo_tiny_cpu", ["generation.max_new_tokens=7"])
    assert max_response_tokens(single) == 7
    multi, _ = load_config("grpo_tiny_cpu_multiturn", [])
    g, r = multi.generation, multi.env_runner
    assert max_response_tokens(multi) == min(g.max_new_tokens * r.max_turns, r.max_total_tokens)
