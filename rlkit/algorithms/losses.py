"""Policy, preference, reward-model and value losses: pure functions of token-aligned tensors.
Shapes: [B, S] unless noted.

Aggregation over tokens is explicit and global: a loss computed on one micro-batch is that
micro-batch's exact share of the loss over the whole optimizer batch, so gradient accumulation
over micro-batches and DP ranks gives the same gradient as one big batch.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlkit.config.choices import DPO_LOSS_TYPES, IMPORTANCE_RATIOS, KL_ESTIMATORS, LOSS_AGGREGATIONS
from rlkit.data.batch import BatchTotals
from rlkit.observability.logprob_agreement import k3


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


# exp of a larger log-ratio overflows float32's range for no useful value (verl bounds it the same)
LOG_RATIO_BOUND = 20.0
# GSPO's sequence log-ratio is bounded above at 10, as verl bounds it: exp(10) is far past any clip
SEQUENCE_LOG_RATIO_BOUND = 10.0


def kl_k3(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate k3 = exp(ref - lp) - (ref - lp) - 1 (Schulman 2020):
    unbiased and always >= 0. Clamped as verl clamps it: ref - lp to [-20, 20] before the exp,
    the estimate to at most 10. Where a clamp binds the gradient is 0 (ref - lp = 4 gives 10, not
    49.6 with gradient -53.6), so one token far from the reference cannot dominate the step."""
    log_ratio = torch.clamp(reference_logprobs - logprobs, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    return torch.clamp(k3(log_ratio), -10.0, 10.0)


def kl_estimate(logprobs: torch.Tensor, reference_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled token's logprobs (Schulman 2020,
    http://joschu.net/blog/kl-approx.html), with x = lp - ref; same shape as the inputs.

    k1:         x (unbiased, can be negative; summed over a response: its sequence log-ratio)
    k2:         x^2 / 2 (biased, >= 0; its gradient is the KL's gradient in expectation)
    abs:        |x|
    k3:         exp(-x) + x - 1, clamped (see kl_k3; unbiased, >= 0, low variance)
    low_var_kl: verl's name for the same clamped k3, so verl settings carry over
    k1+, k3+:   verl's straight-through variants: the value of k1 (k3), the gradient of k2,
                k2 + sg(k - k2) with sg the stop-gradient. k1's and k3's values are unbiased but
                their gradients are not the KL's in expectation; k2's gradient is.
    """
    if estimator.endswith("+") and estimator in KL_ESTIMATORS:
        value = kl_estimate(logprobs, reference_logprobs, estimator[:-1])
        gradient = kl_estimate(logprobs, reference_logprobs, "k2")
        return gradient - gradient.detach() + value.detach()  # k2 + sg(k - k2), whose value is k exactly
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


def importance_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                         importance_ratio: str) -> torch.Tensor:
    """log r_t [B, S] of the clipped surrogate, bounded as verl bounds it so that exp(log r) and
    its gradient stay finite (where a bound binds the gradient is 0). Padding must hold finite
    values (the caller zeroes it).

    token:    lp_t - old_lp_t, clamped to [-20, 20].
    sequence: GSPO-token (Zheng et al. 2025, arXiv:2507.18071; verl's `gspo` loss):
              log s_i,t = sg[log s_i] + lp_t - sg[lp_t], with sg the stop-gradient and log s_i the
              mean over the sequence's masked tokens of lp - old_lp, clamped above at 10. Its value
              is the sequence's log-ratio at every token; its gradient is lp_t's, so a token-level
              advantage A_t weights its own token (for one advantage per sequence this is GSPO's
              gradient exactly, since every token of the sequence gets the same weight).
    """
    log_ratio = logprobs - old_logprobs
    if importance_ratio == "token":
        return torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    sequence = sequence_logprobs(log_ratio, mask, average=True).detach().unsqueeze(1)
    return torch.clamp(logprobs - logprobs.detach() + sequence, max=SEQUENCE_LOG_RATIO_BOUND)


@dataclass(frozen=True)
class ClippedPolicyLossConfig:
    clip_low: float  # ratio lower bound is 1 - clip_low
    clip_high: float  # ratio upper bound is 1 + clip_high (DAPO clip-higher)
    kl_coef: float  # 0 disables the KL term
    aggregation: str
    dual_clip_c: float | None = None  # dual-clip: for A < 0 the loss is at most -c A; None disables it
    kl_estimator: str = "k3"  # one of KL_ESTIMATORS
    importance_ratio: str = "token"  # token (PPO) | sequence (GSPO-token)
    max_response_tokens: int | None = None  # seq-mean-token-sum-norm's constant normaliser
    entropy_coef: float = 0.0  # entropy bonus: minus entropy_coef x the aggregated token entropy; 0 disables it


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, cfg: ClippedPolicyLossConfig, totals: BatchTotals,
                        reference_logprobs: torch.Tensor | None = None,
                        off_policy_weights: torch.Tensor | None = None,
                        entropy: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate with separate low/high clip (DAPO, Yu et al. 2025, arXiv:2503.14476)
    plus an optional KL penalty to a reference policy and an optional entropy bonus.

    loss_t = -min(r_t A, clip(r_t, 1-clip_low, 1+clip_high) A) + kl_coef * kl_t
    loss   = aggregate(loss_t) - entropy_coef * aggregate(H_t)
    r_t = exp(importance_log_ratio(...)): importance_ratio "token": exp(lp_t - old_lp_t);
         "sequence": GSPO-token, whose value is the geometric mean of the sequence's token ratios
         exp(mean over its masked tokens of lp - old_lp), the same for every token of the sequence
         and clipped as a whole (GSPO uses clip_low 3e-4, clip_high 4e-4); with
         seq-mean-token-mean aggregation and one advantage per sequence this is GSPO's sequence
         objective. Both log-ratios are bounded (see importance_log_ratio).
    dual_clip_c (Ye et al. 2019, arXiv:1912.09729): where A < 0 the loss is at most -c A, so a
         token whose ratio has grown far above 1 gives a bounded loss and no gradient (c > 1).
    kl_t: kl_estimate(lp, ref, kl_estimator).
    off_policy_weights [B, S] (rlkit/algorithms/off_policy.py), if given, multiply each token's
         clipped term (not the KL term): a correction toward the policy that generated the rollout.
    entropy [B, S]: the policy's token entropy H_t, with its gradient; read only when
         entropy_coef > 0, aggregated like the policy loss (verl's entropy_coeff).
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
    ratio = torch.exp(importance_log_ratio(logprobs, old_logprobs, mask, cfg.importance_ratio))
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
    loss = aggregate(per_token, mask, cfg.aggregation, totals, cfg.max_response_tokens)
    if cfg.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the token entropy")
        loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg.aggregation, totals, cfg.max_response_tokens)
    return loss, sums


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor, totals: BatchTotals) -> tuple[torch.Tensor, dict]:
    """Supervised next-token loss: token-mean negative log-likelihood over masked tokens."""
    return aggregate(-logprobs, mask, "token-mean", totals), {}


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Per-sequence logprob [B] from token logprobs [B, S]: the sum over masked tokens, or with
    average their mean (0 for a zero-length sequence). Padding may hold inf/nan."""
    keep = mask.bool()
    total = torch.where(keep, token_logprobs, torch.zeros_like(token_logprobs)).sum(dim=1)
    return total / keep.sum(dim=1).clamp(min=1) if average else total


def preference_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, ld_alpha: float) -> torch.Tensor:
    """Response logprob [2P] of each row of [2P, S] rows that alternate chosen, rejected: the sum
    over its masked tokens, where the tokens of a pair's longer response past the shorter one's
    length (its verbose part) count ld_alpha times. ld_alpha = 1 is the plain sum (DPO); below 1,
    LD-DPO (Liu et al. 2024, arXiv:2409.06411; TRL's ld_alpha): with l_p = min(len_chosen,
    len_rejected), logp = sum over the first l_p masked tokens + ld_alpha * sum over the rest.
    Padding may hold inf/nan."""
    keep = mask.bool()
    lengths = keep.sum(dim=1)
    public = torch.minimum(lengths[0::2], lengths[1::2]).repeat_interleave(2)
    position = keep.cumsum(dim=1)  # among the row's masked tokens, 1 at the first
    weight = torch.where(position <= public.unsqueeze(1), 1.0, ld_alpha).to(token_logprobs.dtype)
    return (torch.where(keep, token_logprobs, torch.zeros_like(token_logprobs)) * weight).sum(dim=1)


LENGTH_NORMALISED_LOSSES = ("sigmoid_norm", "ipo")  # their margin is on per-token log-ratios


@dataclass(frozen=True)
class DPOLossConfig:
    beta: float  # strength of the implicit KL penalty to the reference policy
    label_smoothing: float  # assumed probability that a preference label is flipped (sigmoid: cDPO; robust)
    loss_type: str  # one of DPO_LOSS_TYPES
    sft_weight: float  # weight of an NLL term on the chosen responses, added by the caller
    ld_alpha: float = 1.0  # LD-DPO: weight of each response's verbose part (see preference_logprobs); 1 = DPO


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, reference_chosen_logps: torch.Tensor,
             reference_rejected_logps: torch.Tensor, chosen_lengths: torch.Tensor, rejected_lengths: torch.Tensor,
             cfg: DPOLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct preference loss per pair. Inputs: [P] summed response logprobs (preference_logprobs)
    of the policy and the reference on each pair's chosen and rejected response, and [P] response
    lengths (tokens).

    h_c = chosen - ref_chosen, h_r = rejected - ref_rejected (sequence log-ratios),
    h = h_c - h_r, or for the length-normalised losses h_c / len_c - h_r / len_r (per-token
    log-ratios; TRL divides the same way); z = beta h, eps = label_smoothing
    sigmoid:      DPO (Rafailov et al. 2023, arXiv:2305.18290) with conservative label smoothing
                  (cDPO, Mitchell 2023): -(1 - eps) * logsigmoid(z) - eps * logsigmoid(-z), the
                  binary cross-entropy of sigmoid(z) against the soft label 1 - eps: each pair's
                  loss mixes the loss of the label as given and of the label flipped. eps = 0 is DPO.
    sigmoid_norm: length-normalised DPO (TRL's sigmoid_norm): -logsigmoid(z) on per-token
                  log-ratios; label_smoothing unused.
    robust:       robust DPO (Chowdhury et al. 2024, arXiv:2403.00409), an unbiased loss under
                  labels flipped with probability eps: (-(1 - eps) * logsigmoid(z) + eps *
                  logsigmoid(-z)) / (1 - 2 eps), eps < 1/2. eps = 0 is DPO.
    hinge:        SLiC (Zhao et al. 2023, arXiv:2305.10425): max(0, 1 - z); label_smoothing unused.
    ipo:          IPO (Azar et al. 2023, arXiv:2310.12036): (h - 1 / (2 beta))^2 on per-token
                  log-ratios, so the target does not scale with length; label_smoothing unused.
    Smoothing acts on each pair's loss, before the caller averages over pairs; the metrics
    below do not depend on it. cfg.sft_weight is not applied here: the caller adds
    sft_weight * NLL of the chosen responses.
    Returns (loss [P], metrics of detached [P] tensors); the caller aggregates both. Metrics, the
    same for every loss type (TRL's rewards/*): reward_chosen = beta h_c and reward_rejected =
    beta h_r on the summed log-ratios (also for ipo and sigmoid_norm, whose loss sees per-token
    ones), reward_margin = their difference, accuracy = 1 where the margin is > 0.
    """
    if cfg.loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type '{cfg.loss_type}'; choose one of {DPO_LOSS_TYPES}")
    chosen_log_ratio = chosen_logps - reference_chosen_logps
    rejected_log_ratio = rejected_logps - reference_rejected_logps
    if cfg.loss_type in LENGTH_NORMALISED_LOSSES:
        log_ratio_margin = (chosen_log_ratio / chosen_lengths.clamp(min=1)
                            - rejected_log_ratio / rejected_lengths.clamp(min=1))
    else:
        log_ratio_margin = chosen_log_ratio - rejected_log_ratio  # h
    logit, smoothing = cfg.beta * log_ratio_margin, cfg.label_smoothing
    if cfg.loss_type == "sigmoid":
        loss = -(1.0 - smoothing) * F.logsigmoid(logit) - smoothing * F.logsigmoid(-logit)
    elif cfg.loss_type == "sigmoid_norm":
        loss = -F.logsigmoid(logit)
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


def bradley_terry_loss(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                       margins: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A reward model's loss per pair, from [P] scalar rewards of each pair's chosen and rejected
    response and [P] margins: -logsigmoid(r_c - r_r - m), the negative log-likelihood of the
    preference under the Bradley-Terry model (InstructGPT, Ouyang et al. 2022, arXiv:2203.02155),
    with Llama 2's margin m (Touvron et al. 2023, arXiv:2307.09288): a pair rated far apart asks for
    a wider gap; m = 0 is the plain loss. Returns (loss [P], metrics of detached [P] tensors, as
    dpo_loss names them): reward_chosen, reward_rejected, reward_margin = r_c - r_r (the gap), and
    accuracy = 1 where r_c > r_r (a tie counts as wrong)."""
    gap = chosen_rewards - rejected_rewards
    return -F.logsigmoid(gap - margins), {"reward_chosen": chosen_rewards.detach(),
                                           "reward_rejected": rejected_rewards.detach(),
                                           "reward_margin": gap.detach(), "accuracy": (gap > 0).float()}


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
