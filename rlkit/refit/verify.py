"""Train-vs-generation logprob agreement: the end-to-end check that refit delivered the weights."""

import torch


def logprob_error(train_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, mask: torch.Tensor) -> dict:
    """Over masked tokens: mean and max |lp_train - lp_gen|, and token_mult_prob_error =
    mean exp(|lp_train - lp_gen|) (1.0 means identical distributions)."""
    diff = (train_logprobs - generation_logprobs).abs()[mask.bool()]
    if diff.numel() == 0:
        return {}
    return {"refit/logprob_abs_error_mean": diff.mean().item(), "refit/logprob_abs_error_max": diff.max().item(),
            "refit/token_mult_prob_error": diff.exp().mean().item()}
