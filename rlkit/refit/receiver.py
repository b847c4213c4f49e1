"""The receiving half of refit, hosted by each generation worker. Buckets are unpacked with the
same RefitPlan the policy packed them with.

ObjectStoreReceiver  HF workers, refit.transport=cpu: buckets arrive as Ray objects, one call each.
StandingReceiver     a thread in each vLLM engine process (or HF worker) serves every refit the
                     policy rank starts over the refit channel (rlkit/refit/channel.py), through
                     the transport's receiving half (rlkit/refit/transport.py); the model's own
                     loader places each tensor the first time a plan is used, later refits replay
                     its copies (replay.py).
Each reports a refit as a Received.
"""

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from rlkit.refit.channel import Channel, ChannelThread, RefitStart
from rlkit.refit.delta import DeltaReceiver, EncodedBucket, Frame, unframe
from rlkit.refit.plan import PackedBucket, RefitIntegrityError, RefitPlan
from rlkit.refit.transport import build_half, transport_spec


@dataclass(frozen=True)
class Received:
    """A generation process's report of one refit."""
    metrics: dict[str, float]  # its side's figures: seconds (timing/...) and others (refit/replayable_fraction)
    # refit.delta: the first bucket whose delta did not rebuild, naming the worker and why; it was
    # not loaded, so the driver redoes the refit dense
    delta_failure: str | None = None


def check_plan_fits(plan: RefitPlan, tensors: dict[str, torch.Tensor], name: str) -> None:
    """A plan that does not cover exactly `tensors` ({HF name: tensor} of worker `name`), or one
    that sends float32 into a tensor held narrower, is an error naming the worker."""
    expected = {n: tuple(t.shape) for n, t in tensors.items()}
    planned = {s.name: s.shape for b in plan.buckets for s in b.slots}
    missing = sorted(set(expected) - set(planned))
    unknown = sorted(set(planned) - set(expected))
    wrong = sorted(n for n in set(planned) & set(expected) if planned[n] != expected[n])
    if missing or unknown or wrong:
        raise RefitIntegrityError(f"refit plan does not match {name}'s model: missing={missing[:5]} "
                                  f"unknown={unknown[:5]} shape-mismatch={wrong[:5]}")
    # float32 on the wire into a bf16 tensor would round what refit.keep_fp32 promised to keep
    narrowed = sorted(s.name for b in plan.buckets for s in b.slots
                      if s.dtype == "float32" and tensors[s.name].dtype != torch.float32)
    if narrowed:
        raise RefitIntegrityError(f"refit.keep_fp32: {name} holds {narrowed[:5]} in "
                                  f"{tensors[narrowed[0]].dtype}, not float32; remove them from the list "
                                  "or keep them float32 in the generation model")


class ObjectStoreReceiver:
    """Copies each bucket's tensors into `tensors` ({HF name: the model's checkpoint tensor}, see
    rlkit/models/checkpoint_names.py; tied weights once, as the exporter sends them). A plan that
    does not cover exactly these tensors, one that sends float32 into a tensor held narrower, and a
    refit that misses a bucket are errors naming the worker.
    With refit.delta buckets arrive encoded (rlkit/refit/delta.py) and are rebuilt from the copy
    this receiver keeps of each; one that fails to rebuild is not loaded but reported by end(),
    and the driver redoes the refit dense."""

    def __init__(self, tensors: dict[str, torch.Tensor], name: str):
        self.tensors, self.name = tensors, name
        self._plan: RefitPlan | None = None
        self._pending: set[int] = set()
        self._delta = DeltaReceiver()

    def begin(self, plan: RefitPlan, verify_checksums: bool) -> bool:
        """Whether this receiver holds the last version of every bucket, so the refit may send deltas."""
        check_plan_fits(plan, self.tensors, self.name)
        self._plan, self._verify = plan, verify_checksums
        self._pending = set(range(len(plan.buckets)))
        return self._delta.begin(plan)

    @torch.no_grad()
    def load(self, bucket: PackedBucket | EncodedBucket) -> None:
        if isinstance(bucket, EncodedBucket):
            rebuilt = self._delta.rebuild(bucket)  # checked against the checksum it carries
            if rebuilt is not None:  # else end() reports the failure
                self._copy_in(PackedBucket(bucket.index, rebuilt, None), verify=False)
        else:
            self._copy_in(bucket, self._verify)
        self._pending.discard(bucket.index)

    def _copy_in(self, packed: PackedBucket, verify: bool) -> None:
        for name, tensor in self._plan.unpack(packed, verify):
            self.tensors[name].copy_(tensor)

    def end(self) -> Received:
        """Fails unless every bucket of the plan arrived; this side's report of the refit."""
        if self._pending:
            raise RefitIntegrityError(f"refit incomplete on {self.name}: buckets {sorted(self._pending)} never arrived")
        self._plan = None
        self._delta.end()
        return _received({}, self._delta, self.name)


class CheckpointTensors:
    """{HF name: tensor} (an HF worker's checkpoint tensors) as a model with vLLM's loader
    interface, so that a StandingReceiver loads into them, and replays, as into a vLLM model."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = tensors

    def parameters(self):
        return iter(self.tensors.values())

    @torch.no_grad()
    def load_weights(self, weights: list[tuple[str, torch.Tensor]]):
        for name, tensor in weights:
            self.tensors[name].copy_(tensor)


class StandingReceiver:
    """Serves refits in a generation process from the policy rank at `address`, through
    `transport` (a receiving half: receiving_half); get_model() is the current model (vLLM's, or
    anything with its load_weights), whose loader is learned once per plan and replayed.
    check_plan(plan), where given, refuses a new plan that does not fit the model.
    load_session(model), where given, is a context that a whole refit's loads run in (vLLM's
    reload that quantizes each layer once its weights are in); the loader then places every
    tensor itself, at every refit."""

    def __init__(self, transport, get_model: Callable[[], torch.nn.Module], address: tuple, name: str,
                 timeout_s: float, check_plan: Callable[[RefitPlan], None] | None = None,
                 load_session: Callable[[torch.nn.Module], ContextManager] | None = None):
        self.transport, self.get_model, self.name, self.check_plan = transport, get_model, name, check_plan
        self.load_session = load_session
        self._replay = None
        self._delta = DeltaReceiver()  # refit.delta: the buckets as rebuilt last, in host memory
        device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.thread = ChannelThread(address, name, self.serve, device, timeout_s)

    def _loader(self, plan: RefitPlan):
        """This plan's replay of this model's loader; a new plan or model is learned again. Under a
        load session, the loader itself (a session moves the tensors a replay would write into)."""
        from rlkit.refit.replay import LoadReplay, ModelLoader

        model = self.get_model()
        if self._replay is None or self._replay.plan != plan or self._replay.model is not model:
            if self.check_plan is not None:
                self.check_plan(plan)
            self._replay = (LoadReplay if self.load_session is None else ModelLoader)(plan, model)
        return self._replay

    def serve(self, channel: Channel, plan: RefitPlan, start: RefitStart) -> Received:
        """One refit. With start.delta (refit.delta) this receiver first tells the sender whether it
        holds every bucket as last sent; each bucket's frame is then rebuilt from that copy, in the
        transport's buffer, and loaded from there like a dense bucket. A delta that does not
        rebuild its bucket is not loaded but reported (Received.delta_failure), and the driver
        redoes the refit dense."""
        replay = self._loader(plan)
        if start.setup is not None:  # new transfer buffers: the replay's views of the old ones go
            replay.release_buffers()
        pending = set(range(len(plan.buckets)))
        if not start.delta:
            def load(packed: PackedBucket):
                replay.load(packed, start.verify)
                pending.discard(packed.index)
        else:
            def load(received: Frame):
                rebuilt = self._delta.rebuild(unframe(received), received.room)  # checked against its checksum
                if rebuilt is not None:
                    replay.load(PackedBucket(received.index, rebuilt, None), verify=False)
                pending.discard(received.index)

            channel.send(self._delta.begin(plan))
        with self.load_session(replay.model) if self.load_session is not None else contextlib.nullcontext():
            self.transport.receive(channel, plan, start, load)
        if pending:  # a transport's receiving half that returned early
            raise RefitIntegrityError(f"refit incomplete on {self.name}: buckets {sorted(pending)} never arrived")
        metrics = {"refit/replayable_fraction": replay.replayable_fraction}
        if not start.delta:
            return Received(metrics)
        self._delta.end()
        return _received(metrics, self._delta, self.name)


def _received(metrics: dict[str, float], delta: DeltaReceiver, name: str) -> Received:
    """A receiver's report: `metrics`, and its delta's (none where no delta refit ran)."""
    if delta.seconds is not None:
        metrics = {**metrics, "timing/refit_delta_apply": delta.seconds}
    return Received(metrics, None if delta.failure is None else f"{name}: {delta.failure}")


ANY_GPU = "any"  # a senders key: the one sender of receivers on every GPU (nccl: their group's policy rank)


def sender_for(senders: dict[str, tuple], gpu: str, name: str) -> tuple:
    """The address of the policy rank that feeds the receiver on GPU `gpu` (its identity, see
    cuda_ipc.gpu_identity): under cuda_ipc the one on the same GPU, whose slots only that GPU can
    map. Each receiver looks up its own GPU: one that took another's sender would load bytes
    meant for another device, or none at all."""
    if ANY_GPU in senders:
        return senders[ANY_GPU]
    if gpu not in senders:
        raise RuntimeError(f"refit: {name} runs on GPU {gpu}, which no policy rank shares (policy ranks on "
                           f"{sorted(senders)}); with refit=cuda_ipc every GPU of the engines needs a policy rank")
    return senders[gpu]


def receiving_half(transport: str, communicator=None):
    """refit.transport's receiving half, made with the communicator its handshake made (if any)."""
    return build_half(transport_spec(transport).receiving_half, communicator)
