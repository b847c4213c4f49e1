"""Replayed weight loading on the generation side.

The generation engine's own loader (vLLM's load_weights) knows its fused layouts (qkv_proj,
gate_up_proj), vocab padding and TP slices, but costs a Python call chain per tensor. So the
first refit of a plan loads each tensor through it under a recorder that notes every copy it
makes out of the received bucket into the model; later refits replay those copies as one
batched copy per bucket. The loader stays the authority on where bytes go; the replay only
repeats it.

A tensor whose loading does more than take views, copy out of the bucket and fill constants (a
dtype cast into a temporary, arithmetic, a fresh tensor) is not replayed: it goes through the
loader at every refit. ModelLoader sends every tensor through the loader (an engine that
quantizes the weights as it loads them).
"""

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlkit.refit.plan import Bucket, PackedBucket, RefitPlan, Span, flat_views, slot_view

aten = torch.ops.aten
# ops a loader may run without changing any bytes
_VIEWS = {aten.view, aten._unsafe_view, aten.reshape, aten.slice, aten.narrow, aten.select, aten.as_strided,
          aten.t, aten.transpose, aten.permute, aten.detach, aten.alias, aten.expand, aten.split, aten.chunk,
          aten.unsqueeze, aten.squeeze, aten.split_with_sizes, aten.unbind, aten.view_as, aten.is_same_size}


@dataclass(frozen=True)
class _Copy:
    # a view of a model parameter: valid as long as the parameter keeps its storage (vLLM's sleep
    # mode remaps the same virtual addresses; LoadReplay checks loads do not swap storages)
    destination: torch.Tensor
    offset: int  # bytes from the start of the bucket buffer to the source view
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    after_earlier: bool  # overlaps an earlier write: must not be batched with it

    @property
    def contiguous_source(self) -> bool:
        expected, stride = [], 1
        for d in reversed(self.size):
            expected.insert(0, stride)
            stride *= d
        return all(s == e for d, s, e in zip(self.size, self.stride, expected) if d > 1)

    def source(self, buffer: torch.Tensor) -> torch.Tensor:
        typed = buffer.view(self.dtype)
        return typed.as_strided(self.size, self.stride, typed.storage_offset() + self.offset // typed.element_size())


@dataclass(frozen=True)
class _Fill:
    destination: torch.Tensor
    value: float


class _Recorder(TorchDispatchMode):
    """Notes the copies out of `buffer` and the constant fills that one loader call makes; any
    other op marks the call as not replayable."""

    def __init__(self, buffer: torch.Tensor, written: list[tuple[int, int]]):
        super().__init__()
        self.buffer, self.written = buffer, written
        self.ops: list[_Copy | _Fill] = []
        self.replayable = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        op = func.overloadpacket
        if op is aten.copy_:
            self._copy(args[0], args[1])
        elif op is aten.fill_ and not isinstance(args[1], torch.Tensor):
            self.ops.append(_Fill(args[0], args[1]))
            self._note_write(args[0])
        elif op is aten.zero_:
            self.ops.append(_Fill(args[0], 0))
            self._note_write(args[0])
        elif op not in _VIEWS:
            self.replayable = False
        return func(*args, **(kwargs or {}))

    def _copy(self, destination: torch.Tensor, source: torch.Tensor):
        from_bucket = (source.device == self.buffer.device and
                       source.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr())
        if not from_bucket or destination.shape != source.shape:
            self.replayable = False
            return
        after_earlier = self._note_write(destination)
        self.ops.append(_Copy(destination, source.data_ptr() - self.buffer.data_ptr(), source.dtype,
                              tuple(source.shape), tuple(source.stride()), after_earlier))

    def _note_write(self, destination: torch.Tensor) -> bool:
        """Remembers `destination`'s byte span; whether it meets one written earlier in this plan."""
        start = destination.data_ptr()
        end = start + max(1, sum((n - 1) * s for n, s in zip(destination.shape, destination.stride())) + 1) \
            * destination.element_size()
        hit = any(start < e and s < end for s, e in self.written)
        self.written.append((start, end))
        return hit


class ModelLoader:
    """Loads buckets of one RefitPlan into `model` through its loader, every tensor at every refit
    (LoadReplay's interface): for a model whose loader does more than copy, e.g. quantize."""

    replayable_fraction = 0.0

    def __init__(self, plan: RefitPlan, model: torch.nn.Module):
        self.plan, self.model = plan, model

    @torch.no_grad()
    def load(self, packed: PackedBucket, verify: bool):
        self.plan.check(packed, verify)
        self.model.load_weights(weights=[(s.name, slot_view(s, packed.buffer))
                                         for s in self.plan.buckets[packed.index].slots])

    def release_buffers(self):
        """Nothing to drop: no view of a buffer outlives its load."""


class LoadReplay:
    """Loads buckets of one RefitPlan into `model` (anything with vLLM's
    `load_weights(weights=[(name, tensor)])`): through its loader the first time each bucket
    arrives, by replaying the recorded copies after."""

    def __init__(self, plan: RefitPlan, model: torch.nn.Module):
        self.plan, self.model = plan, model
        self._recorded: dict[str, list[_Copy | _Fill] | None] = {}  # None: through the loader every time
        self._written: list[tuple[int, int]] = []
        self._replays: dict[int, _BucketReplay] = {}
        self._stable = True  # False once a load moved a parameter: recorded destinations may be stale

    def _load(self, weights: list[tuple[str, torch.Tensor]]):
        self.model.load_weights(weights=weights)

    @torch.no_grad()
    def load(self, packed: PackedBucket, verify: bool):
        self.plan.check(packed, verify)
        bucket = self.plan.buckets[packed.index]
        if self._stable and packed.index in self._replays:
            self._replays[packed.index].run(packed.buffer, self._load)
            return
        storage = [p.data_ptr() for p in self.model.parameters()]
        for slot in bucket.slots:
            recorder = _Recorder(packed.buffer, self._written)
            with recorder:
                self._load([(slot.name, slot_view(slot, packed.buffer))])
            self._recorded[slot.name] = recorder.ops if recorder.replayable else None
        # a loader that swaps a parameter's storage (param.data = ...) leaves copies recorded
        # into the old one: from then on everything goes through the loader
        self._stable = self._stable and storage == [p.data_ptr() for p in self.model.parameters()]
        self._replays[packed.index] = _BucketReplay(bucket, self._recorded)

    def release_buffers(self):
        """Drops every view of a received buffer: a transport about to replace its buffers (e.g.
        unmap IPC slots the sender will free) calls this first."""
        for replay in self._replays.values():
            replay.bound.clear()

    @property
    def replayable_fraction(self) -> float:
        """Share of the plan's tensors whose loading is replayed once recorded (0 if a load
        moved a parameter)."""
        if not self._stable:
            return 0.0
        return sum(ops is not None for ops in self._recorded.values()) / max(1, len(self.plan.names))


class _BucketReplay:
    """One bucket's recorded loading, compiled once: steps in recorded order with consecutive
    copies batched into one call, and the sources of contiguous copies cut from the buffer with
    one split per dtype. The cut sources are kept per buffer (transports alternate two that
    live across refits), so replaying costs a few Python calls per bucket, not per tensor."""

    def __init__(self, bucket: Bucket, recorded: dict[str, list[_Copy | _Fill] | None]):
        copies = [op for s in bucket.slots for op in recorded[s.name] or () if isinstance(op, _Copy)]
        self.spans, span_index = _disjoint_spans(copies)
        self.steps: list[tuple[str, object]] = []
        destinations, sources = [], []

        def flush():
            if destinations:
                self.steps.append(("copies", (list(destinations), list(sources))))
                destinations.clear(), sources.clear()

        for slot in bucket.slots:
            ops = recorded[slot.name]
            if ops is None:
                flush()
                self.steps.append(("load", slot))
                continue
            for op in ops:
                if isinstance(op, _Fill) or op.after_earlier:
                    flush()
                if isinstance(op, _Fill):
                    self.steps.append(("fill", op))
                elif id(op) in span_index and op.destination.is_contiguous():
                    destinations.append(op.destination.view(-1))
                    sources.append(span_index[id(op)])
                else:  # a strided source or destination (e.g. a column slice for a TP shard)
                    destinations.append(op.destination)
                    sources.append(op)
        flush()
        self.bound: dict[int, list[tuple[str, object]]] = {}  # buffer address -> steps with sources cut from it

    def run(self, buffer: torch.Tensor, load: Callable[[list[tuple[str, torch.Tensor]]], None]):
        for kind, step in self._bind(buffer):
            if kind == "copies":
                torch._foreach_copy_(*step)
            elif kind == "fill":
                step.destination.fill_(step.value)
            else:
                load([(step.name, slot_view(step, buffer))])

    def _bind(self, buffer: torch.Tensor) -> list[tuple[str, object]]:
        """The steps with their sources cut from `buffer`, made at its first use. The kept views
        hold the buffer alive, so another buffer cannot take its address while they are kept."""
        key = buffer.data_ptr()
        if key not in self.bound:
            if len(self.bound) >= 2:  # a transport alternates two buffers; anything older is gone
                self.bound.clear()
            cuts = flat_views(buffer, self.spans)
            self.bound[key] = [
                (kind, (step[0], [cuts[s] if isinstance(s, int) else s.source(buffer) for s in step[1]]))
                if kind == "copies" else (kind, step) for kind, step in self.steps]
        return self.bound[key]


def _disjoint_spans(copies: list[_Copy]) -> tuple[list[Span], dict[int, int]]:
    """The contiguous sources of `copies` as spans, shared where two copies read the same bytes;
    {id(copy): span index}. Copies whose source is strided or partly overlaps another's are
    left out (they take their source by as_strided)."""
    by_key: dict[tuple[int, int, str], list[_Copy]] = {}
    for op in copies:
        if op.contiguous_source:
            numel = 1
            for d in op.size:
                numel *= d
            by_key.setdefault((op.offset, numel, str(op.dtype).removeprefix("torch.")), []).append(op)
    keys = sorted(by_key, key=lambda k: (k[2], k[0]))
    spans, index = [], {}
    end_of = {}  # dtype -> end byte of the last kept span
    for offset, numel, dtype in keys:
        end = offset + numel * getattr(torch, dtype).itemsize
        if offset < end_of.get(dtype, 0):
            continue  # partial overlap: strided fallback
        end_of[dtype] = end
        for op in by_key[(offset, numel, dtype)]:
            index[id(op)] = len(spans)
        spans.append(Span(offset, numel, dtype))
    return spans, index
