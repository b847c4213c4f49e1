"""What every training backend's rank (megatron.py, backends.py) does alike. It holds two
collaborators, the step's held rollout (held_rollout.py) and this rank's half of refit
(rlkit/refit/sender.py), and answers the interface's calls on them in one line each; it names the
accelerator, reports its peak memory and sets or drops the optimizer. A backend gives setup,
forward and backward, and the few answers declared abstract below, which depend on its model and
layout: nothing here calls a method this class does not declare."""

from abc import abstractmethod
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from rlkit.config.schema import PolicyConfig
from rlkit.data.batch import Batch, BatchTotals
from rlkit.observability.profiling import profiled
from rlkit.observability.startup import PhaseTimes
from rlkit.refit.delta import EncodedBucket
from rlkit.refit.plan import PackedBucket, RefitPlan
from rlkit.refit.sender import RefitSender, SentRefit
from rlkit.workers.policy.base import TrainingBackend
from rlkit.workers.policy.hand_over import MemoryHandOver
from rlkit.workers.policy.held_rollout import HeldRollout

ON_GPU = torch.cuda.is_available()

REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


class TrainingRank(TrainingBackend):
    cfg: PolicyConfig
    rank: int  # in the model's process group
    name: str  # "policy" or "critic": its folder in a checkpoint, and in log lines
    head: str  # "lm" (the policy's logprobs), "value" (PPO's critic) or "reward" (a reward model)
    startup: PhaseTimes  # what start-up took, made by the constructor
    hand_over: MemoryHandOver  # memory handed to a colocated engine, made by setup
    optimizer = None  # built at its first use (_optimizer_ready): inference-only uses never pay for it
    lr: float
    rollout: HeldRollout
    refit_sender: RefitSender

    def start_collaborators(self) -> None:
        """The end of a backend's setup: nothing held yet, refit's sender over this rank's export,
        no optimizer yet."""
        self.rollout = HeldRollout()
        self.refit_sender = RefitSender(self)
        self.optimizer = None
        self.lr = self.cfg.optimizer.lr

    # ---- what a backend gives ----------------------------------------------------------
    @abstractmethod
    def reference_logprobs(self, batch: Batch) -> torch.Tensor | None:
        """forward()'s outputs from the frozen reference (init_reference)."""

    @abstractmethod
    def is_output(self) -> bool:
        """Whether this rank's results are its data-parallel shard's answer."""

    @abstractmethod
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks holding the other shards of a batch, each once (None: every rank)."""

    @abstractmethod
    def new_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the trained weights, at the learning rate self.lr."""

    @abstractmethod
    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, HF-layout tensor) of every weight in a fixed order, which refit's sender
        reads. Collective."""

    @abstractmethod
    def export_rows(self):
        """A RowExport (rlkit/bridge) where this rank holds every parameter row the export moves;
        else None (rlkit/refit/sender.py)."""

    # ---- setup, the accelerator and the optimizer ------------------------------------------
    def startup_phases(self) -> dict:
        return self.startup.report()

    def device_name(self) -> str | None:
        return torch.cuda.get_device_name() if ON_GPU else None

    def peak_memory_gb(self) -> float:
        if not ON_GPU:
            return 0.0
        peak = torch.cuda.max_memory_allocated() / 1e9
        torch.cuda.reset_peak_memory_stats()
        return peak

    @profiled
    def wake(self) -> dict:
        """Undo sleep(); every call that touches the model calls it first."""
        return self.hand_over.wake()

    def _optimizer_ready(self) -> torch.optim.Optimizer:
        """Awake, with its optimizer."""
        self.wake()
        if self.optimizer is None:
            self.optimizer = self.new_optimizer()
        return self.optimizer

    def non_finite_gradients(self) -> RuntimeError:
        """The error a train step raises when its gradients are not finite (no step taken)."""
        return RuntimeError(f"{self.name} optimizer step failed on rank {self.rank} (non-finite gradients); lower its "
                            f"learning rate or optimizer.clip_grad, or look for inf/nan in the batch")

    def reset_optimizer(self):
        """Drop optimizer state (rebuilt fresh at the next train step), e.g. between a warm start
        and RL, so a run that just did the warm start and one that loaded it from cache agree."""
        self.optimizer = None

    def set_learning_rate(self, lr: float):
        self.lr = lr
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def reduce_over_data_parallel(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """tensor combined by op ("sum", "min", "max") over this rank's data-parallel group."""
        group = self.data_parallel_group()
        if dist.get_world_size(group) == 1:
            return tensor
        on_device = tensor.to(torch.cuda.current_device() if ON_GPU else "cpu", copy=True)
        dist.all_reduce(on_device, op=REDUCE_OPS[op], group=group)
        return on_device.to(tensor.device)

    def reset(self, args: dict):
        """release(), then take new constructor arguments (another model, layout or rank) for the
        next setup(). The process and its imports stay, for a WarmPool to reuse."""
        self.release()
        self.__init__(**args)

    # ---- the step's rollout, held where it is used (held_rollout.py) ------------------------
    @profiled
    def hold(self, shard: Batch) -> None:
        self.rollout.hold(shard)

    def extend_held(self, fields: Batch) -> None:
        self.rollout.extend(fields)

    def export_held(self, names: list[str]) -> list | None:
        return self.rollout.export(names, self.is_output())

    @profiled
    def forward_held(self, into: str, reference: bool = False) -> dict | None:
        return self.rollout.forward(into, self.reference_logprobs if reference else self.forward, self.head, reference)

    @profiled
    def estimate_held(self, rewards: torch.Tensor, estimator: Callable) -> dict | None:
        return self.rollout.estimate(rewards, estimator, self.reduce_over_data_parallel, self.is_output())

    def train_held(self, part: int, parts: int, totals: BatchTotals, objective: Callable) -> dict | None:
        return self.train(self.rollout.part(part, parts), totals, objective)

    # ---- this rank's half of refit (rlkit/refit/sender.py) -----------------------------------
    def refit_manifest(self) -> list[tuple[str, tuple[int, ...], str]]:
        return self.refit_sender.manifest()

    def stream_refit_buckets(self, plan: RefitPlan, with_checksum: bool, delta: bool = False,
                             base_held: bool = False) -> Iterator[PackedBucket | EncodedBucket]:
        yield from self.refit_sender.stream_buckets(plan, with_checksum, delta, base_held)

    def join_refit_communicator(self, transport: str, host: str, port: int, world_size: int, timeout_s: float):
        self.refit_sender.join(transport, host, port, world_size, timeout_s)

    def refit_gpu(self) -> str:
        """This rank's GPU, as the engine process beside it finds it (cuda_ipc)."""
        from rlkit.refit.transports.cuda_ipc import gpu_identity
        return gpu_identity()

    def open_refit_channel(self, transport: str, receivers: int, timeout_s: float, channel_host: str) -> tuple:
        """channel_host (refit.channel_host): loopback, or node_ip for receivers on other nodes."""
        import ray

        host = "127.0.0.1" if channel_host == "loopback" else ray.util.get_node_ip_address()
        return self.refit_sender.open_channel(transport, receivers, timeout_s, host)

    @profiled
    def send_refit(self, plan: RefitPlan, with_checksum: bool, delta: bool = False) -> SentRefit:
        return self.refit_sender.send(plan, with_checksum, delta)

    def refit_stats(self) -> SentRefit | None:
        return self.refit_sender.sent()
