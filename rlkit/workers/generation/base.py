"""The generation interface. HF transformers implements it for CPU; vLLM for GPUs. How weights
arrive lives in rlkit/refit/receiver.py: an ObjectStoreReceiver (HF workers, refit.transport=cpu)
or, over a transport with halves, a StandingReceiver in each of the worker's processes. With
refit.peft=adapter a worker instead loads the real base weights itself, with LoRA on
policy.peft's modules, and each refit hands it the adapters alone (load_adapters)."""

from abc import ABC, abstractmethod

from rlkit.data.generation import Generations, SamplingParams


class GenerationWorker(ABC):
    @abstractmethod
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generations: ...

    @abstractmethod
    def generate_requests(self, prompt_ids: list[list[int]], params: list[SamplingParams]) -> Generations:
        """Each prompt with its own params (its seed included): its sample depends on its prompt,
        its params and the weights alone, never on the requests it runs beside, so independent
        trajectories' requests can be sent as they come (env_runner.flow=per_trajectory)."""

    @abstractmethod
    def load_adapters(self, adapters: dict) -> None:
        """refit.peft=adapter: the policy's LoRA adapters ({HF PEFT name: tensor}, as
        TrainingBackend.export_refit_adapters gives them) replace this worker's, every one
        of them consumed and none missing."""

    @abstractmethod
    def join_refit_communicator(self, transport: str, host: str, port: int, world_size: int, first_rank: int,
                                timeout_s: float) -> None:
        """refit.transport's handshake (its spec's join): this worker's processes join the
        communicator of the policy rank that feeds it (rank 0 there), at ranks first_rank on, in
        the order of its GPUs."""

    @abstractmethod
    def start_refit_receiver(self, transport: str, senders: dict[str, tuple], timeout_s: float) -> None:
        """Each process of this worker serves refits from now on, through refit.transport's
        receiving half, from the policy rank that senders names for its GPU
        (rlkit/refit/receiver.py: sender_for)."""

    def weights_changing(self) -> None:
        """A refit is under way whose bytes bypass this actor (a standing receiver's): whatever
        caches results of the old weights is stale."""

    @abstractmethod
    def weight_checksums(self) -> list[dict[str, int]]:
        """Per process of this worker's engine (one, or one per GPU of a tensor-parallel vLLM
        engine, each holding its shards): {parameter name in this backend's model:
        bucket_checksum of its bytes} (verification)."""

    @abstractmethod
    def sleep(self) -> None:
        """Release accelerator memory (weights, KV cache) while the policy trains."""

    @abstractmethod
    def wake(self, part: str = "all") -> None:
        """part="weights" restores only the weights (for a refit while the policy still holds
        its memory); "all" also the KV cache."""

    def startup_phases(self) -> dict:
        """What this worker's start-up took (rlkit/observability/startup.py): set self.startup
        (a PhaseTimes) first thing in __init__."""
        return self.startup.report()

    def close(self) -> None:
        """Just before the worker is killed (ray.kill runs no cleanup inside an actor): remove what
        would outlive its process, e.g. files."""
