"""The sending half of refit, hosted by each policy worker (rlkit/workers/policy/megatron.py).

The host gives it a narrow export interface (ExportSource): wake the weights, the bridge's
HF-named export stream, and, where one rank holds every weight, the parameters' rows that make
each HF tensor. The sender turns either into the plan's packed buckets: streamed through Ray's
object store (the cpu transport), or through a transport's sending half (rlkit/refit/transport.py)
to the standing receivers of the generation workers, one call per refit. Each refit's outcome is
a SentRefit.
"""

import time
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from rlkit.refit.channel import ChannelServer
from rlkit.refit.delta import DeltaSender, EncodedBucket, frame
from rlkit.refit.plan import PackedBucket, RefitPlan
from rlkit.refit.receiver import Received
from rlkit.refit.transport import build_half, transport_spec


class ExportSource(Protocol):
    rank: int
    name: str  # "policy": for log lines

    def wake(self) -> None: ...

    def hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, HF-layout tensor) in a fixed order. Collective over the model's ranks."""

    def export_rows(self):
        """A RowExport (rlkit/bridge) where the bridge's conversion only moves parameter rows and
        this rank holds them all; else None."""


@dataclass(frozen=True)
class SentRefit:
    """What one refit's sending side did, on one policy rank (a rank that only joins the bridge
    export's collectives sent nothing)."""
    bytes_sent: int  # to the receivers: the plan's buckets, or under refit.delta their encodings
    delta: bool  # refit.delta, and every receiver held the last refit's buckets: each went as its changes
    dense_because: str | None  # refit.delta, yet every bucket went dense: why (DeltaSender.begin)
    export_s: float  # host seconds exporting (kernels may still run after: the sender's share of the time)
    pack_s: float  # host seconds packing
    direct: bool  # copied parameter rows directly (else through the bridge)
    delta_metrics: dict[str, float]  # refit.delta: DeltaSender.metrics (empty without it)
    received: tuple[Received, ...] = ()  # the receivers' reports, where a transport's halves moved the bytes


class RefitSender:
    def __init__(self, source: ExportSource):
        self.source = source
        self._row_export = None  # set by manifest() where refits can copy rows directly
        # a direct export's packing copies per (bucket, buffer address, size), for one plan: the
        # GPU transports pack into the same two buffers at every refit
        self._pack_copies: dict[tuple[int, int, int], tuple[list, list]] = {}
        self._server: ChannelServer | None = None  # the channel's listening end
        self._transport = None  # the transport's sending half (rlkit/refit/transport.py SendingHalf)
        self.communicator = None  # what the transport's handshake made (join), e.g. nccl's communicator
        self._plan = self._sources = None  # of the refit in progress (or the last one)
        self._seconds = {"export": 0.0, "pack": 0.0}  # of the refit in progress (or the last one)
        self._delta = DeltaSender()  # refit.delta: the buckets as last sent (empty until a delta refit)
        self._last: SentRefit | None = None  # of the last refit this rank exported for

    def manifest(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(hf_name, shape, dtype) in export order. Collective. Also settles how later refits
        export: straight from the parameters' rows where the bridge's conversion only moves rows
        (checked here, tensor by tensor, against this very export), else through the bridge,
        whose per-tensor gathers and name broadcasts cost far more than the copies."""
        self.source.wake()
        rows = self.source.export_rows()
        sources = rows.sources() if rows is not None else {}
        manifest = []
        for name, tensor in self.source.hf_weights():
            manifest.append((name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")))
            if rows is not None and not _assembles(sources.get(name), tensor):
                rows = None
        self._row_export = rows if rows is not None and set(rows.names) == {m[0] for m in manifest} else None
        if self.source.rank == 0:
            # the HF export stream: a Megatron model's through its bridge, another backend's as it yields it
            print(f"[{self.source.name}] refit export: " + ("direct row copies from the parameters"
                                                           if self._row_export is not None
                                                           else "through the HF export stream"), flush=True)
        return manifest

    def stream_buckets(self, plan: RefitPlan, with_checksum: bool, delta: bool = False,
                       base_held: bool = False) -> Iterator[PackedBucket | EncodedBucket]:
        """Every bucket, in plan order, each yielded as soon as it is packed (the object-store
        transport); sent() then tells how. Through the bridge the export is collective: every rank
        iterates it, only rank 0 yields buckets (other ranks run it to join the collectives).
        delta (refit.delta): rank 0 yields EncodedBuckets, deltas against the buckets it sent last
        where every receiver holds them (base_held; see DeltaSender.begin), else dense."""
        if self.source.rank != 0 and self._row_export is not None:
            return
        self._begin(plan)
        sending = self.source.rank == 0
        encoding = delta and sending  # the ranks that yield nothing keep nothing
        dense_because = self._delta.begin(plan, base_held) if encoding else None
        for _ in plan.buckets:
            packed = self._pack_next(with_checksum, zero_padding=delta)
            if sending:
                yield self._delta.encode(packed) if encoding else packed
        self._end()
        self._last = self._outcome(plan, sending, encoding, dense_because)

    def join(self, transport: str, host: str, port: int, world_size: int, timeout_s: float):
        """The transport's handshake (its spec's join): this rank is rank 0 of a communicator with
        the generation processes it feeds, which its sending half is then made with."""
        self.communicator = transport_spec(transport).join(host, port, 0, world_size, timeout_s)

    def open_channel(self, transport: str, receivers: int, timeout_s: float, host: str) -> tuple:
        """Listen on `host` for the standing receivers of `receivers` generation processes, which
        the sending half of refit.transport `transport` will feed; returns the address they
        connect to."""
        half = build_half(transport_spec(transport).sending_half, self.communicator)
        if self._server is not None:
            self._server.close()
        self._server, self._transport = ChannelServer(receivers, timeout_s, host), half
        return self._server.address

    def send(self, plan: RefitPlan, with_checksum: bool, delta: bool = False) -> SentRefit:
        """One refit over this rank's channel: start it on every receiver (with the transport's
        setup, e.g. new IPC handles), move the bytes, collect their reports. On failure the
        channel closes, so receivers stop at once and connect again. A rank without a channel
        (nccl: all but the senders) only takes part in the bridge export's collectives.
        delta (refit.delta): every receiver first says whether it holds this sender's last version
        of every bucket; the buckets then travel as frames of their encodings (rlkit/refit/delta.py),
        deltas where all of them hold it (see DeltaSender.begin), else dense."""
        if self._server is None:
            for _ in self.stream_buckets(plan, with_checksum):
                pass
            return self._outcome(plan, False, False, None)
        server, transport = self._server, self._transport
        self._begin(plan)
        try:
            channels = server.begin(plan, with_checksum, transport.prepare(plan, server.accept_receivers()), delta)
            dense_because = None
            if delta:
                dense_because = self._delta.begin(plan, all([channel.receive("whether it holds the buckets of the "
                                                                             "last refit") for channel in channels]))
                transport.send(channels, plan, lambda buffer: frame(self._delta.encode(
                    self._pack_next(with_checksum, buffer, zero_padding=True))))
            else:
                transport.send(channels, plan, lambda buffer: self._pack_next(with_checksum, buffer))
            self._end()
            received = server.finish()
        except BaseException:
            server.abort()
            raise
        self._last = self._outcome(plan, True, delta, dense_because, received)
        return self._last

    def sent(self) -> SentRefit | None:
        """The last refit this rank exported for (None before the first)."""
        return self._last

    def _outcome(self, plan: RefitPlan, sending: bool, delta: bool, dense_because: str | None,
                 received: list[Received] = ()) -> SentRefit:
        """The refit just exported: sending (this rank sent its buckets), delta (as encodings)."""
        metrics = self._delta.metrics() if delta else {}
        nbytes = (metrics["refit/delta_bytes"] if delta else plan.total_bytes) if sending else 0
        return SentRefit(nbytes, delta and dense_because is None, dense_because, self._seconds["export"],
                         self._seconds["pack"], self._row_export is not None, metrics, tuple(received))

    # Every export: _begin, _pack_next once per bucket, _end. Through the bridge the export is
    # collective (every rank packs), buckets fill in export order, and the plan is checked
    # against what the bridge actually yields.
    def _begin(self, plan: RefitPlan):
        self.source.wake()
        start = time.perf_counter()
        self._next_bucket = 0
        self._exported = None if self._row_export is not None else self.source.hf_weights()
        sources = self._row_export.sources() if self._row_export is not None else None
        if sources is not self._sources or plan != self._plan:
            self._pack_copies = {}  # kept copies hold for one plan and one set of parameter views
        self._plan, self._sources = plan, sources
        self._seconds = {"export": time.perf_counter() - start, "pack": 0.0}

    def _pack_next(self, with_checksum: bool, out: torch.Tensor | None = None,
                   zero_padding: bool = False) -> PackedBucket:
        """The next bucket, packed into `out` (a buffer the transport keeps) or a new buffer
        (zero_padding: see RefitPlan.pack)."""
        bucket = self._plan.buckets[self._next_bucket]
        self._next_bucket += 1
        start = time.perf_counter()
        if self._exported is None:
            sources = self._sources  # views of the parameters; packing reads this bucket's tensors only
        else:
            tensors = dict(next(self._exported) for _ in bucket.slots)  # the plan follows export order
            expected = {s.name for s in bucket.slots}
            if set(tensors) != expected:
                raise RuntimeError(f"refit: export order differs from the plan at {bucket.describe()}: got "
                                   f"{sorted(set(tensors) - expected)[:3]}; rebuild the plan")
            sources = {name: [(tensor, 0)] for name, tensor in tensors.items()}
        exported = time.perf_counter()
        if zero_padding and out is not None:  # else the padding holds what was packed there before
            out[:bucket.nbytes].zero_()
        if self._exported is None and out is not None:  # kept views into a kept buffer: keep the copies too
            key = (bucket.index, out.data_ptr(), out.numel())
            if key not in self._pack_copies:
                self._pack_copies[key] = self._plan.copies(bucket.index, sources, out[:bucket.nbytes])
            packed = self._plan.pack_copies(bucket.index, out[:bucket.nbytes], self._pack_copies[key], with_checksum)
        else:
            packed = self._plan.pack(bucket.index, sources, with_checksum, out, zero_padding)
        self._seconds["export"] += exported - start
        self._seconds["pack"] += time.perf_counter() - exported
        return packed

    def _end(self):
        if self._exported is not None and next(self._exported, None) is not None:
            raise RuntimeError("refit: the export has more tensors than the plan; rebuild the plan")
        self._exported = None


def _assembles(pieces: list | None, tensor: torch.Tensor) -> bool:
    """Whether the (rows, first row) pieces put together equal `tensor`, bit for bit."""
    if not pieces:
        return False
    rows = torch.cat([p.reshape(-1) for p, _ in sorted(pieces, key=lambda piece: piece[1])])
    return rows.dtype == tensor.dtype and rows.numel() == tensor.numel() and torch.equal(rows, tensor.reshape(-1))
