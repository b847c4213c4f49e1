"""Policy losses: pure functions of token-aligned tensors. Shapes: [B, S] unless noted.

Aggregation over tokens is explicit and global: a loss computed on one micro-batch is that
micro-batch's exact share of the loss over the whole optimizer batch, so gradient accumulation
over micro-batches and DP ranks gives the same gradient as one big batch.
"""

from dataclasses import dataclass

import torch

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


@dataclass(frozen=True)
class BatchTotals:
    """Counts over the whole optimizer batch (all micro-batches, all DP ranks)."""

    num_tokens: float  # masked tokens
    num_sequences: float


def batch_totals(mask: torch.Tensor) -> BatchTotals:
    return BatchTotals(num_tokens=float(mask.sum()), num_sequences=float(mask.shape[0]))


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
    sums (clipped tokens, kl) for metrics; divide by the batch's token count to get means.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logprobs)
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    sums = {"clipped_tokens": ((clipped < unclipped).float() * mask).sum().detach()}
    if cfg.kl_coef > 0:
        if reference_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference_logprobs")
        kl = kl_k3(logprobs, reference_logprobs)
        per_token = per_token + cfg.kl_coef * kl
        sums["kl"] = (kl * mask).sum().detach()
    return aggregate(per_token, mask, cfg.aggregation, totals), sums


def nll_loss(logprobs: torch.Tensor, mask: torch.Tensor, totals: BatchTotals) -> tuple[torch.Tensor, dict]:
    """Supervised next-token loss: token-mean negative log-likelihood over masked tokens."""
    return aggregate(-logprobs, mask, "token-mean", totals), {}


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) over the last dim."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
