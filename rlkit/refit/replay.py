"""Replayed weight loading on the generation side.

The generation engine's own loader (vLLM's load_weights) knows its fused layouts (qkv_proj,
gate_up_proj), vocab padding and TP slices, but costs a Python call chain per tensor. So the
first refit of a plan loads each tensor through it under a recorder that notes every copy it
makes out of the received bucket into the model; later refits replay those copies as one
batched copy per bucket. The loader stays the authority on where bytes go; the replay only
repeats it.

A tensor whose loading does more than take views, copy out of the bucket and fill constants (a
dtype cast into a temporary, arithmetic, a fresh tensor) is not replayed: it goes through the
loader at every refit.
"""

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlkit.refit.plan import PackedBucket, RefitPlan

aten = torch.ops.aten
# ops a loader may run without changing any bytes
_VIEWS = {aten.view, aten._unsafe_view, aten.reshape, aten.slice, aten.narrow, aten.select, aten.as_strided,
          aten.t, aten.transpose, aten.permute, aten.detach, aten.alias, aten.expand, aten.split, aten.chunk,
          aten.unsqueeze, aten.squeeze, aten.split_with_sizes, aten.unbind, aten.view_as, aten.is_same_size}


@dataclass(frozen=True)
class _Copy:
    destination: torch.Tensor  # a view of a model parameter, valid for the model's lifetime
    offset: int  # bytes from the start of the bucket buffer to the source view
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    after_earlier: bool  # overlaps an earlier write: must not be batched with it

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
            self._overlaps(args[0])
        elif op is aten.zero_:
            self.ops.append(_Fill(args[0], 0))
            self._overlaps(args[0])
        elif op not in _VIEWS:
            self.replayable = False
        return func(*args, **(kwargs or {}))

    def _copy(self, destination: torch.Tensor, source: torch.Tensor):
        from_bucket = (source.device == self.buffer.device and
                       source.untyped_storage().data_ptr() == self.buffer.untyped_storage().data_ptr())
        if not from_bucket or destination.shape != source.shape:
            self.replayable = False
            return
        after_earlier = self._overlaps(destination)
        self.ops.append(_Copy(destination, source.data_ptr() - self.buffer.data_ptr(), source.dtype,
                              tuple(source.shape), tuple(source.stride()), after_earlier))

    def _overlaps(self, destination: torch.Tensor) -> bool:
        """Whether `destination`'s byte span meets one written earlier in this plan; remembers it."""
        start = destination.data_ptr()
        end = start + max(1, sum((n - 1) * s for n, s in zip(destination.shape, destination.stride())) + 1) \
            * destination.element_size()
        hit = any(start < e and s < end for s, e in self.written)
        self.written.append((start, end))
        return hit


class LoadReplay:
    """Loads buckets of one RefitPlan into a model: through `load` (the engine's loader, given
    [(name, tensor)]) the first time each tensor arrives, by replaying the recorded copies after."""

    def __init__(self, plan: RefitPlan, load: Callable[[list[tuple[str, torch.Tensor]]], None]):
        self.plan, self._load = plan, load
        self._recorded: dict[str, list[_Copy | _Fill] | None] = {}  # None: through the loader every time
        self._written: list[tuple[int, int]] = []

    def load(self, packed: PackedBucket, verify: bool):
        views = self.plan.unpack(packed, verify)
        batch: list[_Copy] = []
        for name, tensor in views:
            if name not in self._recorded:
                self._flush(batch, packed.buffer)
                self._record(name, tensor, packed.buffer)
                continue
            ops = self._recorded[name]
            if ops is None:
                self._flush(batch, packed.buffer)
                self._load([(name, tensor)])
                continue
            for op in ops:
                if isinstance(op, _Fill) or op.after_earlier:
                    self._flush(batch, packed.buffer)
                if isinstance(op, _Fill):
                    op.destination.fill_(op.value)
                else:
                    batch.append(op)
        self._flush(batch, packed.buffer)

    def _record(self, name: str, tensor: torch.Tensor, buffer: torch.Tensor):
        recorder = _Recorder(buffer, self._written)
        with recorder:
            self._load([(name, tensor)])
        self._recorded[name] = recorder.ops if recorder.replayable else None

    @staticmethod
    def _flush(batch: list[_Copy], buffer: torch.Tensor):
        if batch:
            torch._foreach_copy_([op.destination for op in batch], [op.source(buffer) for op in batch])
            batch.clear()

    @property
    def replayed_fraction(self) -> float:
        """Share of the plan's tensors whose loading is replayed rather than run."""
        return sum(ops is not None for ops in self._recorded.values()) / max(1, len(self.plan.names))
