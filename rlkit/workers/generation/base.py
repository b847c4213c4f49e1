"""The generation interface. HF transformers implements it for CPU; vLLM for GPUs. How weights
arrive differs per backend and lives in rlkit/refit/receiver.py: HF workers host an
ObjectStoreReceiver, vLLM engines a StandingReceiver in each of their processes."""

from abc import ABC, abstractmethod

from rlkit.data.generation import Generations, SamplingParams


class GenerationWorker(ABC):
    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generations: ...

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
