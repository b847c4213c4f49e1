"""Refit transports as registered units: how a refit's buckets travel from the policy ranks to
the generation workers. A transport is one TransportSpec, in one module, and one YAML in the
refit config group (configs/refit/<name>.yaml) whose refit.transport selects it: a built-in's
name (TRANSPORTS) or, for one of one's own, "module:attribute", imported as rlkit imports a user's
algorithm module (installed, or from the directory rlkit was started from).

Each side looks the spec up by that name: the config check (check_refit, before any worker
starts), the controller's refit driver (rlkit/cluster/refit_driver.py: the handshake and who
feeds whom), each sending policy rank (rlkit/refit/sender.py: its sending half) and each
generation process (rlkit/refit/receiver.py: its receiving half). A refit over a transport with
halves runs over the refit channel (rlkit/refit/channel.py): the channel carries the start of
each refit and the reports, the halves move the bytes. The cpu transport has no halves: the
controller forwards each bucket through Ray's object store.

Loading a config reads this module, so it imports neither torch nor Ray: the built-ins name their
halves with Lazy.
"""

import importlib.util
from dataclasses import dataclass
from typing import Callable, Protocol

from rlkit.config.choices import BROADCAST_GROUPS, PEFT_MODES
from rlkit.config.named import Lazy, named_attribute
from rlkit.config.schema import ConfigError, RootConfig, check_choice


class SendingHalf(Protocol):
    """A transport's half on a sending policy rank, made once per channel."""

    def prepare(self, plan, fresh_receivers: bool) -> object:
        """Before a refit starts: what the receivers need to set up (RefitStart.setup, e.g.
        cuda_ipc's slot handles), or None. fresh_receivers: they connected anew (first refit, or
        after a failed one)."""

    def send(self, channels: list, plan, pack: Callable) -> None:
        """Every bucket of `plan`, in order, to the receivers on `channels`. pack(buffer) packs the
        next bucket into `buffer` (one this half keeps; None: a new one) and returns it: a
        PackedBucket, or under refit.delta a Frame (rlkit/refit/delta.py)."""


class ReceivingHalf(Protocol):
    """A transport's half in a generation process, made once per standing receiver."""

    def receive(self, channel, plan, start, load: Callable) -> None:
        """Every bucket of `plan`, in order, each handed to load() once it arrived: a PackedBucket,
        or a Frame where start.delta (RefitStart: also the sender's setup)."""


@dataclass(frozen=True)
class BroadcastGroup:
    """One sender's receivers: policy rank `sender`, then every process of `engines`, in engine
    order, each engine's in the order of its GPUs (where a handshake makes a communicator, these
    are its ranks, the sender's 0)."""
    sender: int
    engines: tuple[int, ...]
    engine_gpus: int

    @property
    def world_size(self) -> int:
        return 1 + len(self.engines) * self.engine_gpus

    def first_rank(self, engine: int) -> int:
        """The rank of the engine's first process (its others follow)."""
        return 1 + self.engines.index(engine) * self.engine_gpus


def broadcast_groups(grouping: str, policy_ranks: int, engines: int, engine_gpus: int) -> list[BroadcastGroup]:
    """refit.broadcast_groups: one (policy rank 0 feeds every engine) or spread (engine i is fed by
    policy rank i mod policy_ranks, one group per sending rank, so the ranks send at once; every
    policy rank holds or gathers the whole export, so any can send)."""
    if grouping == "one":
        return [BroadcastGroup(0, tuple(range(engines)), engine_gpus)]
    return [BroadcastGroup(rank, tuple(range(rank, engines, policy_ranks)), engine_gpus)
            for rank in range(min(policy_ranks, engines))]


def one_sender(cfg: RootConfig, policy_ranks: int, engines: int, engine_gpus: int) -> list[BroadcastGroup]:
    """Policy rank 0 feeds every engine."""
    return broadcast_groups("one", policy_ranks, engines, engine_gpus)


def no_checks(cfg: RootConfig) -> None:
    pass


@dataclass(frozen=True)
class TransportSpec:
    name: str  # in log lines and messages
    check: Callable[[RootConfig], None] = no_checks  # its config rules, raising ConfigError (check_refit)
    # () -> SendingHalf on each sending policy rank; (communicator) -> SendingHalf with a handshake.
    # None for both halves: no channel, Ray's object store (the cpu transport)
    sending_half: Callable | None = None
    # () or (communicator) -> ReceivingHalf in each generation process
    receiving_half: Callable | None = None
    # the handshake before the channels open: (host, port, rank, world_size, timeout_s) -> a
    # communicator, made at once by a group's sender (rank 0) and its engines' processes (their
    # BroadcastGroup ranks); each side's half is made with it (nccl's RefitCommunicator)
    join: Callable | None = None
    # who feeds whom: (cfg, policy ranks, engines, GPUs per engine) -> [BroadcastGroup]
    groups: Callable[[RootConfig, int, int, int], list[BroadcastGroup]] = one_sender
    # instead of groups: each generation process takes the policy rank on its own GPU (colocated;
    # cuda_ipc's slots can be mapped on their own GPU only)
    same_gpu: bool = False
    # its halves move refit.delta's frames
    delta: bool = False


def build_half(make: Callable, communicator=None):
    """A half, made with the communicator its transport's handshake made (None: no handshake)."""
    return make() if communicator is None else make(communicator)


def _check_object_store(cfg: RootConfig) -> None:
    if cfg.generation.backend == "vllm":
        raise ConfigError(f"refit.transport: vLLM workers take weights through ['cuda_ipc', 'nccl'] "
                          f"(got: {cfg.refit.transport!r}); use refit=cuda_ipc (colocated) or refit=nccl")


def _check_on_vllm(cfg: RootConfig) -> None:
    if cfg.generation.backend != "vllm":
        raise ConfigError(f"refit.transport: {cfg.refit.transport!r} needs generation.backend=vllm (vLLM engines on "
                          f"NVIDIA GPUs); with generation.backend=hf (CPU machines) use refit=cpu")


def _check_cuda_ipc(cfg: RootConfig) -> None:
    _check_on_vllm(cfg)
    p, g = cfg.policy, cfg.generation
    engine_gpus = g.vllm.tensor_parallel_size
    if cfg.cluster.placement != "colocated" or g.num_workers * engine_gpus != p.num_workers:
        raise ConfigError("refit.transport: cuda_ipc needs cluster.placement=colocated with one policy rank on "
                          "every GPU of the engines: generation.num_workers x generation.vllm.tensor_parallel_size "
                          f"== policy.num_workers (got: {cfg.cluster.placement}, {g.num_workers} x {engine_gpus} vs "
                          f"{p.num_workers}); use refit=nccl for disaggregated placement")
    if cfg.refit.delta:
        raise ConfigError("refit.delta: no gain on one GPU: refit.transport=cuda_ipc hands each bucket to the engine "
                          "on the same GPU without copying it over any link; set refit.delta=false")


def _check_nccl(cfg: RootConfig) -> None:
    _check_on_vllm(cfg)
    if cfg.cluster.placement != "disaggregated":
        raise ConfigError("refit.transport: nccl needs cluster.placement=disaggregated (policy and vLLM on "
                          "different GPUs); use refit=cuda_ipc when colocated")


def _nccl_groups(cfg: RootConfig, policy_ranks: int, engines: int, engine_gpus: int) -> list[BroadcastGroup]:
    return broadcast_groups(cfg.refit.broadcast_groups, policy_ranks, engines, engine_gpus)


# the built-ins, by refit.transport's name (rlkit/refit/transports/ holds their halves)
TRANSPORTS = {
    # Ray's object store: policy rank 0 streams buckets, the controller forwards each to every HF worker
    "cpu": TransportSpec("cpu", _check_object_store, delta=True),
    # colocated: each policy rank packs into two slots on its GPU that the vLLM process there maps
    "cuda_ipc": TransportSpec("cuda_ipc", _check_cuda_ipc, Lazy("rlkit.refit.transports.cuda_ipc:IpcSender"),
                              Lazy("rlkit.refit.transports.cuda_ipc:IpcReceiver"), same_gpu=True),
    # disaggregated: a policy rank broadcasts each bucket to the vLLM processes of its communicator
    "nccl": TransportSpec("nccl", _check_nccl, Lazy("rlkit.refit.transports.nccl:NcclSender"),
                          Lazy("rlkit.refit.transports.nccl:NcclReceiver"),
                          join=Lazy("rlkit.refit.transports.nccl:RefitCommunicator"), groups=_nccl_groups, delta=True),
}


def transport_spec(name: str) -> TransportSpec:
    """refit.transport's spec: a built-in by its name, else the TransportSpec that
    "module:attribute" names; one config error line where there is none."""
    if name in TRANSPORTS:
        return TRANSPORTS[name]
    wrong = (f"refit.transport: must be one of {list(TRANSPORTS)} or a transport of your own as 'module:attribute' "
             f"(got: {name!r}); pick one of those (docs/architecture.md: A refit transport of your own)")
    return named_attribute(name, wrong, "TransportSpec", lambda found: isinstance(found, TransportSpec))


def check_refit(cfg: RootConfig) -> None:
    """refit.*, before any worker starts: the transport's own rules (its spec's check), then those
    every transport shares, then refit.peft's."""
    r = cfg.refit
    check_choice("refit.channel_host", r.channel_host, ("loopback", "node_ip"))
    check_choice("refit.peft", r.peft, PEFT_MODES)
    check_choice("refit.broadcast_groups", r.broadcast_groups, BROADCAST_GROUPS)
    spec = transport_spec(r.transport)
    spec.check(cfg)
    if r.bucket_mb <= 0:
        raise ConfigError(f"refit.bucket_mb: must be > 0 (got: {r.bucket_mb}); e.g. 512 on GPUs")
    if r.delta and not spec.delta:
        raise ConfigError(f"refit.delta: refit.transport={r.transport} does not send deltas; set refit.delta=false")
    if r.delta and r.peft == "adapter":
        raise ConfigError("refit.delta: refit.peft=adapter moves the LoRA adapters alone, never the weights' "
                          "buckets; set refit.delta=false, or refit.peft=merged")
    if r.peft == "adapter":
        _check_adapter_refit(cfg)


def _check_adapter_refit(cfg: RootConfig) -> None:
    """refit.peft=adapter moves policy.peft's adapters, which the HF workers apply with HF peft."""
    if cfg.policy.peft is None:
        raise ConfigError("refit.peft: adapter sends the policy's LoRA adapters alone, and policy.peft is null (the "
                          "policy trains every weight); set refit.peft=merged, or set policy.peft (README \"LoRA\")")
    if cfg.generation.backend == "hf" and importlib.util.find_spec("peft") is None:
        raise ConfigError("refit.peft: adapter on generation.backend=hf applies the adapters with HF peft, which is "
                          "not installed; pip install 'peft>=0.18,<0.19', or set refit.peft=merged")
