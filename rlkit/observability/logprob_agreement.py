"""Train-vs-generation logprob agreement: the end-to-end check that refit delivered the weights.

Computed where the logprobs are: each data-parallel shard gives its sums (agreement_sums), the
controller adds them up (agreement_metrics)."""

import torch


def agreement_sums(train_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """Over masked tokens: count, sum and max of |lp_train - lp_gen|, and sum of exp of it."""
    diff = (train_logprobs - generation_logprobs).abs()[mask.bool()]
    return {"tokens": diff.numel(), "abs_sum": diff.sum().item(), "abs_max": diff.max().item() if diff.numel() else 0.0,
            "exp_sum": diff.exp().sum().item()}


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimate of KL(pi || ref) per sampled token, log_ratio = ref - pi's logprob:
    exp(log_ratio) - log_ratio - 1, unbiased and >= 0 (http://joschu.net/blog/kl-approx.html)."""
    return log_ratio.exp() - log_ratio - 1.0


def reference_kl_sums(reference_logprobs: torch.Tensor, logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """Over masked tokens: count and sum of the k3 KL estimate of the policy (logprobs) to the
    reference, unclamped (the loss clamps it: losses.kl_k3), so the metric shows how far the
    policy went. Before the first update the two are the same model, so the sum is exactly 0."""
    log_ratio = (reference_logprobs - logprobs)[mask.bool()]
    return {"tokens": log_ratio.numel(), "kl_sum": k3(log_ratio).sum().item()}


def reference_kl(shards: list[dict]) -> dict:
    """train/reference_kl: the policy's k3 KL to the reference on this step's samples, before the
    step's update (0 at step 1: the reference is the starting policy); {} without tokens."""
    tokens = sum(s["tokens"] for s in shards)
    return {"train/reference_kl": sum(s["kl_sum"] for s in shards) / tokens} if tokens else {}


def agreement_metrics(shards: list[dict]) -> dict:
    """Mean and max |lp_train - lp_gen| and token_mult_prob_error = mean exp(|lp_train - lp_gen|)
    (1.0 means identical distributions) over every shard's tokens; {} without tokens."""
    tokens = sum(s["tokens"] for s in shards)
    if tokens == 0:
        return {}
    return {"refit/logprob_abs_error_mean": sum(s["abs_sum"] for s in shards) / tokens,
            "refit/logprob_abs_error_max": max(s["abs_max"] for s in shards),
            "refit/token_mult_prob_error": sum(s["exp_sum"] for s in shards) / tokens}


def logprob_error(train_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """agreement_metrics of one batch held whole."""
    return agreement_metrics([agreement_sums(train_logprobs, generation_logprobs, mask)])
