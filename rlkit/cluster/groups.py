"""The controller's typed handles on the worker roles: Megatron models (the policy, PPO's
critic) and generation engines. Each method says how it dispatches: every rank, some ranks, or
one data-parallel shard per rank."""

import functools
import operator
from dataclasses import dataclass, replace
from typing import Callable

import ray
import torch

from rlkit.checkpoint import WrittenFiles
from rlkit.cluster.worker_group import WorkerGroup
from rlkit.data.batch import MODEL_INPUTS, Batch, BatchTotals
from rlkit.data.generation import Generations, SamplingParams
from rlkit.data.micro_batches import LENGTH_MASKS
from rlkit.workers.generation.base import GenerationWorker as Engine
from rlkit.workers.generation.hf import HFGenerationWorker
from rlkit.workers.policy.base import TrainingBackend as Model


@dataclass(frozen=True)
class ParallelLayout:
    shard_of_rank: list[int]  # DP rank of each worker
    output_ranks: list[int]  # per DP rank, the worker whose result is that shard's answer

    @property
    def dp_size(self) -> int:
        return len(self.output_ranks)


class ModelWorkers:
    """The Megatron workers of one model (TP x PP x DP ranks): the policy, or PPO's critic."""

    def __init__(self, workers: WorkerGroup):
        self.workers = workers
        coords = workers.every_rank(Model.layout)
        outputs = sorted((c["dp"], c["rank"]) for c in coords if c["is_output"])
        self.layout = ParallelLayout([c["dp"] for c in coords], [rank for _, rank in outputs])

    @property
    def role(self) -> str:
        return self.workers.role

    def _per_shard(self, method: Callable, shards: list, *args) -> list:
        """shards[d] to the ranks of DP rank d; the answer of each shard's output rank."""
        return self.workers.per_shard(method, shards, self.layout.shard_of_rank, self.layout.output_ranks, *args)

    def _split(self, batch: Batch) -> list[Batch]:
        return batch.split(self.layout.dp_size)

    # ---- whole batches, sharded over DP ranks (results gathered on the controller) ---------
    def logprobs(self, batch: Batch) -> torch.Tensor:
        """Token-aligned head outputs (policy: logprobs; critic: values) of every row."""
        return torch.cat(self._per_shard(Model.forward, self._split(batch.select(*_inputs(batch)))))

    def train(self, batch: Batch, totals: BatchTotals, objective: Callable) -> dict:
        """One optimizer step on `batch` minimising `objective` (algorithms/objectives.py); only
        the model inputs and the objective's declared fields travel."""
        shards = self._split(batch.select(*_inputs(batch), *objective.fields))
        return _summed(self._per_shard(Model.train, shards, totals, objective))

    # ---- the step's data held on the workers: tensors travel once --------------------------
    def hold(self, data: Batch | list) -> list:
        """Split `data` per DP rank (or take the per-shard object refs another group holds) and
        keep each shard on its ranks. Returns the shards' object refs."""
        shards = self.workers.share(self._split(data)) if isinstance(data, Batch) else data
        self._per_shard(Model.hold, shards)
        return shards

    def extend_held(self, fields: Batch | list) -> None:
        """Per-sample fields (a Batch, split per DP rank) or per-shard refs from export_held."""
        self._per_shard(Model.extend_held, self._split(fields) if isinstance(fields, Batch) else fields)

    def export_held(self, *names: str) -> list:
        """Per DP shard, an object ref to those held fields (they never reach the controller)."""
        return [refs[0] for refs in self._per_shard_results(Model.export_held, list(names))]

    def forward_held(self, into: str, reference: bool = False) -> list[dict]:
        """Head outputs of the held rows into field `into` (reference=True: the frozen
        reference's); per shard, the logprob agreement sums with the sampler (policy)."""
        return self._per_shard_results(Model.forward_held, into, reference)

    def estimate_held(self, estimator: Callable, rewards: torch.Tensor) -> list[dict]:
        """Token-level advantages on the workers (rewards: per sample, split per DP rank);
        per shard, the estimator's metric sums."""
        return self._per_shard(Model.estimate_held, list(rewards.split(len(rewards) // self.layout.dp_size)),
                               estimator)

    def train_held(self, part: int, parts: int, totals: BatchTotals, objective: Callable) -> dict:
        """One optimizer step on part `part` of `parts` equal slices of every held shard."""
        return _summed(self._per_shard_results(Model.train_held, part, parts, totals, objective))

    def evaluate_held(self, totals: BatchTotals, objective: Callable) -> dict:
        """The objective's loss and metric sums on the held rows, added over shards (no step)."""
        per_shard = self._per_shard_results(Model.evaluate_held, totals, objective)
        return {k: sum(m[k] for m in per_shard) for k in per_shard[0]}

    def _per_shard_results(self, method: Callable, *args) -> list:
        """A call on every rank about its held shard; the answers of the output ranks."""
        results = self.workers.every_rank(method, *args)
        return [results[r] for r in self.layout.output_ranks]

    # ---- every rank ------------------------------------------------------------------------
    def set_temperature(self, temperature: float):
        self.workers.every_rank(Model.set_temperature, temperature)

    def set_learning_rate(self, lr: float):
        self.workers.every_rank(Model.set_learning_rate, lr)

    def init_reference(self, hf_dir: str):
        self.workers.every_rank(Model.init_reference, hf_dir)

    def reset_optimizer(self):
        self.workers.every_rank(Model.reset_optimizer)

    def device_name(self) -> str | None:
        """Rank 0's GPU (a run's GPUs are assumed to be of one kind); None on CPU."""
        return self.workers.only([0], Model.device_name)[0]

    def peak_memory_gb(self) -> float:
        """The most GPU memory any rank held since the last call (each rank's count restarts)."""
        return max(self.workers.every_rank(Model.peak_memory_gb))

    def sleep(self) -> dict:
        """Give the GPUs to a colocated vLLM (policy.offload); {} when nothing moved (CPU, offload
        none). Its metrics name the role: memory freed, host copy seconds (the slowest rank) and
        GB/s (each rank copies over its own link: the slowest), next to the pinned bandwidth."""
        reports = [r for r in self.workers.every_rank(Model.sleep) if r]
        if not reports:
            return {}
        return {f"memory/{self.role}_offloaded_gb": sum(r["freed_bytes"] for r in reports) / 1e9,
                **_copy_metrics(f"{self.role}_sleep", reports),
                "timing/pinned_d2h_gbytes_per_s": min(r["pinned"]["d2h"] for r in reports),
                "timing/pinned_h2d_gbytes_per_s": min(r["pinned"]["h2d"] for r in reports)}

    def wake(self) -> dict:
        """Back on the GPUs after sleep(); its copy metrics ({} if nothing was asleep)."""
        reports = [r for r in self.workers.every_rank(Model.wake) if r]
        return _copy_metrics(f"{self.role}_wake", reports) if reports else {}

    def save_checkpoint(self, directory: str, save_format: str) -> dict[str, float]:
        """Starts it (see finish_checkpoint); the seconds it held training ("held": the slowest
        rank's), and each part's slowest rank."""
        reports = self.workers.every_rank(Model.save_checkpoint, directory, save_format)
        return {part: max(r[part] for r in reports) for part in reports[0]}

    def finish_checkpoint(self, wait: bool) -> WrittenFiles | None:
        """None while the last checkpoint is being written; once it is whole (with wait: once it
        is), what the ranks' background writers made."""
        answers = self.workers.every_rank(Model.finish_checkpoint, wait)
        return None if answers[0] is None else functools.reduce(operator.or_, answers)

    def load_checkpoint(self, directory: str, save_format: str):
        self.workers.every_rank(Model.load_checkpoint, directory, save_format)

    def save_hf(self, out_dir: str):
        self.workers.every_rank(Model.save_hf, out_dir)

    def save_peft_adapter(self, out_dir: str):
        self.workers.every_rank(Model.save_peft_adapter, out_dir)

    def export_hf_weights(self) -> dict[str, torch.Tensor]:
        """Collective; the answer lives on rank 0."""
        return self.workers.every_rank(Model.export_hf_weights)[0]


class GenerationWorkers:
    """Generation engines (vLLM on GPU, HF on CPU), one per worker."""

    def __init__(self, workers: WorkerGroup):
        self.workers = workers

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generations:
        """Prompts split into contiguous chunks, one per worker (each with its own seed);
        results concatenated in prompt order."""
        n = len(self.workers)
        size = -(-len(prompt_ids) // n)
        chunks = [prompt_ids[i * size:(i + 1) * size] for i in range(n)]
        refs = [actor.generate.remote(chunk, replace(params, seed=params.seed * 1000 + i))
                for i, (actor, chunk) in enumerate(zip(self.workers.actors, chunks)) if chunk]
        parts = self.workers.wait(refs, "generate")
        return Generations([t for p in parts for t in p.token_ids], [lp for p in parts for lp in p.logprobs])

    def sleep(self):
        self.workers.every_rank(Engine.sleep)

    def wake(self, part: str = "all"):
        self.workers.every_rank(Engine.wake, part)

    def weights(self) -> list[dict]:
        """HF workers: their HF-named tensors (tests compare them bit for bit)."""
        return self.workers.every_rank(HFGenerationWorker.weights)

    def adapter_weights(self) -> list[dict]:
        """HF workers under refit.peft=adapter: their LoRA adapters (tests compare them bit for bit)."""
        return self.workers.every_rank(HFGenerationWorker.adapter_weights)

    def close(self, timeout_s: float = 5.0):
        """Before the workers are killed: each removes what would outlive it (Engine.close). A
        worker still busy or dead after timeout_s is killed as it is."""
        ray.wait(self.workers.submit(Engine.close), num_returns=len(self.workers), timeout=timeout_s)

    def weight_checksums(self) -> list[dict]:
        """Per engine process, in engine order (Engine.weight_checksums)."""
        return [process for worker in self.workers.every_rank(Engine.weight_checksums) for process in worker]


def _inputs(batch: Batch) -> list[str]:
    """What a forward pass reads, and the masks that say where each row's read outputs end."""
    return [k for k in (*MODEL_INPUTS, *LENGTH_MASKS) if k in batch]


def _summed(per_shard: list[dict]) -> dict:
    """Metric sums added over DP shards (grad_norm: as is)."""
    metrics = {k: sum(m[k] for m in per_shard) for k in per_shard[0] if k != "grad_norm"}
    metrics["grad_norm"] = per_shard[0]["grad_norm"]
    return metrics


def _copy_metrics(name: str, reports: list[dict]) -> dict:
    """timing/{name}: the slowest rank's seconds; timing/{name}_gbytes_per_s: the slowest rank's rate."""
    return {f"timing/{name}": max(r["seconds"] for r in reports),
            f"timing/{name}_gbytes_per_s": min(r["copied_bytes"] / r["seconds"] / 1e9 for r in reports)}
