"""Off-policy correction against the policy that generated the rollout (algorithm.off_policy_correction).

The loss's ratio compares the trained policy to old_logprobs, the trainer's own logprobs of the
rollout. The samples were drawn by the generation engine, whose logprobs (generation_logprobs)
differ from the trainer's even with the same weights (kernels, precision: the train-inference
mismatch) and, when generation runs ahead, by whole weight updates. These weights correct for
that gap, computed once per step where the rollout is held and multiplied into each token's
policy-gradient loss. The behaviour policy is the engine (at the weight version that generated
the rollout: older with algorithm.max_staleness) and the proximal one the trainer's old_logprobs.
"""

from dataclasses import dataclass

import torch

from rlkit.algorithms.losses import LOG_RATIO_BOUND, sequence_logprobs
from rlkit.config.choices import OFF_POLICY_CORRECTIONS
from rlkit.data.batch import Batch


def off_policy_weights(old_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, mask: torch.Tensor,
                       correction: str, tis_cap: float, seq_mask_low: float,
                       seq_mask_high: float) -> tuple[torch.Tensor, dict]:
    """Per-token weights [B, S] for the policy-gradient loss (0 on padding), and metric sums.

    With log-ratio x_t = old_lp_t - gen_lp_t, clamped to [-20, 20]:
    token_tis: truncated importance sampling (Yao et al. 2025, "Your efficient RL framework
               secretly brings you off-policy RL training"; verl rollout_is=token, NeMo-RL tis):
               w_t = min(exp(x_t), tis_cap).
    seq_mask:  masked importance sampling by the sequence's geometric-mean ratio (MIS; verl's
               geometric rejection, NeMo-RL's seq-mask-tis without its token weights): every
               token of a sequence gets w = 1 if exp(mean_t x_t) lies in [seq_mask_low,
               seq_mask_high], else 0. A masked sequence still counts in the aggregation's
               denominators (a zero-weight sample, as in NeMo-RL; verl removes it from the mask).
    Metric sums over the correction's units (token_tis: response tokens; seq_mask: sequences
    with a response token), of the ratio before correction: units, ratio_sum, ratio_min,
    ratio_max, and corrected (units truncated or masked).
    """
    keep = mask.bool()
    log_ratio = torch.where(keep, old_logprobs - generation_logprobs, torch.zeros_like(old_logprobs))
    log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if correction == "token_tis":
        ratio, units = log_ratio.exp(), keep
        corrected = ratio > tis_cap
        weights = ratio.clamp(max=tis_cap)
    elif correction == "seq_mask":
        ratio = sequence_logprobs(log_ratio, mask, average=True).exp()  # [B]
        units = keep.any(dim=1)
        corrected = (ratio < seq_mask_low) | (ratio > seq_mask_high)
        weights = (~corrected).to(old_logprobs.dtype).unsqueeze(1).expand_as(old_logprobs)
    else:
        raise ValueError(f"unknown off-policy correction '{correction}'; choose one of {OFF_POLICY_CORRECTIONS[1:]}")
    counted = ratio[units]
    sums = {"units": counted.numel(), "ratio_sum": counted.sum().item(), "corrected": corrected[units].sum().item(),
            "ratio_min": counted.min().item() if counted.numel() else float("inf"),
            "ratio_max": counted.max().item() if counted.numel() else float("-inf")}
    return torch.where(keep, weights, torch.zeros_like(weights)), sums


def off_policy_metrics(shards: list[dict], correction: str) -> dict:
    """train/importance_weight_{mean,min,max} over every shard's units (tokens for token_tis,
    sequences for seq_mask) and the fraction corrected: train/tis_clip_fraction (tokens whose
    ratio exceeded the cap) or train/seq_mask_fraction (sequences dropped); {} without units."""
    units = sum(s["units"] for s in shards)
    if units == 0:
        return {}
    fraction = "train/tis_clip_fraction" if correction == "token_tis" else "train/seq_mask_fraction"
    return {"train/importance_weight_mean": sum(s["ratio_sum"] for s in shards) / units,
            "train/importance_weight_min": min(s["ratio_min"] for s in shards),
            "train/importance_weight_max": max(s["ratio_max"] for s in shards),
            fraction: sum(s["corrected"] for s in shards) / units}


@dataclass(frozen=True)
class OffPolicyCorrection:
    """On a held shard (after old_logprobs): the field off_policy_weights and its metric sums.
    Runs through the held-shard estimator hook, so it needs no rewards (it is handed them)."""

    correction: str
    tis_cap: float
    seq_mask_low: float
    seq_mask_high: float

    @property
    def fields(self) -> tuple[str, ...]:
        return ("response_mask", "old_logprobs", "generation_logprobs")

    def __call__(self, held: Batch, rewards: torch.Tensor, reduce) -> tuple[dict, dict]:
        weights, sums = off_policy_weights(held["old_logprobs"], held["generation_logprobs"], held["response_mask"],
                                           self.correction, self.tis_cap, self.seq_mask_low, self.seq_mask_high)
        return {"off_policy_weights": weights}, sums
