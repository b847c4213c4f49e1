"""Policy losses against hand-computed cases and explicit per-sequence, per-token loop references."""

import math

import pytest
import torch

from rlkit.algorithms.losses import (DPO_LOSS_TYPES, LOSS_AGGREGATIONS, ClippedPolicyLossConfig, DPOLossConfig,
                                     aggregate, clipped_policy_loss, dpo_loss, kl_k3, nll_loss, sequence_logprobs,
                                     value_loss)
from rlkit.data.batch import BatchTotals, batch_totals
from token_masks import MASK, with_garbage


MAX_RESPONSE_TOKENS = 8  # seq-mean-token-sum-norm's constant in these cases: at least every row's length


def cfg(aggregation="token-mean", clip_low=0.2, clip_high=0.28, kl_coef=0.0):
    return ClippedPolicyLossConfig(clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef, aggregation=aggregation,
                                   max_response_tokens=MAX_RESPONSE_TOKENS)


# ---- loop references --------------------------------------------------------------------------

def ref_aggregate(values, mask, mode, num_tokens, num_sequences):
    """values, mask: nested lists [B][S]; totals passed explicitly."""
    total = 0.0
    for row, row_mask in zip(values, mask):
        seq_sum, seq_len = 0.0, 0.0
        for v, m in zip(row, row_mask):
            seq_sum += v * m
            seq_len += m
        if mode == "seq-mean-token-mean":
            total += seq_sum / seq_len if seq_len > 0 else 0.0
        else:
            total += seq_sum
    if mode == "token-mean":
        return total / max(num_tokens, 1.0)
    if mode == "token-sum":
        return total
    if mode == "seq-mean-token-sum-norm":
        return total / max(num_sequences, 1.0) / MAX_RESPONSE_TOKENS
    return total / max(num_sequences, 1.0)


def ref_k3(lp, ref):
    return math.exp(ref - lp) - (ref - lp) - 1.0


def ref_per_token_loss(lp, old, adv, ref, c):
    """Per-token loss and whether the clipped branch was taken, for one token."""
    ratio = math.exp(lp - old)
    unclipped = ratio * adv
    clipped = min(max(ratio, 1.0 - c.clip_low), 1.0 + c.clip_high) * adv
    loss = -min(unclipped, clipped)
    if c.kl_coef > 0:
        loss += c.kl_coef * ref_k3(lp, ref)
    return loss, clipped < unclipped


def random_inputs(batch=6, seq=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(batch, seq, generator=gen) * 3
    old = logprobs + 0.4 * torch.randn(batch, seq, generator=gen)
    ref = logprobs + 0.4 * torch.randn(batch, seq, generator=gen)
    adv = torch.randn(batch, generator=gen)
    lengths = [seq, 3, 0, 1, 5, seq][:batch]  # includes an all-masked (zero-length) response
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(seq)] for n in lengths])
    return logprobs, old, ref, adv, mask


# ---- clipped policy loss ----------------------------------------------------------------------

# (ratio, advantage, expected per-token loss, clipped?) with clip_low=0.2, clip_high=0.28
HAND_CASES = [
    (1.5, 1.0, -1.28, True),    # above 1+clip_high, positive advantage: clipped to 1.28
    (0.5, -1.0, 0.8, True),     # below 1-clip_low, negative advantage: clipped to 0.8
    (1.1, 2.0, -2.2, False),    # inside the range
    (1.25, 1.0, -1.25, False),  # inside only because clip_high (0.28) > clip_low (0.2)
    (0.82, -1.0, 0.82, False),  # inside, near the low bound
    (0.5, 1.0, -0.5, False),    # below range but positive advantage: min keeps the unclipped term
    (1.5, -1.0, 1.5, False),    # above range but negative advantage: min keeps the unclipped term
]


def test_hand_computed_clipping_cases_and_clip_count():
    ratios = torch.tensor([[r for r, _, _, _ in HAND_CASES]])
    advantages = torch.tensor([[a for _, a, _, _ in HAND_CASES]])  # [B, S] advantages
    old = torch.zeros_like(ratios)
    logprobs = torch.log(ratios).requires_grad_(True)
    mask = torch.ones_like(ratios)
    n = len(HAND_CASES)
    loss, sums = clipped_policy_loss(logprobs, old, advantages, mask, cfg(), batch_totals(mask))
    expected = sum(e for _, _, e, _ in HAND_CASES) / n
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert sums["clipped_tokens"].item() == sum(c for _, _, _, c in HAND_CASES) == 2
    assert "kl" not in sums
    # clipped tokens get no gradient; the others get d(-r*A)/d(lp) / n = -r*A / n
    loss.backward()
    for t, (r, a, _, was_clipped) in enumerate(HAND_CASES):
        assert logprobs.grad[0, t].item() == pytest.approx(0.0 if was_clipped else -r * a / n, abs=1e-6)


def test_clip_count_respects_mask():
    ratios = torch.tensor([[1.5, 1.5, 1.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, sums = clipped_policy_loss(torch.log(ratios), torch.zeros_like(ratios), torch.tensor([1.0]), mask, cfg(),
                                  batch_totals(mask))
    assert sums["clipped_tokens"].item() == 2.0


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_clipped_policy_loss_matches_loop_reference(aggregation, kl_coef):
    logprobs, old, ref, adv, mask = random_inputs()
    c = cfg(aggregation, kl_coef=kl_coef)
    loss, sums = clipped_policy_loss(logprobs, old, adv, mask, c, batch_totals(mask), reference_logprobs=ref)

    per_token, clip_count, kl_sum = [], 0.0, 0.0
    for b in range(logprobs.shape[0]):
        row = []
        for t in range(logprobs.shape[1]):
            value, was_clipped = ref_per_token_loss(logprobs[b, t].item(), old[b, t].item(), adv[b].item(),
                                                    ref[b, t].item(), c)
            row.append(value)
            clip_count += was_clipped * mask[b, t].item()
            kl_sum += ref_k3(logprobs[b, t].item(), ref[b, t].item()) * mask[b, t].item()
        per_token.append(row)
    expected = ref_aggregate(per_token, mask.tolist(), aggregation, mask.sum().item(), mask.shape[0])
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert sums["clipped_tokens"].item() == clip_count
    if kl_coef > 0:
        assert sums["kl"].item() == pytest.approx(kl_sum, rel=1e-5)


def test_kl_coef_without_reference_raises():
    logprobs, old, _, adv, mask = random_inputs()
    with pytest.raises(ValueError, match="reference_logprobs"):
        clipped_policy_loss(logprobs, old, adv, mask, cfg(kl_coef=0.1), batch_totals(mask))


def test_padding_values_do_not_leak():
    logprobs, old, ref, adv, mask = random_inputs()
    garbage = torch.where(mask.bool(), logprobs, torch.full_like(logprobs, -5.0))
    for aggregation in LOSS_AGGREGATIONS:
        c = cfg(aggregation, kl_coef=0.1)
        a, _ = clipped_policy_loss(logprobs, old, adv, mask, c, batch_totals(mask), ref)
        b, _ = clipped_policy_loss(garbage, old, adv, mask, c, batch_totals(mask), ref)
        assert a.item() == pytest.approx(b.item(), rel=1e-6)


# ---- KL ---------------------------------------------------------------------------------------

def test_k3_formula_nonnegative_and_zero_when_equal():
    gen = torch.Generator().manual_seed(1)
    lp, ref = -3 * torch.rand(4, 5, generator=gen), -3 * torch.rand(4, 5, generator=gen)
    kl = kl_k3(lp, ref)
    assert (kl >= 0).all()
    for b in range(4):
        for t in range(5):
            assert kl[b, t].item() == pytest.approx(ref_k3(lp[b, t].item(), ref[b, t].item()), rel=1e-5, abs=1e-7)
    assert kl_k3(lp, lp).tolist() == [[0.0] * 5] * 4
    # hand value: lp = 0, ref = log 2 -> 2 - log 2 - 1
    assert kl_k3(torch.tensor(0.0), torch.tensor(math.log(2))).item() == pytest.approx(1 - math.log(2), abs=1e-6)


# ---- aggregation ------------------------------------------------------------------------------

def test_aggregation_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])  # last row: zero-length
    totals = batch_totals(mask)
    assert totals == BatchTotals(num_tokens=4.0, num_sequences=3.0)
    assert aggregate(values, mask, "token-mean", totals).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(values, mask, "seq-mean-token-mean", totals).item() == pytest.approx((2 + 4 + 0) / 3)
    assert aggregate(values, mask, "seq-mean-token-sum", totals).item() == pytest.approx((6 + 4 + 0) / 3)


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
def test_all_masked_batch_gives_zero_loss_and_finite_grad(aggregation):
    values = torch.randn(2, 4, requires_grad=True)
    mask = torch.zeros(2, 4)
    loss = aggregate(values, mask, aggregation, batch_totals(mask), MAX_RESPONSE_TOKENS)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.isfinite(values.grad).all() and (values.grad == 0).all()


def test_unknown_aggregation_names_the_choices():
    with pytest.raises(ValueError) as info:
        aggregate(torch.ones(1, 1), torch.ones(1, 1), "sum", BatchTotals(1.0, 1.0))
    for choice in LOSS_AGGREGATIONS:
        assert choice in str(info.value)
    assert "'sum'" in str(info.value)


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("boundaries", [[0, 2, 4, 6], [0, 1, 3, 6], [0, 6]])
def test_micro_batch_losses_sum_to_full_batch_loss(aggregation, boundaries):
    """Gradient accumulation: each micro-batch uses the whole batch's totals; sums must match."""
    logprobs, old, ref, adv, mask = random_inputs()
    c, totals = cfg(aggregation, kl_coef=0.05), batch_totals(mask)

    full_lp = logprobs.clone().requires_grad_(True)
    full, _ = clipped_policy_loss(full_lp, old, adv, mask, c, totals, ref)
    full.backward()

    accumulated_lp = logprobs.clone().requires_grad_(True)
    accumulated, clip_count = 0.0, 0.0
    for start, stop in zip(boundaries, boundaries[1:]):
        part, sums = clipped_policy_loss(accumulated_lp[start:stop], old[start:stop], adv[start:stop],
                                         mask[start:stop], c, totals, ref[start:stop])
        part.backward()
        accumulated += part.item()
        clip_count += sums["clipped_tokens"].item()

    assert accumulated == pytest.approx(full.item(), rel=1e-5, abs=1e-7)
    torch.testing.assert_close(accumulated_lp.grad, full_lp.grad)
    _, full_sums = clipped_policy_loss(logprobs, old, adv, mask, c, totals, ref)
    assert clip_count == full_sums["clipped_tokens"].item()


# ---- nll and entropy --------------------------------------------------------------------------

def test_nll_loss_is_token_mean_of_negative_logprobs():
    logprobs, _, _, _, mask = random_inputs()
    loss, sums = nll_loss(logprobs, mask, batch_totals(mask))
    total, count = 0.0, 0
    for b in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if mask[b, t] > 0:
                total += -logprobs[b, t].item()
                count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-6)
    assert sums == {}
    # hand value: logprobs log(0.5), log(0.25) -> (log 2 + log 4) / 2
    loss, _ = nll_loss(torch.log(torch.tensor([[0.5, 0.25, 0.1]])), torch.tensor([[1.0, 1.0, 0.0]]),
                       BatchTotals(2.0, 1.0))
    assert loss.item() == pytest.approx(1.5 * math.log(2), abs=1e-6)


# ---- masks with left padding, holes and empty rows (token_masks.MASK) ----------------------------


def ref_logsigmoid(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


# ---- sequence logprobs ------------------------------------------------------------------------

@pytest.mark.parametrize("average", [False, True])
def test_sequence_logprobs_matches_loop_reference(average):
    token_logprobs = -3 * torch.rand(MASK.shape, generator=torch.Generator().manual_seed(7))
    leaf = with_garbage(token_logprobs, MASK).requires_grad_(True)
    actual = sequence_logprobs(leaf, MASK, average)
    expected = []
    for row, row_mask in zip(token_logprobs.tolist(), MASK.tolist()):
        total, count = 0.0, 0
        for lp, m in zip(row, row_mask):
            if m:
                total += lp
                count += 1
        expected.append(total / count if average and count else total)
    assert actual.shape == (MASK.shape[0],)
    torch.testing.assert_close(actual, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert actual[3].item() == 0.0  # zero-length
    actual.sum().backward()
    lengths = MASK.sum(dim=1, keepdim=True).clamp(min=1)
    torch.testing.assert_close(leaf.grad, MASK / lengths if average else MASK)  # padding gets exactly 0


# ---- DPO --------------------------------------------------------------------------------------

def dpo_cfg(loss_type="sigmoid", beta=0.1, label_smoothing=0.0):
    return DPOLossConfig(beta=beta, label_smoothing=label_smoothing, loss_type=loss_type, sft_weight=0.0)


def ref_dpo(chosen, rejected, ref_chosen, ref_rejected, chosen_length, rejected_length, c):
    """One pair: (loss, reward_chosen, reward_rejected); rewards on the summed log-ratios, the
    length-normalised losses on per-token ones."""
    h_chosen, h_rejected = chosen - ref_chosen, rejected - ref_rejected
    if c.loss_type in ("ipo", "sigmoid_norm"):
        h = h_chosen / chosen_length - h_rejected / rejected_length
    else:
        h = h_chosen - h_rejected
    if c.loss_type == "sigmoid":
        eps = c.label_smoothing
        loss = -(1 - eps) * ref_logsigmoid(c.beta * h) - eps * ref_logsigmoid(-c.beta * h)
    elif c.loss_type == "sigmoid_norm":
        loss = -ref_logsigmoid(c.beta * h)
    else:
        loss = (h - 1 / (2 * c.beta)) ** 2
    return loss, c.beta * h_chosen, c.beta * h_rejected


def random_pairs(pairs=7, seed=8):
    """Summed sequence logprobs (chosen, rejected, their references) and response lengths."""
    gen = torch.Generator().manual_seed(seed)
    logprobs = [-40 * torch.rand(pairs, generator=gen) for _ in range(4)]
    return logprobs + [torch.randint(1, 30, (pairs,), generator=gen).float() for _ in range(2)]


@pytest.mark.parametrize("loss_type,label_smoothing,beta", [("sigmoid", 0.0, 0.1), ("sigmoid", 0.2, 0.5),
                                                            ("ipo", 0.0, 0.1), ("ipo", 0.0, 2.0),
                                                            ("sigmoid_norm", 0.0, 0.1), ("sigmoid_norm", 0.0, 2.0)])
def test_dpo_matches_loop_reference(loss_type, label_smoothing, beta):
    pairs = random_pairs()
    c = dpo_cfg(loss_type, beta, label_smoothing)
    loss, metrics = dpo_loss(*pairs, c)
    assert loss.shape == (7,)
    for p in range(7):
        expected, reward_chosen, reward_rejected = ref_dpo(*(x[p].item() for x in pairs), c)
        assert loss[p].item() == pytest.approx(expected, rel=1e-4, abs=1e-5)
        assert metrics["reward_chosen"][p].item() == pytest.approx(reward_chosen, rel=1e-5, abs=1e-5)
        assert metrics["reward_rejected"][p].item() == pytest.approx(reward_rejected, rel=1e-5, abs=1e-5)
        margin = metrics["reward_margin"][p].item()
        assert margin == pytest.approx(reward_chosen - reward_rejected, rel=1e-4, abs=1e-5)
        assert metrics["accuracy"][p].item() == (1.0 if margin > 0 else 0.0)
    assert 0 < metrics["accuracy"].sum().item() < 7  # both outcomes exercised


def test_dpo_without_smoothing_is_negative_logsigmoid():
    chosen, rejected, ref_chosen, ref_rejected, chosen_lengths, rejected_lengths = random_pairs(seed=9)
    loss, _ = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, chosen_lengths, rejected_lengths,
                       dpo_cfg(beta=0.3))
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    torch.testing.assert_close(loss, -torch.nn.functional.logsigmoid(0.3 * h))


def test_dpo_hand_values():
    zero, one = torch.zeros(1), torch.ones(1)
    # h = 0: sigmoid gives log 2 whatever the smoothing; IPO gives (1 / (2 beta))^2
    for smoothing in (0.0, 0.3):
        loss, metrics = dpo_loss(zero, zero, zero, zero, one, one, dpo_cfg(label_smoothing=smoothing))
        assert loss.item() == pytest.approx(math.log(2), abs=1e-6)
        assert metrics["accuracy"].item() == 0.0  # a tie is not a win
    assert dpo_loss(zero, zero, zero, zero, one, one, dpo_cfg("ipo", beta=0.5))[0].item() == pytest.approx(1.0)
    # IPO at its target h = 1 / (2 beta) = 1 has zero loss
    assert dpo_loss(one, zero, zero, zero, one, one, dpo_cfg("ipo", beta=0.5))[0].item() == 0.0


def test_dpo_is_stable_for_large_margins():
    big = torch.tensor([1e4, -1e4], requires_grad=True)
    zero, one = torch.zeros(2), torch.ones(2)
    loss, _ = dpo_loss(big, zero, zero, zero, one, one, dpo_cfg(beta=1.0, label_smoothing=0.1))
    loss.sum().backward()
    assert torch.isfinite(loss).all() and torch.isfinite(big.grad).all()
    assert loss[0].item() == pytest.approx(0.1 * 1e4, rel=1e-4)  # eps * beta * h for the flipped label
    assert loss[1].item() == pytest.approx(0.9 * 1e4, rel=1e-4)


def test_dpo_metrics_are_detached():
    chosen, *rest = random_pairs()
    _, metrics = dpo_loss(chosen.requires_grad_(True), *rest, dpo_cfg())
    assert set(metrics) == {"reward_chosen", "reward_rejected", "reward_margin", "accuracy"}
    assert not any(m.requires_grad for m in metrics.values())


def test_dpo_unknown_loss_type_names_the_choices():
    zero = torch.zeros(1)
    with pytest.raises(ValueError) as info:
        dpo_loss(zero, zero, zero, zero, zero, zero, dpo_cfg("kto"))
    for choice in DPO_LOSS_TYPES:
        assert choice in str(info.value)
    assert "'kto'" in str(info.value)


# ---- value loss -------------------------------------------------------------------------------

def ref_value_token(v, old, ret, clip):
    """One token: (loss, clipped term strictly larger?)."""
    error = (v - ret) ** 2
    if clip <= 0:
        return 0.5 * error, False
    clipped_error = (old + min(max(v - old, -clip), clip) - ret) ** 2
    return 0.5 * max(error, clipped_error), clipped_error > error


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS)
@pytest.mark.parametrize("clip", [0.2, 0.0, -1.0])
def test_value_loss_matches_loop_reference(aggregation, clip):
    gen = torch.Generator().manual_seed(10)
    values = torch.randn(MASK.shape, generator=gen)
    old = values + 0.3 * torch.randn(MASK.shape, generator=gen)
    returns = torch.randn(MASK.shape, generator=gen)
    loss, sums = value_loss(with_garbage(values, MASK), with_garbage(old, MASK), with_garbage(returns, MASK), MASK,
                            clip, aggregation, batch_totals(MASK), MAX_RESPONSE_TOKENS)
    per_token, clip_count, error_sum = [], 0.0, 0.0
    for b in range(MASK.shape[0]):
        row = []
        for t in range(MASK.shape[1]):
            v, o, r, m = values[b, t].item(), old[b, t].item(), returns[b, t].item(), MASK[b, t].item()
            value, was_clipped = ref_value_token(v, o, r, clip)
            row.append(value if m else 0.0)
            clip_count += was_clipped * m
            error_sum += (v - r) ** 2 * m
        per_token.append(row)
    expected = ref_aggregate(per_token, MASK.tolist(), aggregation, MASK.sum().item(), MASK.shape[0])
    assert loss.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert sums["value_error"].item() == pytest.approx(error_sum, rel=1e-5)
    if clip > 0:
        assert sums["value_clipped_tokens"].item() == clip_count > 0
    else:
        assert "value_clipped_tokens" not in sums


def test_value_loss_hand_computed_clipping_and_gradient():
    # clip 0.2, old 0: (V, R) = (0.5, 1): clipped V 0.2 is further from R -> 0.5 * 0.64, no gradient
    #                   (0.1, 1): inside the clip range -> 0.5 * 0.81
    #                   (-0.5, 0): clipped V -0.2 is closer to R -> unclipped 0.5 * 0.25
    values = torch.tensor([[0.5, 0.1, -0.5]], requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 0.0]])
    mask = torch.ones(1, 3)
    loss, sums = value_loss(values, torch.zeros(1, 3), returns, mask, 0.2, "token-mean", batch_totals(mask))
    assert loss.item() == pytest.approx((0.32 + 0.405 + 0.125) / 3, abs=1e-6)
    assert sums["value_clipped_tokens"].item() == 1.0
    assert sums["value_error"].item() == pytest.approx(0.25 + 0.81 + 0.25, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.9, -0.5]]) / 3)  # d(0.5 (V-R)^2) = V - R
    # clip <= 0: plain regression, the first token now has a gradient too
    unclipped, _ = value_loss(values, torch.zeros(1, 3), returns, mask, 0.0, "token-mean", batch_totals(mask))
    assert unclipped.item() == pytest.approx((0.125 + 0.405 + 0.125) / 3, abs=1e-6)


def test_value_loss_padding_does_not_leak_into_gradient():
    gen = torch.Generator().manual_seed(11)
    values, old, returns = (torch.randn(MASK.shape, generator=gen) for _ in range(3))
    clean = values.clone().requires_grad_(True)
    dirty = with_garbage(values, MASK).requires_grad_(True)
    clean_loss, _ = value_loss(clean, old, returns, MASK, 0.2, "seq-mean-token-mean", batch_totals(MASK))
    dirty_loss, _ = value_loss(dirty, with_garbage(old, MASK), with_garbage(returns, MASK), MASK, 0.2,
                               "seq-mean-token-mean", batch_totals(MASK))
    (clean_loss + dirty_loss).backward()
    assert dirty_loss.item() == clean_loss.item()
    torch.testing.assert_close(dirty.grad, clean.grad)
    assert (dirty.grad[~MASK.bool()] == 0).all()


def test_clipped_policy_loss_padding_garbage_reaches_neither_loss_nor_gradient():
    g = torch.Generator().manual_seed(3)
    logprobs, old, reference = (-3 * torch.rand(MASK.shape, generator=g) for _ in range(3))
    advantages = torch.randn(MASK.shape[0], generator=g)
    cfg = ClippedPolicyLossConfig(0.2, 0.28, 0.1, "token-mean")
    totals = BatchTotals(num_tokens=float(MASK.sum()), num_sequences=float(MASK.shape[0]))
    results = []
    for dirty in (False, True):
        leaf = (with_garbage(logprobs, MASK) if dirty else logprobs.clone()).requires_grad_(True)
        loss, sums = clipped_policy_loss(leaf, with_garbage(old, MASK) if dirty else old, advantages, MASK, cfg,
                                         totals, with_garbage(reference, MASK) if dirty else reference)
        loss.backward()
        results.append((loss.item(), sums["kl"].item(), leaf.grad))
    (clean_loss, clean_kl, clean_grad), (dirty_loss, dirty_kl, dirty_grad) = results
    assert dirty_loss == pytest.approx(clean_loss) and dirty_kl == pytest.approx(clean_kl)
    assert torch.isfinite(dirty_grad).all() and torch.allclose(dirty_grad, clean_grad)
