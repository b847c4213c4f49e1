"""The step's rollout held on the ranks that use it, for any training backend: logprobs, values and
token-level advantages are computed into the held shard where it lives, and training reads it, so
token tensors cross the controller once. The backend gives forward, reference_logprobs, train,
head, _is_output and _reduce_over_data_parallel."""

from typing import Callable

import torch

from rlkit.data.batch import Batch, BatchTotals
from rlkit.observability.logprob_agreement import agreement_sums, reference_kl_sums
from rlkit.observability.profiling import profiled


class HeldRollout:
    held: Batch | None = None  # this rank's shard of the step's rollout

    @profiled
    def hold(self, shard: Batch) -> None:
        self.held = shard

    def extend_held(self, fields: Batch) -> None:
        self.held = self.held.with_fields(**fields.tensors)

    def export_held(self, names: list[str]) -> list | None:
        """Output ranks: [an object ref to the held shard's `names`], for another worker group
        (PPO: the policy's logprobs for the critic, its advantages back); the bytes go through
        the object store, not the controller."""
        import ray

        return [ray.put(self.held.select(*names))] if self._is_output() else None

    @profiled
    def forward_held(self, into: str, reference: bool = False) -> dict | None:
        """Head outputs of the held rows (policy: logprobs, critic: values) from the model, or the
        frozen reference, stored as field `into` where they are computed (the last pipeline
        stage). Returns, from output ranks, the agreement sums of these logprobs with the
        sampler's when the held rows carry them, and for the reference its KL sums to the held
        old_logprobs (rlkit/observability/logprob_agreement.py)."""
        output = self.reference_logprobs(self.held) if reference else self.forward(self.held)
        if output is None:
            return None
        self.held = self.held.with_fields(**{into: output})
        if reference and "old_logprobs" in self.held:
            return reference_kl_sums(output, self.held["old_logprobs"], self.held["response_mask"])
        if reference or self.head != "lm" or "generation_logprobs" not in self.held:
            return {}
        return agreement_sums(output, self.held["generation_logprobs"], self.held["response_mask"])

    @profiled
    def estimate_held(self, rewards: torch.Tensor, estimator: Callable) -> dict | None:
        """Token-level advantages where the data is (rewards: this shard's, per sample):
        estimator(held, rewards, reduce) returns new fields (stored) and metric sums (returned
        from output ranks); reduce(tensor, op) combines a statistic over this rank's
        data-parallel group, so whitening sees the whole batch. Runs on the ranks that hold the
        estimator's inputs (the last pipeline stage)."""
        if not all(k in self.held for k in estimator.fields):
            return None
        fields, sums = estimator(self.held, rewards, self._reduce_over_data_parallel)
        self.held = self.held.with_fields(**fields)
        return sums if self._is_output() else None

    def train_held(self, part: int, parts: int, totals: BatchTotals, objective: Callable) -> dict | None:
        return self.train(self.held.split(parts)[part], totals, objective)
