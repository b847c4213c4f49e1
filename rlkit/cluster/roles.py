"""The controller's view of the worker roles (policy, PPO's critic, generation). Each method
says how it dispatches."""

from dataclasses import dataclass
from typing import Callable

import torch

from rlkit.algorithms.losses import BatchTotals
from rlkit.cluster.worker_group import WorkerGroup
from rlkit.data.batch import Batch
from rlkit.workers.generation.base import Generations, SamplingParams


@dataclass(frozen=True)
class ParallelLayout:
    shard_of_rank: list[int]  # DP rank of each worker
    output_ranks: list[int]  # per DP rank, the worker whose result is that shard's answer

    @property
    def dp_size(self) -> int:
        return len(self.output_ranks)


MODEL_INPUTS = ("input_ids", "position_ids", "segment_ids")  # what a forward pass reads (packing adds the last two)


class PolicyGroup:
    """Megatron workers of one model: the policy, or (CriticGroup) PPO's critic."""

    def __init__(self, workers: WorkerGroup):
        self.workers = workers
        coords = workers.call("layout")
        outputs = sorted((c["dp"], c["rank"]) for c in coords if c["is_output"])
        self.layout = ParallelLayout([c["dp"] for c in coords], [rank for _, rank in outputs])

    def _sharded(self, method: str, batch: Batch, *args, **kwargs) -> list:
        """DP-sharded batch in; one result per DP shard out (from that shard's output rank)."""
        return self.workers.call_sharded(method, batch, self.layout.shard_of_rank, self.layout.output_ranks,
                                         *args, **kwargs)

    @staticmethod
    def _inputs(batch: Batch) -> Batch:
        return batch.select(*[k for k in MODEL_INPUTS if k in batch])

    def logprobs(self, batch: Batch) -> torch.Tensor:
        return torch.cat(self._sharded("forward", self._inputs(batch)))

    def reference_logprobs(self, batch: Batch) -> torch.Tensor:
        return torch.cat(self._sharded("reference_logprobs", self._inputs(batch)))

    def train(self, batch: Batch, totals: BatchTotals, objective: Callable) -> dict:
        """One optimizer step on `batch` minimising `objective` (algorithms/objectives.py);
        metric sums added over DP shards (grad_norm: as is)."""
        per_shard = self._sharded("train", batch, totals, objective)
        metrics = {k: sum(m[k] for m in per_shard) for k in per_shard[0] if k != "grad_norm"}
        metrics["grad_norm"] = per_shard[0]["grad_norm"]
        return metrics

    def call(self, method: str, *args, **kwargs) -> list:
        """Replicated call on every rank (collectives such as export and save)."""
        return self.workers.call(method, *args, **kwargs)

    def rank0(self, method: str, *args, **kwargs):
        """Collective call whose answer lives on rank 0."""
        return self.workers.call(method, *args, **kwargs)[0]


class CriticGroup(PolicyGroup):
    def values(self, batch: Batch) -> torch.Tensor:
        """Token-aligned values: position t holds V(input_ids[:t])."""
        return torch.cat(self._sharded("forward", self._inputs(batch)))


class GenerationGroup:
    def __init__(self, workers: WorkerGroup):
        self.workers = workers

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generations:
        """Prompts split into contiguous chunks, one per worker (each with its own seed);
        results concatenated in prompt order."""
        n = len(self.workers)
        size = -(-len(prompt_ids) // n)
        chunks = [prompt_ids[i * size:(i + 1) * size] for i in range(n)]
        refs = [actor.generate.remote(chunk, SamplingParams(**{**params.__dict__, "seed": params.seed * 1000 + i}))
                for i, (actor, chunk) in enumerate(zip(self.workers.actors, chunks)) if chunk]
        parts = self.workers.wait(refs, "generate")
        return Generations([t for p in parts for t in p.token_ids], [lp for p in parts for lp in p.logprobs])

    def call(self, method: str, *args, **kwargs) -> list:
        return self.workers.call(method, *args, **kwargs)
