"""The step's rollout held on the ranks that use it, for any training backend: logprobs, values and
token-level advantages are computed into the held shard where it lives, and training reads it, so
token tensors cross the controller once. The rank (rank.py) hands each call what it needs from the
model: a head function, its head, whether its results are an answer, its data-parallel reduce."""

from typing import Callable

import torch

from rlkit.data.batch import Batch
from rlkit.observability.logprob_agreement import agreement_sums, reference_kl_sums

# (tensor, op: "sum" | "min" | "max") -> the tensor combined over a rank's data-parallel group
Reduce = Callable[[torch.Tensor, str], torch.Tensor]


class HeldRollout:
    def __init__(self):
        self.held: Batch | None = None  # this rank's shard of the step's rollout

    def hold(self, shard: Batch) -> None:
        self.held = shard

    def extend(self, fields: Batch) -> None:
        self.held = self.held.with_fields(**fields.tensors)

    def export(self, names: list[str], is_output: bool) -> list | None:
        """Output ranks: [an object ref to the held shard's `names`], for another worker group
        (PPO: the policy's logprobs for the critic, its advantages back); the bytes go through
        the object store, not the controller."""
        import ray

        return [ray.put(self.held.select(*names))] if is_output else None

    def forward(self, into: str, head_fn: Callable[[Batch], torch.Tensor | None], head: str,
                reference: bool) -> dict | None:
        """head_fn's outputs for the held rows (policy: logprobs, critic: values; the frozen
        reference's when `reference`), stored as field `into` where they are computed (head_fn
        gives None elsewhere). Returns the agreement sums of an "lm" head's logprobs with the
        sampler's when the held rows carry them, and for the reference its KL sums to the held
        old_logprobs (rlkit/observability/logprob_agreement.py)."""
        output = head_fn(self.held)
        if output is None:
            return None
        self.held = self.held.with_fields(**{into: output})
        if reference and "old_logprobs" in self.held:
            return reference_kl_sums(output, self.held["old_logprobs"], self.held["response_mask"])
        if reference or head != "lm" or "generation_logprobs" not in self.held:
            return {}
        return agreement_sums(output, self.held["generation_logprobs"], self.held["response_mask"])

    def estimate(self, rewards: torch.Tensor, estimator: Callable, reduce: Reduce, is_output: bool) -> dict | None:
        """Token-level advantages where the data is (rewards: this shard's, per sample):
        estimator(held, rewards, reduce) returns new fields (stored) and metric sums (returned
        when is_output); reduce combines a statistic over the rank's data-parallel group, so
        whitening sees the whole batch. None where the estimator's inputs are not held (not the
        last pipeline stage)."""
        if not all(k in self.held for k in estimator.fields):
            return None
        fields, sums = estimator(self.held, rewards, reduce)
        self.held = self.held.with_fields(**fields)
        return sums if is_output else None

    def part(self, part: int, parts: int) -> Batch:
        """Slice `part` of `parts` equal slices of the held shard (one optimizer step's rows)."""
        return self.held.split(parts)[part]
