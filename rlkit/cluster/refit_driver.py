"""The controller's half of refit: one plan, one owner. The trainer says when the policy's
weights go to the generation workers (push_weights: rlkit/algorithms/async_rollouts.py keeps the
versions), and the driver moves them and orders the colocated memory hand-over around each
generation (hand_over, reclaim).

How bytes travel is the transport's business; every transport moves the same RefitPlan:
  cpu       Ray's object store: policy rank 0 streams buckets, the controller forwards each
            bucket's reference to every generation worker (HF workers); with refit.delta a
            bucket travels as its changes since the refit before (rlkit/refit/delta.py)
  cuda_ipc  colocated: each policy rank packs into two slots on its GPU that the vLLM process on
            that GPU maps through CUDA IPC handles (rlkit/refit/transports/cuda_ipc.py)
  nccl      disaggregated: a policy rank broadcasts each bucket to the vLLM processes of its
            communicator: policy rank 0 to all of them, or (refit.broadcast_groups=spread)
            policy rank i to engine i, every engine at once (rlkit/refit/transports/nccl.py)
Every vLLM process receives whole HF tensors; an engine of several GPUs (tensor parallelism)
has one process per GPU, and vLLM's loader takes each one's shard.
The GPU transports start, once, a standing receiver in each vLLM worker process
(rlkit/refit/receiver.py); a refit is then one call to the policy (its sender,
rlkit/refit/sender.py), which starts it on its channel and returns every receiver's report.
Waits inside a refit are bounded by half of cluster.call_timeout_s, so a dead or stuck peer is
named by the side that waited for it before the controller's own wait runs out.

With policy.peft and refit.peft=adapter there is no plan and no transport: every refit is an
  AdapterTransfer  policy rank 0 exports the LoRA adapters alone, the controller puts them into
                   Ray's object store once, and each generation worker applies them over the base
                   it loaded itself (HF peft on CPU, a vLLM LoRA adapter on GPU)
"""

import logging
import time

import ray

from rlkit.cluster.groups import GenerationWorkers, ModelWorkers
from rlkit.cluster.setup import engine_gpus
from rlkit.cluster.worker_group import rendezvous_address
from rlkit.config.schema import ConfigError, RootConfig
from rlkit.refit.plan import RefitIntegrityError, RefitPlan
from rlkit.refit.receiver import ANY_GPU, DELTA_FAILURE
from rlkit.refit.transports.nccl import BroadcastGroup, broadcast_groups
from rlkit.workers.generation.base import GenerationWorker
from rlkit.workers.generation.hf import HFGenerationWorker
from rlkit.workers.generation.vllm import VLLMGenerationWorker
from rlkit.workers.policy.base import TrainingBackend as Policy

log = logging.getLogger("rlkit")


class RefitDriver:
    def __init__(self, cfg: RootConfig, policy: ModelWorkers, generation: GenerationWorkers, placement_group,
                 sleepers: list[ModelWorkers]):
        """sleepers: the models that leave the GPU to a colocated vLLM while it generates."""
        self.policy, self.generation, self.sleepers = policy, generation, sleepers
        self.verify = cfg.refit.verify_checksums
        if cfg.refit.peft == "adapter":  # the base weights never move: no plan, no transport
            self.plan, self.transfer = None, AdapterTransfer(policy, generation, cfg.generation.precision)
            return
        self.manifest = policy.workers.every_rank(Policy.refit_manifest)[0]  # (HF name, shape, dtype) in export order
        self.plan = RefitPlan.build(self.manifest, int(cfg.refit.bucket_mb * 2**20),
                                    transfer_dtype="bfloat16" if cfg.generation.precision == "bf16" else None,
                                    keep_fp32=tuple(cfg.refit.keep_fp32))
        channel_host = cfg.refit.channel_host
        if cfg.refit.transport == "nccl":
            self.transfer = NcclTransfer(policy, generation, placement_group, channel_host,
                                         broadcast_groups(cfg.refit.broadcast_groups, len(policy.workers),
                                                          len(generation.workers), engine_gpus(cfg)), cfg.refit.delta)
        elif cfg.refit.transport == "cuda_ipc":
            self.transfer = CudaIpcTransfer(policy, generation, placement_group, channel_host)
        else:
            self.transfer = ObjectStoreTransfer(policy, generation, placement_group, channel_host, cfg.refit.delta)

    def push_weights(self) -> dict:
        """The policy's current weights into every generation worker; its metrics. The caller
        says when: after training changed them, or a checkpoint load."""
        self.generation.wake("weights")
        return self.transfer() if self.plan is None else self.transfer(self.plan, self.verify)

    def hand_over(self) -> dict:
        """Before generating: (colocated on GPU) the trained models sleep, and the engines wake
        their KV cache in the memory that freed. Returns the memory metrics."""
        metrics = {}
        for model in self.sleepers:
            metrics.update(model.sleep())
        self.generation.wake()
        return metrics

    def sync(self) -> dict:
        """A one-off refit, ready to generate: push_weights, then hand_over."""
        return {**self.push_weights(), **self.hand_over()}

    def reclaim(self) -> dict:
        """After generating: the engines sleep and the trained models come back to the GPU (they
        would at their next call anyway: here it is timed). Returns the wake metrics."""
        self.generation.sleep()
        metrics = {}
        for model in self.sleepers:
            metrics.update(model.wake())
        return metrics


def _throughput(nbytes: int, seconds: float) -> dict:
    """Time, size and throughput of a whole refit (every mode reports these)."""
    return {"timing/refit_transfer": seconds, "refit/bytes": nbytes,
            "timing/refit_gbytes_per_s": nbytes / seconds / 1e9}


def _metrics(plan: RefitPlan, seconds: float, sender: dict, received: list[dict]) -> dict:
    """_throughput, the sender's share of the time (policy rank 0's host seconds in the export and
    in packing; the rest is transport and loading), whether the sender copied parameter rows
    directly, its delta metrics (refit.delta), and the generation workers' reports of their side:
    of each time the highest any of them gave (the slowest worker's), of each other figure the
    lowest (e.g. the share of its load that was replayed)."""
    return {**_throughput(plan.total_bytes, seconds),
            "refit/buckets": len(plan.buckets), "timing/refit_export_host": sender["export"],
            "timing/refit_pack_host": sender["pack"], "refit/direct_export": float(sender["direct"]),
            **sender["delta"],
            **{key: (max if key.startswith("timing/") else min)(report[key] for report in received)
               for key in received[0]}}


class ObjectStoreTransfer:
    """Policy rank 0 streams buckets into Ray's object store as it exports them; the controller
    forwards each bucket's reference to every generation worker, so at most a few buckets are in
    flight and the controller never touches the bytes. Ray moves them between nodes: no channel,
    so channel_host does not apply.

    With `delta` (refit.delta) the sender encodes each bucket against the version it sent last
    and every worker rebuilds it from its own copy of that version. A refit is dense whenever a
    worker lacks that copy: the first, a restarted worker's, a resumed run's. A delta that does
    not rebuild its bucket (its checksum fails: lost in transit, or the two sides' copies differ)
    costs its worker that copy, so the refit is redone at once, dense, and the run goes on; a
    dense redo that fails too is an error."""

    def __init__(self, policy: ModelWorkers, generation: GenerationWorkers, placement_group, channel_host: str,
                 delta: bool = False):
        self.policy, self.generation = policy.workers, generation.workers
        self.delta = delta

    def __call__(self, plan: RefitPlan, verify_checksums: bool) -> dict:
        start = time.perf_counter()
        sender, received, redone = _redone_dense_on_failure(lambda: self._move(plan, verify_checksums))
        metrics = _metrics(plan, time.perf_counter() - start, sender, received)
        return {**metrics, "refit/delta_redone": redone} if self.delta else metrics

    def _move(self, plan: RefitPlan, verify_checksums: bool) -> tuple[dict, list[dict]]:
        """Every bucket from policy rank 0 to every generation worker: the sender's stats and the
        workers' reports."""
        held = self.generation.every_rank(HFGenerationWorker.begin_refit, plan, verify_checksums)
        streams = [actor.stream_refit_buckets.options(num_returns="streaming").remote(plan, verify_checksums,
                                                                                      self.delta, all(held))
                   for actor in self.policy.actors]
        loads, owners = [], []
        for bucket_ref in streams[0]:
            loads += self.generation.submit(HFGenerationWorker.load_bucket, bucket_ref)
            owners += range(len(self.generation))
        for rank, stream in enumerate(streams[1:], start=1):  # other ranks only join the collectives
            self.policy.wait(list(stream), "stream_refit_buckets", ranks=[rank])
        self.generation.wait(loads, "load_bucket", ranks=owners)
        received = self.generation.every_rank(HFGenerationWorker.end_refit)
        return self.policy.every_rank(Policy.refit_stats)[0], received


def _redone_dense_on_failure(move) -> tuple[dict, list[dict], float]:
    """move() -> (the sender's stats, the workers' reports), once more if a worker's delta failed:
    that worker dropped its copies, so the second move is dense; one that fails too is an error.
    Also returns 1.0 if it was redone."""
    sender, received = move()
    failures = _delta_failures(received)
    if not failures:
        return sender, received, 0.0
    log.warning("refit: %s; redoing this refit dense", failures[0])
    sender, received = move()
    again = _delta_failures(received)
    if again:
        raise RefitIntegrityError(f"{again[0]}, also when the refit was redone dense: the buckets are "
                                  "corrupted in transit")
    return sender, received, 1.0


def _delta_failures(received: list[dict]) -> list[str]:
    """The workers' delta failures (each names the worker and the bucket), taken out of their reports."""
    return [report.pop(DELTA_FAILURE) for report in received if DELTA_FAILURE in report]


class _ChannelTransfer:
    """A refit is one call to the policy's senders; the generation workers are told their
    weights change in parallel (their prefix cache is reset at the next generate), which costs
    the refit nothing. With `delta` (refit.delta; nccl) the senders send each bucket's encoding
    against the version they sent last, and a failed delta is redone dense, as
    ObjectStoreTransfer does."""

    delta = False

    def __call__(self, plan: RefitPlan, verify_checksums: bool) -> dict:
        start = time.perf_counter()
        marks = self.generation.submit(VLLMGenerationWorker.weights_changing)
        sender, received, redone = _redone_dense_on_failure(lambda: self._send(plan, verify_checksums))
        seconds = time.perf_counter() - start
        self.generation.wait(marks, "weights_changing")
        metrics = _metrics(plan, seconds, sender, received)
        return {**metrics, "refit/delta_redone": redone} if self.delta else metrics

    def _send(self, plan: RefitPlan, verify_checksums: bool) -> tuple[dict, list[dict]]:
        sent = self.policy.wait(self.policy.submit(Policy.send_refit, plan, verify_checksums, self.delta), "send_refit")
        return sent[0], [r for rank in sent for r in rank.get("received", [])]

    def _start_receivers(self, transport: str, senders: dict[str, tuple], timeout_s: float):
        """Every process of every engine serves refits from the sender that senders names for
        its GPU (rlkit/refit/receiver.py: sender_for)."""
        self.generation.every_rank(VLLMGenerationWorker.start_refit_receiver, transport, senders, timeout_s)


class CudaIpcTransfer(_ChannelTransfer):
    """Colocated: every GPU holds one policy rank and one process of an engine (an engine of
    several GPUs has one on each), which receives from that rank alone: the policy rank's
    slots are mapped by the process on the same GPU, found by the GPU's identity."""

    def __init__(self, policy: ModelWorkers, generation: GenerationWorkers, placement_group, channel_host: str):
        self.policy, self.generation = policy.workers, generation.workers
        timeout_s = self.policy.timeout_s / 2
        gpus = self.policy.every_rank(Policy.refit_gpu)
        addresses = self.policy.every_rank(Policy.open_refit_channel, "cuda_ipc", 1, timeout_s, channel_host)
        self._start_receivers("cuda_ipc", dict(zip(gpus, addresses)), timeout_s)


class NcclTransfer(_ChannelTransfer):
    """One communicator per broadcast group (made once): its policy rank's channel reaches the
    receivers of its engines' processes. The groups' refits run at once, each sender packing its
    own copy of every bucket."""

    def __init__(self, policy: ModelWorkers, generation: GenerationWorkers, placement_group, channel_host: str,
                 groups: list[BroadcastGroup], delta: bool = False):
        self.policy, self.generation = policy.workers, generation.workers
        self.delta = delta
        if channel_host == "loopback":
            _check_one_node(self.policy, self.generation, groups)
        timeout_s = self.policy.timeout_s / 2
        joins, engines = [], []
        for group in groups:  # every side joins before any waits: the communicator forms once all are in
            host, port = rendezvous_address(placement_group, group.sender)  # policy rank r is on bundle r
            joins += self.policy.submit(Policy.join_refit_communicator, host, port, group.world_size, timeout_s,
                                        ranks=[group.sender])
            engines += [ref for engine in group.engines for ref in self.generation.submit(
                VLLMGenerationWorker.join_refit_communicator, host, port, group.world_size, group.first_rank(engine),
                timeout_s, ranks=[engine])]
        self.policy.wait(joins, "join_refit_communicator", ranks=[group.sender for group in groups])
        self.generation.wait(engines, "join_refit_communicator", ranks=[e for group in groups for e in group.engines])
        sender_of = {}  # engine -> its policy rank's channel
        for group in groups:
            address, = self.policy.only([group.sender], Policy.open_refit_channel, "nccl", group.world_size - 1,
                                        timeout_s, channel_host)
            sender_of.update(dict.fromkeys(group.engines, address))
        self.generation.each(VLLMGenerationWorker.start_refit_receiver,
                             [("nccl", {ANY_GPU: sender_of[engine]}, timeout_s) for engine in range(len(self.generation))])


class AdapterTransfer:
    """refit.peft=adapter: only policy.peft's LoRA adapters move, a few MB where the merged refit
    moves the whole model. Every policy rank joins the bridge's collective adapter export; rank 0
    returns them (HF PEFT names, CPU, the generation precision), the controller puts them into Ray's
    object store once, and every generation worker applies that one object over its own base."""

    def __init__(self, policy: ModelWorkers, generation: GenerationWorkers, precision: str):
        self.policy, self.generation = policy.workers, generation.workers
        self.dtype = "bfloat16" if precision == "bf16" else "float32"

    def __call__(self) -> dict:
        start = time.perf_counter()
        adapters = self.policy.every_rank(Policy.export_refit_adapters, self.dtype)[0]
        self.generation.every_rank(GenerationWorker.load_adapters, ray.put(adapters))
        return _throughput(sum(t.numel() * t.element_size() for t in adapters.values()), time.perf_counter() - start)


def _check_one_node(policy, generation, groups: list[BroadcastGroup]) -> None:
    """A loopback channel reaches only its own node: say so before the receivers time out."""
    policy_ips, engine_ips = policy.node_ips(), generation.node_ips()
    elsewhere = [f"generation worker {e} is on {engine_ips[e]}, policy rank {g.sender} (its sender) on "
                 f"{policy_ips[g.sender]}" for g in groups for e in g.engines if engine_ips[e] != policy_ips[g.sender]]
    if elsewhere:
        raise ConfigError(f"refit.channel_host=loopback reaches one node only, but {'; '.join(elsewhere)}; "
                          f"set refit.channel_host=node_ip to refit across nodes")
