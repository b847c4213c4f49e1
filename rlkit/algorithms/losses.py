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

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, totals: BatchTotals) -> torch.Tensor:
    """Reduce per-token values [B, S] to this micro-batch's share of the batch loss.

    token-mean:          sum over all tokens / total tokens in the batch (DAPO)
    seq-mean-token-mean: mean over sequences of each sequence's token mean (GRPO paper)
    seq-mean-token-sum:  mean over sequences of each sequence's token sum (Dr.GRPO)
    """
    masked = torch.where(mask.bool(), values, torch.zeros_like(values))  # padding may hold inf
    if mode == "token-mean":
        return masked.sum() / max(totals.num_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / max(totals.num_sequences, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(totals.num_sequences, 1.0)
    raise ValueError(f"unknown loss aggregation '{mode}'; choose one of {LOSS_AGGREGATIONS}")


def kl_k3(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate k3 = exp(ref - lp) - (ref - lp) - 1 (Schulman 2020):
    unbiased and always >= 0."""
    log_ratio = reference_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1.0


@dataclass(frozen=True)
class ClippedPolicyLossConfig:
    clip_low: float  # ratio lower bound is 1 - clip_low
    clip_high: float  # ratio upper bound is 1 + clip_high (DAPO clip-higher)
    kl_coef: float  # 0 disables the KL term
    aggregation: str


def clipped_policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        mask: torch.Tensor, cfg: ClippedPolicyLossConfig, totals: BatchTotals,
                        reference_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """PPO clipped surrogate with separate low/high clip (DAPO, Yu et al. 2025, arXiv:2503.14476)
    plus an optional k3 KL penalty to a reference policy.

    loss_t = -min(r_t A, clip(r_t, 1-clip_low, 1+clip_high) A) + kl_coef * k3_t,  r_t = exp(lp - old_lp)
    advantages: [B] (one per sample) or [B, S]. Returns (loss, sums) where sums are masked token
    sums (clipped tokens, importance ratio, kl) for metrics; divide by the batch's token count to get means.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    keep = mask.bool()
    # padding may hold inf: zero it before exp, or its NaN gradient would reach the weights
    logprobs, old_logprobs, advantages = (torch.where(keep, x, torch.zeros_like(x))
                                          for x in (logprobs, old_logprobs, advantages))
    if reference_logprobs is not None:
        reference_logprobs = torch.where(keep, reference_logprobs, torch.zeros_like(reference_logprobs))
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    sums = {"clipped_tokens": ((clipped < unclipped) & keep).float().sum().detach(),
            "ratio": torch.where(keep, ratio, torch.zeros_like(ratio)).sum().detach()}
    if cfg.kl_coef > 0:
        if reference_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference_logprobs")
        kl = kl_k3(logprobs, reference_logprobs)
        per_token = per_token + cfg.kl_coef * kl
        sums["kl"] = torch.where(keep, kl, torch.zeros_like(kl)).sum().detach()
    return aggregate(per_token, mask, cfg.aggregation, totals), sums


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor, totals: BatchTotals) -> tuple[torch.Tensor, dict]:
    """Supervised next-token loss: token-mean negative log-likelihood over masked tokens."""
    return aggregate(-logprobs, mask, "token-mean", totals), {}


def sequence_logprobs(token_logprobs: torch.Tensor, mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Per-sequence logprob [B] from token logprobs [B, S]: the sum over masked tokens, or with
    average their mean (0 for a zero-length sequence). Padding may hold inf/nan."""
    keep = mask.bool()
    total = torch.where(keep, token_logprobs, torch.zeros_like(token_logprobs)).sum(dim=1)
    return total / keep.sum(dim=1).clamp(min=1) if average else total


DPO_LOSS_TYPES = ("sigmoid", "ipo")


@dataclass(frozen=True)
class DPOLossConfig:
    beta: float  # strength of the implicit KL penalty to the reference policy
    label_smoothing: float  # cDPO: assumed probability that a preference label is flipped (sigmoid only)
    loss_type: str  # "sigmoid" (DPO) | "ipo"
    sft_weight: float  # weight of an NLL term on the chosen responses, added by the caller


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, reference_chosen_logps: torch.Tensor,
             reference_rejected_logps: torch.Tensor,
             cfg: DPOLossConfig) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Direct preference loss per pair. Inputs: [P] sequence logprobs (see sequence_logprobs) of the
    policy and the reference on each pair's chosen and rejected response.

    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    sigmoid: DPO (Rafailov et al. 2023, arXiv:2305.18290) with conservative label smoothing eps
             (cDPO, Mitchell 2023): -(1 - eps) * logsigmoid(beta h) - eps * logsigmoid(-beta h)
    ipo:     IPO (Azar et al. 2023, arXiv:2310.12036): (h - 1 / (2 beta))^2, label_smoothing unused.
             Pass per-token-averaged logprobs (average=True) so the target does not scale with length.
    cfg.sft_weight is not applied here: the caller adds sft_weight * NLL of the chosen responses.
    Returns (loss [P], metrics of detached [P] tensors); the caller aggregates both. Metrics:
    reward_chosen = beta (chosen - ref_chosen), reward_rejected likewise, reward_margin = their
    difference, accuracy = 1 where the margin is > 0.
    """
    if cfg.loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type '{cfg.loss_type}'; choose one of {DPO_LOSS_TYPES}")
    chosen_log_ratio = chosen_logps - reference_chosen_logps
    rejected_log_ratio = rejected_logps - reference_rejected_logps
    log_ratio_margin = chosen_log_ratio - rejected_log_ratio  # h
    if cfg.loss_type == "sigmoid":
        logit = cfg.beta * log_ratio_margin
        smoothing = cfg.label_smoothing
        loss = -(1.0 - smoothing) * F.logsigmoid(logit) - smoothing * F.logsigmoid(-logit)
    else:
        loss = (log_ratio_margin - 1.0 / (2.0 * cfg.beta)) ** 2
    reward_chosen = (cfg.beta * chosen_log_ratio).detach()
    reward_rejected = (cfg.beta * rejected_log_ratio).detach()
    reward_margin = reward_chosen - reward_rejected
    return loss, {"reward_chosen": reward_chosen, "reward_rejected": reward_rejected,
                  "reward_margin": reward_margin, "accuracy": (reward_margin > 0).float()}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float, aggregation: str, totals: BatchTotals) -> tuple[torch.Tensor, dict]:
    """PPO clipped value loss: the critic regresses returns without moving far from old_values.

    loss_t = 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2); clip <= 0 gives
    0.5 * (V - R)^2. Unmasked positions may hold inf/nan: they get neither loss nor gradient.
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
    return aggregate(0.5 * per_token, mask, aggregation, totals), sums
