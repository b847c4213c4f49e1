"""RefitPlan: the single description of how weights travel from policy to generation.

Computed once from the policy's export manifest (HF name, shape, dtype, in export order) and
handed to both sides. The sender packs bucket k by the plan; the receiver unpacks bucket k by
the same plan. Nobody re-derives names, order or offsets.

A bucket is one flat uint8 buffer of at most `bucket_bytes` (a single tensor larger than the
budget gets a bucket of its own). Inside a bucket, tensors are grouped by dtype into contiguous
regions so each region is one typed flat array. Buckets are filled in export order, so the
sender can close a bucket as soon as its last tensor has streamed by.
"""

import fnmatch
from dataclasses import dataclass

import torch

_ALIGN = 16  # bytes; every slot offset is a multiple, so any dtype view is aligned


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * getattr(torch, dtype).itemsize


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    dtype: str  # dtype on the wire (and in the generation model)
    offset: int  # bytes from the start of the bucket buffer
    nbytes: int


@dataclass(frozen=True)
class Bucket:
    index: int
    slots: tuple[Slot, ...]
    nbytes: int

    def describe(self) -> str:
        names = [s.name for s in self.slots]
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} tensors)" if len(names) > 3 else "")
        return f"bucket {self.index} [{shown}]"


@dataclass(frozen=True)
class PackedBucket:
    index: int
    buffer: torch.Tensor  # flat uint8
    checksum: int | None


class RefitIntegrityError(RuntimeError):
    pass


@dataclass(frozen=True)
class RefitPlan:
    buckets: tuple[Bucket, ...]

    @staticmethod
    def build(manifest: list[tuple[str, tuple[int, ...], str]], bucket_bytes: int,
              transfer_dtype: str | None = None, keep_fp32: tuple[str, ...] = ()) -> "RefitPlan":
        """manifest: (hf_name, shape, dtype) in export order.
        transfer_dtype: cast floating tensors to this dtype on the wire (the generation model's
        dtype); names matching a keep_fp32 glob stay float32 whatever transfer_dtype says."""
        groups: list[list[tuple[str, tuple[int, ...], str]]] = []
        current, current_bytes = [], 0
        for name, shape, dtype in manifest:
            if getattr(torch, dtype).is_floating_point:
                if any(fnmatch.fnmatchcase(name, pattern) for pattern in keep_fp32):
                    dtype = "float32"
                elif transfer_dtype:
                    dtype = transfer_dtype
            size = _aligned(_nbytes(tuple(shape), dtype))
            if current and current_bytes + size > bucket_bytes:
                groups.append(current)
                current, current_bytes = [], 0
            current.append((name, tuple(shape), dtype))
            current_bytes += size
        if current:
            groups.append(current)
        return RefitPlan(tuple(RefitPlan._layout(i, g) for i, g in enumerate(groups)))

    @staticmethod
    def _layout(index: int, tensors: list[tuple[str, tuple[int, ...], str]]) -> Bucket:
        slots, offset = [], 0
        for dtype in dict.fromkeys(t[2] for t in tensors):  # dtype regions, first-seen order
            for name, shape, tensor_dtype in tensors:
                if tensor_dtype == dtype:
                    nbytes = _nbytes(shape, dtype)
                    slots.append(Slot(name, shape, dtype, offset, nbytes))
                    offset += _aligned(nbytes)
        return Bucket(index, tuple(slots), offset)

    @property
    def names(self) -> list[str]:
        return [s.name for b in self.buckets for s in b.slots]

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def bucket_of(self) -> dict[str, int]:
        return {s.name: b.index for b in self.buckets for s in b.slots}

    @torch.no_grad()  # the copies write split views of the buffer, which autograd forbids
    def pack(self, index: int, sources: dict[str, list[tuple[torch.Tensor, int]]], with_checksum: bool,
             out: torch.Tensor | None = None, zero_padding: bool = False) -> PackedBucket:
        """sources: for each tensor of the bucket, (rows, first row) pieces that together make it:
        one piece (tensor, 0) for a whole exported tensor, or the row runs of a direct export
        (flat views are fine: a piece is as many rows as its elements fill). All pieces land in
        one batched copy, into `out` (a flat uint8 buffer at least the bucket's size) or a new
        buffer, whose padding bytes are zeros with zero_padding (delta refit compares whole
        buckets from refit to refit) and else left uninitialised (both sides checksum the same
        bytes)."""
        bucket = self.buckets[index]
        device = next(iter(sources.values()))[0][0].device if sources else "cpu"
        new_buffer = torch.zeros if zero_padding else torch.empty
        buffer = new_buffer(bucket.nbytes, dtype=torch.uint8, device=device) if out is None else out[:bucket.nbytes]
        return self.pack_copies(index, buffer, self.copies(index, sources, buffer), with_checksum)

    def copies(self, index: int, sources: dict[str, list[tuple[torch.Tensor, int]]],
               buffer: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destinations in `buffer`, pieces): the copies that pack bucket `index` from `sources`
        (see pack), checked against the plan. A sender whose sources and buffers stay put can
        keep them and pack with pack_copies alone."""
        bucket = self.buckets[index]
        spans, pieces = [], []
        for slot in bucket.slots:
            rows, row_numel = _rows(slot.shape)
            element_size = getattr(torch, slot.dtype).itemsize
            covered = 0
            for piece, first_row in sources[slot.name]:
                numel = piece.numel()
                piece_rows = numel // row_numel
                if ((piece.dim() > 1 and tuple(piece.shape[1:]) != slot.shape[1:]) or numel % row_numel
                        or first_row + piece_rows > rows):
                    raise RefitIntegrityError(f"refit: {slot.name} has rows of shape {tuple(piece.shape)} at row "
                                              f"{first_row} but the plan says {slot.shape}; the plan is stale, "
                                              "rebuild it")
                spans.append(Span(slot.offset + first_row * row_numel * element_size, numel, slot.dtype))
                pieces.append(piece if piece.dim() == 1 else piece.reshape(-1))
                covered += piece_rows
            if covered != rows:
                raise RefitIntegrityError(f"refit: {slot.name} got {covered} rows, the plan says {slot.shape}; the "
                                          "plan is stale, rebuild it")
        try:
            return flat_views(buffer, spans), pieces
        except ValueError:
            raise RefitIntegrityError(f"refit: pieces of {bucket.describe()} overlap; the plan is stale, "
                                      "rebuild it") from None

    @torch.no_grad()
    def pack_copies(self, index: int, buffer: torch.Tensor, copies: tuple[list[torch.Tensor], list[torch.Tensor]],
                    with_checksum: bool) -> PackedBucket:
        """Runs the copies of `copies()` as one batched copy: bucket `index` packed in `buffer`."""
        destinations, pieces = copies
        if pieces:
            torch._foreach_copy_(destinations, pieces)
        return PackedBucket(index, buffer, bucket_checksum(buffer) if with_checksum else None)

    def check(self, packed: PackedBucket, verify: bool):
        """The bucket has the plan's size and, when verifying, its checksum."""
        bucket = self.buckets[packed.index]
        if packed.buffer.numel() != bucket.nbytes:
            raise RefitIntegrityError(f"refit: {bucket.describe()} arrived with {packed.buffer.numel()} bytes, "
                                      f"the plan says {bucket.nbytes}")
        if verify:
            if packed.checksum is None:
                raise RefitIntegrityError(f"refit: {bucket.describe()} carries no checksum but verification is "
                                          "on; enable refit.verify_checksums on the sender too")
            actual = bucket_checksum(packed.buffer)
            if actual != packed.checksum:
                raise RefitIntegrityError(f"refit: {bucket.describe()} failed its checksum (sent {packed.checksum}, "
                                          f"received {actual}): the bytes were corrupted in transit")

    def unpack(self, packed: PackedBucket, verify: bool) -> list[tuple[str, torch.Tensor]]:
        """Views into packed.buffer, one per tensor, named and shaped by the plan."""
        self.check(packed, verify)
        return [(s.name, slot_view(s, packed.buffer)) for s in self.buckets[packed.index].slots]


def slot_view(slot: Slot, buffer: torch.Tensor) -> torch.Tensor:
    return buffer[slot.offset: slot.offset + slot.nbytes].view(getattr(torch, slot.dtype)).view(slot.shape)


@dataclass(frozen=True)
class Span:
    """A run of `numel` elements of `dtype` starting `offset` bytes into a bucket buffer."""
    offset: int
    numel: int
    dtype: str


def flat_views(buffer: torch.Tensor, spans: list[Span]) -> list[torch.Tensor]:
    """Flat views of `buffer` (uint8, from offset 0) at `spans`, made with one split per dtype
    rather than a slice and two views each: refit packs and loads hundreds of tensors per bucket,
    and per-tensor Python is what used to dominate its time. ValueError if spans overlap."""
    views: list[torch.Tensor | None] = [None] * len(spans)
    for dtype in dict.fromkeys(span.dtype for span in spans):
        typed = buffer.view(getattr(torch, dtype))
        element_size = typed.element_size()
        order = sorted((i for i, span in enumerate(spans) if span.dtype == dtype), key=lambda i: spans[i].offset)
        sizes, position = [], 0
        for i in order:
            start = spans[i].offset // element_size
            if start < position:
                raise ValueError(f"span at byte {spans[i].offset} overlaps the previous one")
            sizes += [start - position, spans[i].numel]
            position = start + spans[i].numel
        sizes.append(typed.numel() - position)
        for i, view in zip(order, typed.split(sizes)[1::2]):
            views[i] = view
    return views


def _rows(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, elements per row) of a tensor shape; a 0-d tensor is one row of one element."""
    row_numel = 1
    for d in shape[1:]:
        row_numel *= d
    return (shape[0] if shape else 1), row_numel


_CHECKSUM_COLUMNS = 1 << 12  # words per row of the matrix a buffer's sums are read from


def bucket_checksum(buffer: torch.Tensor) -> int:
    """Fletcher-style checksum of a uint8 buffer, computed on its own device: sensitive to
    flipped bits and to reordered words. Integer arithmetic wraps identically on CPU and GPU.
    The words read as rows of _CHECKSUM_COLUMNS (and a shorter tail) give the position-weighted
    sum as columns * sum(row index * row sum) + sum(column number * column sum): two reductions
    that sum the int32 words into int64, with no temporary the size of the buffer."""
    if buffer.numel() % 4 or buffer.storage_offset() % 4 or not buffer.is_contiguous():
        buffer = torch.nn.functional.pad(buffer, (0, (-buffer.numel()) % 4))  # whole words, aligned
    words = buffer.view(torch.int32)
    rows = words.numel() // _CHECKSUM_COLUMNS
    body = words[:rows * _CHECKSUM_COLUMNS].view(rows, _CHECKSUM_COLUMNS)
    tail = words[rows * _CHECKSUM_COLUMNS:].to(torch.int64)
    row_sums, column_sums = body.sum(dim=1), body.sum(dim=0)

    def positions(first: int, count: int) -> torch.Tensor:
        return torch.arange(first, first + count, device=words.device, dtype=torch.int64)

    total = row_sums.sum() + tail.sum()
    weighted = (_CHECKSUM_COLUMNS * (row_sums * positions(0, rows)).sum()
                + (column_sums * positions(1, _CHECKSUM_COLUMNS)).sum()
                + (tail * positions(rows * _CHECKSUM_COLUMNS + 1, tail.numel())).sum())
    value = (int(total.item()) * 1_000_003 + int(weighted.item())) % 2**64
    return value - 2**64 if value >= 2**63 else value  # a signed 64-bit int, so it fits an int64 tensor
