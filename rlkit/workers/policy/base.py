"""The training-backend interface: what the controller (rlkit/cluster/groups.py, setup.py,
warm_pool.py) and the refit driver (rlkit/cluster/refit_driver.py) call on each rank of a trained
model, the policy or PPO's critic. Megatron-Core implements it (megatron.py), as does each
backend in backends.py, over TrainingRank (rank.py), which answers the calls their ranks answer
alike. Calls name these methods (`group.every_rank(TrainingBackend.sleep)`), so a backend is any
class that implements them; each rank holds its data-parallel shard of what it is given.

Collective calls must be made on every rank of the model; the others may go to some ranks only."""

from abc import ABC, abstractmethod
from typing import Callable, Iterator

import torch

from rlkit.checkpoint import WrittenFiles
from rlkit.data.batch import Batch, BatchTotals
from rlkit.refit.delta import EncodedBucket
from rlkit.refit.plan import PackedBucket, RefitPlan
from rlkit.refit.sender import SentRefit


class TrainingBackend(ABC):
    # ---- setup and layout -------------------------------------------------------------
    @abstractmethod
    def setup(self, master_addr: str, master_port: int) -> None:
        """Join the model's process group (its rendezvous at master_addr:master_port), build the
        model and load its weights. Collective. The constructor only imports."""

    @abstractmethod
    def layout(self) -> dict:
        """{"rank", "tp", "pp", "cp", "dp": this rank's coordinates, "is_output": whether its
        results are its data-parallel shard's answer}."""

    @abstractmethod
    def startup_phases(self) -> dict:
        """What this rank's start-up took (rlkit/observability/startup.py)."""

    @abstractmethod
    def device_name(self) -> str | None:
        """The accelerator's name (the controller looks up its peak FLOP/s); None on CPU."""

    # ---- train and forward on whole batches ----------------------------------------------
    @abstractmethod
    def forward(self, batch: Batch) -> torch.Tensor | None:
        """Token-aligned head outputs of every row: logprobs (policy) or values (critic); None
        on ranks whose results are not an answer."""

    @abstractmethod
    def train(self, batch: Batch, totals: BatchTotals, objective: Callable) -> dict | None:
        """One optimizer step minimising objective(head output, micro_batch, totals)
        (rlkit/algorithms/objectives.py); its summed metrics from output ranks, None elsewhere."""

    @abstractmethod
    def set_temperature(self, temperature: float) -> None:
        """Logprobs are of softmax(logits / temperature), as the sampler drew them."""

    @abstractmethod
    def set_learning_rate(self, lr: float) -> None: ...

    @abstractmethod
    def reset_optimizer(self) -> None:
        """Drop optimizer state; the next train step starts it afresh."""

    @abstractmethod
    def init_reference(self, hf_dir: str) -> None:
        """The frozen KL reference: the HF checkpoint in hf_dir."""

    # ---- the step's rollout, held on the ranks that use it ---------------------------------
    @abstractmethod
    def hold(self, shard: Batch) -> None:
        """Keep this rank's shard of the step's rollout for the calls below."""

    @abstractmethod
    def extend_held(self, fields: Batch) -> None:
        """Add per-sample fields (e.g. advantages) to the held shard."""

    @abstractmethod
    def export_held(self, names: list[str]) -> list | None:
        """Output ranks: [an object ref to the held shard's `names`], for another model's ranks."""

    @abstractmethod
    def forward_held(self, into: str, reference: bool = False) -> dict | None:
        """The head outputs of the held rows (or the reference's), stored as field `into`; from
        output ranks, the sums that compare them with the sampler's (or the reference's KL)."""

    @abstractmethod
    def estimate_held(self, rewards: torch.Tensor, estimator: Callable) -> dict | None:
        """Advantages where the data is: estimator(held, rewards, reduce) -> (fields, metric sums)."""

    @abstractmethod
    def train_held(self, part: int, parts: int, totals: BatchTotals, objective: Callable) -> dict | None:
        """One optimizer step on part `part` of `parts` equal slices of the held shard."""

    @abstractmethod
    def evaluate_held(self, totals: BatchTotals, objective: Callable) -> dict | None:
        """The objective's loss and sums on the held rows, without a step."""

    # ---- accelerator memory, handed to a colocated engine and back --------------------------
    @abstractmethod
    def sleep(self) -> dict:
        """Free this rank's accelerator memory (policy.offload); bytes and seconds moved."""

    @abstractmethod
    def wake(self) -> dict:
        """Undo sleep(); bytes and seconds moved ({} when awake)."""

    @abstractmethod
    def peak_memory_gb(self) -> float:
        """The most accelerator memory held since the last call, which starts the next count."""

    # ---- checkpoints -----------------------------------------------------------------
    @abstractmethod
    def save_checkpoint(self, ckpt_dir: str, save_format: str) -> dict[str, float]:
        """Start writing weights, optimizer state and RNG into ckpt_dir; the seconds training was
        held, and in which parts. Collective."""

    @abstractmethod
    def finish_checkpoint(self, wait: bool) -> WrittenFiles | None:
        """None while the last save is being written on some rank; once whole, what this rank
        wrote. Collective."""

    @abstractmethod
    def load_checkpoint(self, ckpt_dir: str, save_format: str) -> None:
        """What save_checkpoint wrote, into any layout. Collective."""

    # ---- exports -------------------------------------------------------------------
    @abstractmethod
    def export_hf_weights(self) -> dict[str, torch.Tensor] | None:
        """Every HF-named weight, on rank 0. Collective."""

    @abstractmethod
    def save_hf(self, out_dir: str) -> None:
        """An HF checkpoint (weights, config, tokenizer) in out_dir. Collective."""

    @abstractmethod
    def save_peft_adapter(self, out_dir: str) -> None:
        """policy.peft's adapters as an HF PEFT folder over the base. Collective."""

    # ---- this rank's half of refit (rlkit/refit/sender.py) -----------------------------
    @abstractmethod
    def refit_manifest(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(HF name, shape, dtype) of each exported weight, in export order. Collective."""

    @abstractmethod
    def refit_gpu(self) -> str:
        """This rank's GPU, as a colocated engine process finds it."""

    @abstractmethod
    def open_refit_channel(self, transport: str, receivers: int, timeout_s: float, channel_host: str) -> tuple:
        """Listen for the engines' receivers, which refit.transport `transport`'s sending half
        will feed; the address they connect to."""

    @abstractmethod
    def join_refit_communicator(self, transport: str, host: str, port: int, world_size: int,
                                timeout_s: float) -> None:
        """refit.transport's handshake: join the communicator that carries the weights to the
        engines (nccl's), as its rank 0."""

    @abstractmethod
    def stream_refit_buckets(self, plan: RefitPlan, with_checksum: bool, delta: bool = False,
                             base_held: bool = False) -> Iterator[PackedBucket | EncodedBucket]:
        """refit.transport=cpu: the plan's buckets, yielded by rank 0 as each is packed, into Ray's
        object store (refit.delta: as changes since the last refit where every receiver holds it,
        base_held). Collective."""

    @abstractmethod
    def send_refit(self, plan: RefitPlan, with_checksum: bool, delta: bool = False) -> SentRefit:
        """Send the weights as the plan lays them out, over this rank's channel; what it did, with
        the receivers' reports. Collective."""

    @abstractmethod
    def refit_stats(self) -> SentRefit | None:
        """The last refit this rank exported for (stream_refit_buckets: Ray's object store)."""

    @abstractmethod
    def export_refit_adapters(self, dtype: str) -> dict[str, torch.Tensor] | None:
        """refit.peft=adapter: the adapters alone, on rank 0. Collective."""

    # ---- a warm pool's idle process (rlkit/cluster/warm_pool.py) --------------------------
    @abstractmethod
    def release(self) -> None:
        """Leave the process group and drop the model; only reset() may follow."""

    @abstractmethod
    def reset(self, args: dict) -> None:
        """release(), then take new constructor arguments for the next setup()."""
