"""Policy, preference and value losses: pure functions of token-aligned tensors. Shapes: [B, S]
unless noted.

Aggregation over tokens is explicit and global: a loss computed on one micro-batch is that
micro-batch's exact share of the loss over the whole optimizer batch, so gradient accumulation
over micro-batches and DP ranks gives the same gradient as one big batch.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlkit.data.batch import BatchTotals

LOSS_AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, totals: BatchTotals,
              max_response_tokens: int | None = None) -> torch.Tensor:
    """Reduce per-token values [B, S] to this micro-batch's share of the batch loss.

    token-mean:              sum over all tokens / total tokens in the batch (DAPO)
    token-sum:               sum over all tokens (scales with the batch's token count)
    seq-mean-token-mean:     mean over sequences of each sequence's token mean (GRPO paper)
    seq-mean-token-sum:      mean over sequences of each sequence's token sum
    seq-mean-token-sum-norm: seq-mean-token-sum / max_response_tokens (Dr.GRPO, Liu et al. 2025,
                             arXiv:2503.20783; TRL's dr_grpo): a constant normaliser, the most
                             response tokens a sample can have, so no sequence's weight depends on
                             its own length or on the batch's lengths

    Sequence means divide by totals.num_sequences, which counts every sample of the batch: an
    empty response (no masked token) is a sequence whose token sum and token mean are 0, so it
    adds 0 to the numerator and 1 to the denominator (verl leaves such rows out of the count).
    """
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))  # padding may hold inf
    if mode == "token-mean":
        return masked.sum() / max(totals.num_tokens, 1.0)
    if mode == "token-sum":
        return masked.sum()
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / max(totals.num_sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(totals.num_sequences, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if not max_response_tokens:
            raise ValueError("seq-mean-token-sum-norm needs max_response_tokens, its constant normaliser")
        return masked.sum() / (max(totals.num_sequences, 1.0) * max_response_tokens)
    raise ValueError(f"unknown loss aggregation '{mode}'; choose one of {LOSS_AGGREGATIONS}")


KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "low_var_kl")
# exp of a larger log-ratio overflows float32's range for no useful value (verl bounds it the same)
LOG_RATIO_BOUND = 20.0


def kl_k3(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate k3 = exp(ref - lp) - (ref - lp) - 1 (Schulman 2020):
    unbiased and always >= 0. Clamped as verl clamps it: ref - lp to [-20, 20] before the exp,
    the estimate to at most 10. Where a clamp binds the gradient is 0 (ref - lp = 4 gives 10, not
    49.6 with gradient -53.6), so one token far from the reference cannot dominate the step."""
    log_ratio = torch.clamp(reference_logprobs - logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


def kl_estimate(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled token's logprobs (Schulman 2020,
    http://joschu.net/blog/kl-approx.html), with x = lp - ref; same shape as the inputs.

    k1:         x (unbiased, can be negative; summed over a response: its sequence log-ratio)
    k2:         x^2 / 2 (biased, >= 0; its gradient is the KL's gradient in expectation)
    abs:        |x|
    k3:         exp(-x) + x - 1, clamped (see kl_k3; unbiased, >= 0, low variance)
    low_var_kl: verl's name for the same clamped k3, so verl settings carry over
    """
    log_ratio = logprobs - reference_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "abs":
        return log_ratio.abs()
    if estimator in ("k3", "low_var_kl"):
        return kl_k3(logprobs, reference_logprobs)
    raise ValueError(f"unknown KL estimator '{estimator}'; choose one of {KL_ESTIMATORS}")


IMPORTANCE_RATIOS = ("token", "sequence")


@dataclass(frozen=True)
class ClippedPolicyLossConfig:
    clip_low: float  # ratio lower bound is 1 - clip_low
    clip_high: float  # ratio upper bound is 1 + clip_high (DAPO clip-higher)
    kl_coef: float  # 0 disables the KL term
    aggregation: str
    dual_clip_c: float | None = None  # dual-clip: for A < 0 the loss is at most -c A; None disables it
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS
    importance_ratio: str = "token"  # token (PPO) | sequence (GSPO)
    max_response_tokens: int | None = None  # seq-mean-token-sum-norm's constant normaliser


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, cfg: ClippedPolicyLossConfig, totals: BatchTotals,
                        reference_logprobs: torch.Tensor | None = None,
                        off_policy_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate with separate low/high clip (DAPO, Yu et al. 2025, arXiv:2503.14476)
    plus an optional KL penalty to a reference policy.

    loss_t = -min(r_t A, clip(r_t, 1-clip_low, 1+clip_high) A) + kl_coef * kl_t
    r_t: importance_ratio "token": exp(lp_t - old_lp_t);
         "sequence": GSPO (Zheng et al. 2025, arXiv:2507.18071), the geometric mean of the
         sequence's token ratios exp(mean over its masked tokens of lp - old_lp), the same for
         every token of the sequence and clipped as a whole (GSPO uses clip_low 3e-4, clip_high
         4e-4); with seq-mean-token-mean aggregation this is GSPO's sequence objective.
    dual_clip_c (Ye et al. 2019, arXiv:1912.09729): where A < 0 the loss is at most -c A, so a
         token whose ratio has grown far above 1 gives a bounded loss and no gradient (c > 1).
    kl_t: kl_estimate(lp, ref, kl_estimator).
    off_policy_weights [B, S] (rlkit/algorithms/off_policy.py), if given, multiply each token's
         clipped term (not the KL term): a correction toward the policy that generated the rollout.
    advantages: [B] (one per sample) or [B, S]. Returns (loss, sums) where sums are masked token
    sums (clipped tokens, dual-clipped tokens, importance ratio, kl) for metrics; divide by the
    batch's token count to get means.
    """
    if cfg.importance_ratio not in IMPORTANCE_RATIOS:
        raise ValueError(f"unknown importance ratio '{cfg.importance_ratio}'; choose one of {IMPORTANCE_RATIOS}")
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    keep = mask.bool()
    # padding may hold inf: zero it before exp, or its NaN gradient would reach the weights
    logprobs, old_logprobs, advantages = (torch.where(keep, x, torch.zeros_like(x))
                                          for x in (logprobs, old_logprobs, advantages))
    if reference_logprobs is not None:
        reference_logprobs = torch.where(keep, reference_logprobs, torch.zeros_like(reference_logprobs))
    log_ratio = logprobs - old_logprobs
    if cfg.importance_ratio == "sequence":
        log_ratio = sequence_logprobs(log_ratio, mask, average=True).unsqueeze(1).expand_as(log_ratio)
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    sums = {"clipped_tokens": ((clipped < unclipped) & keep).float().sum().detach(),
            "ratio": torch.where(keep, ratio, torch.zeros_like(ratio)).sum().detach()}
    if cfg.dual_clip_c is not None:
        bound = -cfg.dual_clip_c * advantages
        dual_clipped = (advantages < 0) & (per_token > bound)
        per_token = torch.where(dual_clipped, bound, per_token)
        sums["dual_clipped_tokens"] = (dual_clipped & keep).float().sum().detach()
    if off_policy_weights is not None:  # constants of the rollout: no gradient flows through them
        per_token = per_token * off_policy_weights.detach()
    if cfg.kl_coef > 0:
        if reference_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference_logprobs")
        kl = kl_estimate(logprobs, reference_logprobs, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * kl
        sums["kl"] = torch.where(keep, kl, torch.zeros_like(kl)).sum().detach()
    return aggregate(per_token, mask, cfg.aggregation, totals, cfg.max_response_tokens), sums


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor, totals: BatchTotals) -> tuple[torch.Tensor, dict]:
    """Supervised next-token loss: token-mean negative log-likelihood over masked tokens."""
    return aggregate(-logprobs, mask, "token-mean", totals), {}


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Per-sequence logprob [B] from token logprobs [B, S]: the sum over masked tokens, or with
    average their mean (0 for a zero-length sequence). Padding may hold inf/nan."""
    keep = mask.bool()
    total = torch.where(keep, token_logprobs, torch.zeros_like(token_logprobs)).sum(dim=1)
    return total / keep.sum(dim=1).clamp(min=1) if average else total


DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust")


@dataclass(frozen=True)
class DPOLossConfig:
    beta: float  # strength of the implicit KL penalty to the reference policy
    label_smoothing: float  # assumed probability that a preference label is flipped (sigmoid: cDPO; robust)
    loss_type: str  # one of DPO_LOSS_TYPES
    sft_weight: float  # weight of an NLL term on the chosen responses, added by the caller


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, reference_chosen_logps: torch.Tensor,
             reference_rejected_logps: torch.Tensor,
             cfg: DPOLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct preference loss per pair. Inputs: [P] sequence logprobs (see sequence_logprobs) of the
    policy and the reference on each pair's chosen and rejected response.

    h = (chosen - ref_chosen) - (rejected - ref_rejected), z = beta h, eps = label_smoothing
    sigmoid: DPO (Rafailov et al. 2023, arXiv:2305.18290) with conservative label smoothing
             (cDPO, Mitchell 2023): -(1 - eps) * logsigmoid(z) - eps * logsigmoid(-z), the
             binary cross-entropy of sigmoid(z) against the soft label 1 - eps: each pair's loss
             mixes the loss of the label as given and of the label flipped. eps = 0 is DPO.
    robust:  robust DPO (Chowdhury et al. 2024, arXiv:2403.00409), an unbiased loss under labels
             flipped with probability eps: (-(1 - eps) * logsigmoid(z) + eps * logsigmoid(-z)) /
             (1 - 2 eps), eps < 1/2. eps = 0 is DPO.
    hinge:   SLiC (Zhao et al. 2023, arXiv:2305.10425): max(0, 1 - z); label_smoothing unused.
    ipo:     IPO (Azar et al. 2023, arXiv:2310.12036): (h - 1 / (2 beta))^2, label_smoothing unused.
             Pass per-token-averaged logprobs (average=True) so the target does not scale with length.
    Smoothing acts on each pair's loss, before the caller averages over pairs; the metrics
    below do not depend on it. cfg.sft_weight is not applied here: the caller adds
    sft_weight * NLL of the chosen responses.
    Returns (loss [P], metrics of detached [P] tensors); the caller aggregates both. Metrics:
    reward_chosen = beta (chosen - ref_chosen), reward_rejected likewise, reward_margin = their
    difference, accuracy = 1 where the margin is > 0.
    """
    if cfg.loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type '{cfg.loss_type}'; choose one of {DPO_LOSS_TYPES}")
    chosen_log_ratio = chosen_logps - reference_chosen_logps
    rejected_log_ratio = rejected_logps - reference_rejected_logps
    log_ratio_margin = chosen_log_ratio - rejected_log_ratio  # h
    logit, smoothing = cfg.beta * log_ratio_margin, cfg.label_smoothing
    if cfg.loss_type == "sigmoid":
        loss = -(1.0 - smoothing) * F.logsigmoid(logit) - smoothing * F.logsigmoid(-logit)
    elif cfg.loss_type == "robust":
        loss = (-(1.0 - smoothing) * F.logsigmoid(logit) + smoothing * F.logsigmoid(-logit)) / (1.0 - 2.0 * smoothing)
    elif cfg.loss_type == "hinge":
        loss = torch.relu(1.0 - logit)
    else:
        loss = (log_ratio_margin - 1.0 / (2.0 * cfg.beta)) ** 2
    reward_chosen = (cfg.beta * chosen_log_ratio).detach()
    reward_rejected = (cfg.beta * rejected_log_ratio).detach()
    reward_margin = reward_chosen - reward_rejected
    return loss, {"reward_chosen": reward_chosen, "reward_rejected": reward_rejected,
                  "reward_margin": reward_margin, "accuracy": (reward_margin > 0).float()}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float, aggregation: str, totals: BatchTotals,
               max_response_tokens: int | None = None) -> tuple[torch.Tensor, dict]:
    """PPO clipped value loss: the critic regresses returns without moving far from old_values.

    loss_t = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2); clip <= 0 gives
    0.5 * (V - R)^2; aggregated by aggregate (max_response_tokens: the -norm mode's constant).
    Unmasked positions may hold inf/nan: they get neither loss nor gradient.
    Returns (loss, sums) where sums are detached masked token sums: value_error (of (V - R)^2) and,
    when clipping, value_clipped_tokens (tokens where the clipped term is larger: no gradient).
    """
    keep = mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    # zero the padding before any arithmetic so inf/nan there cannot reach the gradient
    values, old_values, returns = (torch.where(keep, x, zero) for x in (values, old_values, returns))
    error = (values - returns).square()
    sums = {"value_error": error.sum().detach()}  # padding is 0
    per_token = error
    if clip > 0:
        clipped_error = (old_values + torch.clamp(values - old_values, -clip, clip) - returns).square()
        per_token = torch.maximum(error, clipped_error)
        sums["value_clipped_tokens"] = ((clipped_error > error) & keep).float().sum().detach()
    return aggregate(0.5 * per_token, mask, aggregation, totals, max_response_tokens), sums
