"""What a worker's train step minimises. Each objective binds one pure loss from losses.py (for
PolicyGradient, or a function of one's own: algorithm.policy_loss) to the Batch fields it reads,
and declares them (`fields`): only those (and the model's inputs) reach the worker's train step.
The worker stays loss-agnostic and calls `objective(output, micro_batch, totals)` on its model's
output: token-aligned logprobs [b, S] for a policy, values [b, S] for a critic or a reward model.
An objective whose `uses_entropy` is true also finds the policy's token entropy [b, S], with its
gradient, in the micro-batch's field `entropy` (the worker computes it from the logits).
Objectives are frozen dataclasses, so they travel to Ray workers as plain data.
"""

from dataclasses import dataclass
from typing import Callable

import torch

from rlkit.algorithms.losses import (ClippedPolicyLossConfig, DPOLossConfig, aggregate, bradley_terry_loss,
                                     clipped_policy_loss, dpo_loss, nll_loss, preference_logprobs, value_loss)
from rlkit.data.batch import Batch, BatchTotals


@dataclass(frozen=True)
class PolicyGradient:
    """A policy loss on advantages (GRPO, PPO's actor, REINFORCE++, RLOO): the clipped surrogate,
    with its variants (dual-clip, KL estimator, GSPO's sequence ratio, aggregation, entropy bonus)
    in its config, or the function algorithm.policy_loss names, which gets the same arguments
    (rlkit/algorithms/registry.py load_policy_loss); and an optional off-policy correction."""

    loss: ClippedPolicyLossConfig
    mask_key: str = "response_mask"
    off_policy_weighted: bool = False  # the held off_policy_weights multiply the loss (rlkit/algorithms/off_policy.py)
    # (logprobs, old_logprobs, advantages, mask, loss, totals, reference_logprobs=, off_policy_weights=, entropy=)
    # -> (loss, masked token sums); travels to the workers by name, so its module must import there
    loss_function: Callable = clipped_policy_loss

    @property
    def fields(self) -> tuple[str, ...]:
        return ((self.mask_key, "old_logprobs", "advantages") + (("reference_logprobs",) if self.loss.kl_coef > 0 else ())
                + (("off_policy_weights",) if self.off_policy_weighted else ()))

    @property
    def uses_entropy(self) -> bool:
        return self.loss.entropy_coef > 0

    def __call__(self, logprobs: torch.Tensor, batch: Batch, totals: BatchTotals):
        return self.loss_function(
            logprobs, batch["old_logprobs"], batch["advantages"], batch[self.mask_key], self.loss, totals,
            reference_logprobs=batch["reference_logprobs"] if self.loss.kl_coef > 0 else None,
            off_policy_weights=batch["off_policy_weights"] if self.off_policy_weighted else None,
            entropy=batch["entropy"] if self.uses_entropy else None)


@dataclass(frozen=True)
class NextTokenNLL:
    """Supervised fine-tuning: NLL on the tokens of loss_mask."""

    mask_key: str = "loss_mask"
    uses_entropy = False

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.mask_key,)

    def __call__(self, logprobs: torch.Tensor, batch: Batch, totals: BatchTotals):
        return nll_loss(logprobs, batch[self.mask_key], totals)


@dataclass(frozen=True)
class DirectPreference:
    """DPO and its variants (sigmoid_norm, IPO, hinge, robust, LD-DPO's ld_alpha) on pairs. Rows
    alternate chosen, rejected (every split of the batch is even, so a pair never straddles two
    micro-batches); totals.num_sequences counts pairs with a response and totals.num_tokens counts
    chosen response tokens (the optional SFT term's denominator)."""

    loss: DPOLossConfig
    mask_key: str = "loss_mask"
    uses_entropy = False

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.mask_key, "reference_logprobs")

    def __call__(self, logprobs: torch.Tensor, batch: Batch, totals: BatchTotals):
        mask, ld_alpha = batch[self.mask_key], self.loss.ld_alpha
        policy = preference_logprobs(logprobs, mask, ld_alpha)
        reference = preference_logprobs(batch["reference_logprobs"], mask, ld_alpha)
        lengths = mask.sum(dim=1)
        per_pair, metrics = dpo_loss(policy[0::2], policy[1::2], reference[0::2], reference[1::2], lengths[0::2],
                                     lengths[1::2], self.loss)
        loss, sums = over_pairs(per_pair, {**metrics, "chosen_logprob": policy[0::2], "rejected_logprob": policy[1::2]},
                                mask, totals)
        if self.loss.sft_weight > 0:
            loss = loss + self.loss.sft_weight * aggregate(-logprobs[0::2], mask[0::2], "token-mean", totals)
        return loss, sums


@dataclass(frozen=True)
class BradleyTerry:
    """A reward model on pairs (rlkit/algorithms/reward_model.py). Rows alternate chosen, rejected,
    as DirectPreference's do; the model's output is a scalar per position, token-aligned as a
    critic's values are, and a row's reward is the one where its mask is 1: after its last token,
    where the value has read the whole sequence. margins [B] holds each pair's margin on its rows;
    totals.num_sequences counts pairs with a response."""

    mask_key: str = "loss_mask"
    uses_entropy = False

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.mask_key, "margins")

    def __call__(self, values: torch.Tensor, batch: Batch, totals: BatchTotals):
        mask = batch[self.mask_key]
        rewards = torch.where(mask.bool(), values, torch.zeros_like(values)).sum(dim=1)
        return over_pairs(*bradley_terry_loss(rewards[0::2], rewards[1::2], batch["margins"][0::2]), mask, totals)


def over_pairs(per_pair: torch.Tensor, metrics: dict[str, torch.Tensor], mask: torch.Tensor,
               totals: BatchTotals) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """This micro-batch's share of the mean of a pair loss [P] over the batch's pairs with a
    response (totals.num_sequences), and the sums of per-pair metrics [P] over those pairs (detached):
    all-padding pairs, the batch's filler, count for nothing. mask: the rows' [2P, S]."""
    real = (mask[0::2].sum(dim=1) > 0).float()
    return (per_pair * real).sum() / max(totals.num_sequences, 1.0), {k: (v * real).sum().detach()
                                                                      for k, v in metrics.items()}


@dataclass(frozen=True)
class ValueRegression:
    """The critic's clipped value loss against returns (PPO)."""

    clip: float
    aggregation: str
    max_response_tokens: int | None = None  # the seq-mean-token-sum-norm aggregation's constant
    mask_key: str = "response_mask"
    uses_entropy = False

    @property
    def fields(self) -> tuple[str, ...]:
        return (self.mask_key, "old_values", "returns")

    def __call__(self, values: torch.Tensor, batch: Batch, totals: BatchTotals):
        return value_loss(values, batch["old_values"], batch["returns"], batch[self.mask_key], self.clip,
                          self.aggregation, totals, self.max_response_tokens)
