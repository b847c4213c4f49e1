"""The controller's half of refit: one plan, one owner. The trainer says when the policy's
weights go to the generation workers (push_weights: rlkit/algorithms/async_rollouts.py keeps the
versions), and the driver moves them and orders the colocated memory hand-over around each
generation (hand_over, reclaim).

How bytes travel is the transport's business (refit.transport names its TransportSpec,
rlkit/refit/transport.py); every transport moves the same RefitPlan:
  ObjectStoreTransfer  a transport without halves (cpu): policy rank 0 streams buckets through
                       Ray's object store, the controller forwards each bucket's reference to
                       every generation worker; with refit.delta a bucket travels as its changes
                       since the refit before (rlkit/refit/delta.py)
  ChannelTransfer      a transport with halves (cuda_ipc, nccl, one's own): set up once (the
                       transport's handshake, then a refit channel from each sending policy rank
                       to a standing receiver in each generation process, rlkit/refit/receiver.py);
                       a refit is then one call to the policy's senders (rlkit/refit/sender.py),
                       which return every receiver's report
Every vLLM process receives whole HF tensors; an engine of several GPUs (tensor parallelism)
has one process per GPU, and vLLM's loader takes each one's shard.
Waits inside a refit are bounded by half of cluster.call_timeout_s, so a dead or stuck peer is
named by the side that waited for it before the controller's own wait runs out.

With policy.peft and refit.peft=adapter there is no plan and no transport: every refit is an
  AdapterTransfer  policy rank 0 exports the LoRA adapters alone, the controller puts them into
                   Ray's object store once, and each generation worker applies them over the base
                   it loaded itself (HF peft on CPU, a vLLM LoRA adapter on GPU)
"""

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import replace

import ray

from rlkit.cluster.groups import GenerationWorkers, ModelWorkers
from rlkit.cluster.setup import engine_gpus
from rlkit.cluster.worker_group import rendezvous_address
from rlkit.config.schema import ConfigError, RootConfig
from rlkit.refit.plan import RefitIntegrityError, RefitPlan
from rlkit.refit.receiver import ANY_GPU
from rlkit.refit.sender import SentRefit
from rlkit.refit.transport import BroadcastGroup, TransportSpec, transport_spec
from rlkit.workers.generation.base import GenerationWorker
from rlkit.workers.generation.hf import HFGenerationWorker
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
        spec = transport_spec(cfg.refit.transport)
        if spec.sending_half is None:  # no halves: Ray's object store
            self.transfer = ObjectStoreTransfer(policy, generation, cfg.refit.delta)
        else:
            self.transfer = ChannelTransfer(spec, cfg, policy, generation, placement_group)

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


def _metrics(plan: RefitPlan, seconds: float, sent: SentRefit) -> dict:
    """_throughput, the sender's share of the time (policy rank 0's host seconds in the export and
    in packing; the rest is transport and loading), whether the sender copied parameter rows
    directly, its delta metrics (refit.delta), and the generation workers' reports of their side:
    of each time the highest any of them gave (the slowest worker's), of each other figure the
    lowest (e.g. the share of its load that was replayed)."""
    received = [report.metrics for report in sent.received]
    return {**_throughput(plan.total_bytes, seconds),
            "refit/buckets": len(plan.buckets), "timing/refit_export_host": sent.export_s,
            "timing/refit_pack_host": sent.pack_s, "refit/direct_export": float(sent.direct),
            **sent.delta_metrics,
            **{key: (max if key.startswith("timing/") else min)(report[key] for report in received)
               for key in received[0]}}


class _Transfer(ABC):
    """A refit of the plan into every generation worker, each told first that its weights change
    (a vLLM engine resets its prefix cache at the next generate), which costs the refit nothing.

    With `delta` (refit.delta) the senders encode each bucket against the version they sent
    last, and every worker rebuilds it from its own copy of that version. A refit is dense
    whenever a worker lacks that copy: the first, a restarted worker's, a resumed run's. A delta
    that does not rebuild its bucket (its checksum fails: lost in transit, or the two sides'
    copies differ) costs its worker that copy, so the refit is redone at once, dense, and the run
    goes on; a dense redo that fails too is an error."""

    def __init__(self, policy: ModelWorkers, generation: GenerationWorkers, delta: bool = False):
        self.policy, self.generation, self.delta = policy.workers, generation.workers, delta

    def __call__(self, plan: RefitPlan, verify_checksums: bool) -> dict:
        start = time.perf_counter()
        marks = self.generation.submit(GenerationWorker.weights_changing)
        sent, redone = self._redone_dense_on_failure(lambda: self._move(plan, verify_checksums))
        seconds = time.perf_counter() - start
        self.generation.wait(marks, "weights_changing")
        metrics = _metrics(plan, seconds, sent)
        return {**metrics, "refit/delta_redone": redone} if self.delta else metrics

    @abstractmethod
    def _move(self, plan: RefitPlan, verify_checksums: bool) -> SentRefit:
        """Every bucket from the policy to every generation worker: what the sender did, with every
        worker's report."""

    @staticmethod
    def _redone_dense_on_failure(move) -> tuple[SentRefit, float]:
        """move(), once more if a worker's delta failed: that worker dropped its copies, so the
        second move is dense; one that fails too is an error. Also returns 1.0 if it was redone."""
        sent = move()
        failures = [r.delta_failure for r in sent.received if r.delta_failure is not None]
        if not failures:
            if sent.dense_because is not None:
                log.info("refit: dense, not deltas: %s", sent.dense_because)
            return sent, 0.0
        log.warning("refit: %s; redoing this refit dense", failures[0])
        sent = move()
        again = [r.delta_failure for r in sent.received if r.delta_failure is not None]
        if again:
            raise RefitIntegrityError(f"{again[0]}, also when the refit was redone dense: the buckets are "
                                      "corrupted in transit")
        return sent, 1.0


class ObjectStoreTransfer(_Transfer):
    """Policy rank 0 streams buckets into Ray's object store as it exports them; the controller
    forwards each bucket's reference to every generation worker, so at most a few buckets are in
    flight and the controller never touches the bytes. Ray moves them between nodes: no channel,
    so refit.channel_host does not apply."""

    def _move(self, plan: RefitPlan, verify_checksums: bool) -> SentRefit:
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
        return replace(self.policy.every_rank(Policy.refit_stats)[0], received=tuple(received))


class ChannelTransfer(_Transfer):
    """A transport with halves, `spec`, set up once: its handshake where it has one (spec.join:
    each group's sender and its engines' processes make a communicator), then a refit channel on
    each sending policy rank, and in every generation process a standing receiver connected to
    the policy rank that feeds it: the one on its GPU (spec.same_gpu), else its group's sender
    (spec.groups). A refit is one call to the senders; every group's refit runs at once, each
    sender packing its own copy of every bucket."""

    def __init__(self, spec: TransportSpec, cfg: RootConfig, policy: ModelWorkers, generation: GenerationWorkers,
                 placement_group):
        super().__init__(policy, generation, cfg.refit.delta)
        transport, channel_host = cfg.refit.transport, cfg.refit.channel_host
        timeout_s = self.policy.timeout_s / 2
        if spec.same_gpu:
            gpus = self.policy.every_rank(Policy.refit_gpu)
            addresses = self.policy.every_rank(Policy.open_refit_channel, transport, 1, timeout_s, channel_host)
            senders = [dict(zip(gpus, addresses))] * len(self.generation)
        else:
            groups = spec.groups(cfg, len(self.policy), len(self.generation), engine_gpus(cfg))
            if channel_host == "loopback":
                _check_one_node(self.policy, self.generation, groups)
            if spec.join is not None:
                self._join(transport, groups, placement_group, timeout_s)
            senders = self._open_channels(transport, groups, timeout_s, channel_host)
        self.generation.each(GenerationWorker.start_refit_receiver, [(transport, s, timeout_s) for s in senders])

    def _join(self, transport: str, groups: list[BroadcastGroup], placement_group, timeout_s: float):
        joins, engines = [], []
        for group in groups:  # every side joins before any waits: the communicator forms once all are in
            host, port = rendezvous_address(placement_group, group.sender)  # policy rank r is on bundle r
            joins += self.policy.submit(Policy.join_refit_communicator, transport, host, port, group.world_size,
                                        timeout_s, ranks=[group.sender])
            engines += [ref for engine in group.engines for ref in self.generation.submit(
                GenerationWorker.join_refit_communicator, transport, host, port, group.world_size,
                group.first_rank(engine), timeout_s, ranks=[engine])]
        self.policy.wait(joins, "join_refit_communicator", ranks=[group.sender for group in groups])
        self.generation.wait(engines, "join_refit_communicator", ranks=[e for group in groups for e in group.engines])

    def _open_channels(self, transport: str, groups: list[BroadcastGroup], timeout_s: float,
                       channel_host: str) -> list[dict[str, tuple]]:
        """Each group's sender listens for its engines' processes; per generation worker, its
        sender's address."""
        sender_of = {}
        for group in groups:
            address, = self.policy.only([group.sender], Policy.open_refit_channel, transport, group.world_size - 1,
                                        timeout_s, channel_host)
            sender_of.update(dict.fromkeys(group.engines, address))
        return [{ANY_GPU: sender_of[engine]} for engine in range(len(self.generation))]

    def _move(self, plan: RefitPlan, verify_checksums: bool) -> SentRefit:
        sent = self.policy.wait(self.policy.submit(Policy.send_refit, plan, verify_checksums, self.delta), "send_refit")
        return replace(sent[0], received=tuple(report for rank in sent for report in rank.received))


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
