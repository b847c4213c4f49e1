"""The generation interface. HF transformers implements it for CPU; vLLM for GPUs."""

from abc import ABC, abstractmethod
from dataclasses import dataclass

from rlkit.refit.plan import PackedBucket, RefitPlan


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float  # 0 means greedy
    top_p: float
    top_k: int  # 0 disables
    seed: int


@dataclass
class Generations:
    """Per prompt, in input order: the generated token ids (ending with EOS unless truncated)
    and the sampler's logprob of each, computed on logits / temperature over the full vocab
    (before top-p/top-k), i.e. the distribution the trainer's logprobs describe."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]


class GenerationWorker(ABC):
    """begin_refit / load_bucket / end_refit are the CPU transport's protocol (buckets through
    Ray's object store). The GPU transports (cuda_ipc, nccl) serve refits from a standing
    receiver that the vLLM worker starts in its engine's processes; it refuses this protocol."""

    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generations: ...

    @abstractmethod
    def begin_refit(self, plan: RefitPlan, verify_checksums: bool) -> None:
        """Check the plan covers exactly this model's weights with matching shapes."""

    @abstractmethod
    def load_bucket(self, packed: PackedBucket) -> None: ...

    @abstractmethod
    def end_refit(self) -> dict:
        """Fail unless every bucket of the plan arrived; return the receiving side's refit metrics."""

    @abstractmethod
    def weight_checksums(self) -> dict[str, int]:
        """{parameter name in this backend's model: bucket_checksum of its bytes} (verification)."""

    @abstractmethod
    def sleep(self) -> None:
        """Release accelerator memory (weights, KV cache) while the policy trains."""

    @abstractmethod
    def wake(self, part: str = "all") -> None:
        """part="weights" restores only the weights (for a refit while the policy still holds
        its memory); "all" also the KV cache."""
