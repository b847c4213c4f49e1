"""Delta refit (refit.delta): a packed bucket encoded against the version sent before it, and
the memory each side keeps of that version (DeltaSender, DeltaReceiver).

Between two refits most exported weights do not change bit for bit (a small learning rate moves
few bf16 values by a whole unit of their last place), so a bucket can travel as the positions
and new values of its changed words instead of all its bytes. The receiver applies them to its
own copy of the bucket it received last and gets exactly the dense bucket back; the checksum of
the full bucket checks that, so a delta applied to the wrong base is caught, naming the bucket.

Deltas are taken between packed buckets, i.e. the exported HF-layout tensors of RefitPlan, never
between the policy's sharded parameters: a bucket's bytes are the same whatever the policy's
parallelism, so a delta is correct under any of it, and a resumed run with other parallelism
still compares like with like.
"""

import math
import time
from dataclasses import dataclass, replace
from typing import Iterable, Literal

import torch
import torch.nn.functional as F

from rlkit.refit.plan import Bucket, PackedBucket, RefitIntegrityError, RefitPlan, bucket_checksum

Encoding = Literal["dense", "indices", "bitmap"]

_WORD_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_BIT_WEIGHTS = (2 ** torch.arange(8)).to(torch.uint8)  # bit i of a bitmap byte is word 8k + i


def word_bytes(bucket: Bucket) -> int:
    """The width at which a bucket is compared: the largest integer width that divides every
    element size of its dtype regions.
    A whole-word integer view compares bit patterns, so -0.0 vs +0.0 and NaN payloads count as
    changes, and one width for the whole buffer keeps a single index space: a bf16 (or any
    single-dtype) bucket is compared element by element; a bucket mixing bf16 and float32 counts a
    float32 element as its two 2-byte halves; a bucket holding bools falls back to bytes. Padding
    between slots is compared too: the checksum covers it, so it must be rebuilt exactly."""
    return math.gcd(8, *(getattr(torch, slot.dtype).itemsize for slot in bucket.slots))


@dataclass(frozen=True)
class EncodedBucket:
    """Bucket `index` as it travels: dense (values is the whole uint8 buffer) or a delta (values
    are the changed words, at `positions`: int32/int64 word indices, or a bitmap with one bit per
    word, least significant bit first)."""
    index: int
    encoding: Encoding
    word_bytes: int
    words: int  # words in the bucket
    changed: int  # words that differ from the previous version (all of them without one)
    positions: torch.Tensor | None  # None when dense
    values: torch.Tensor
    checksum: int | None  # of the full bucket; always set on a delta

    @property
    def dense_bytes(self) -> int:
        return self.words * self.word_bytes

    @property
    def sent_bytes(self) -> int:
        return self.values.nbytes + (self.positions.nbytes if self.positions is not None else 0)


def encode(previous: torch.Tensor | None, current: PackedBucket, bucket: Bucket,
           max_size_ratio: float = 0.5) -> EncodedBucket:
    """`current` as a delta against `previous` (the flat uint8 buffer of this bucket sent last,
    on current's device) when the smaller of its two forms is under `max_size_ratio` times the
    dense bytes, else dense. Applying a delta costs the receiver a copy of the whole bucket and a
    scatter, so it pays only when it clearly saves bytes. Without a previous version of the same
    size (first refit, new receiver, rebuilt plan) it is dense."""
    width = word_bytes(bucket)
    buffer = current.buffer
    words = buffer.numel() // width
    if previous is None or previous.numel() != buffer.numel():
        return EncodedBucket(current.index, "dense", width, words, words, None, buffer, current.checksum)

    word_dtype = _WORD_DTYPES[width]
    current_words = buffer.view(word_dtype)
    changed_mask = previous.view(word_dtype) != current_words
    changed = int(torch.count_nonzero(changed_mask))  # a bool sum() widens every element first: 15x slower on CPU
    index_dtype = torch.int32 if words <= 2**31 else torch.int64
    indices_bytes = changed * (index_dtype.itemsize + width)
    bitmap_bytes = -(-words // 8) + changed * width
    if min(indices_bytes, bitmap_bytes) >= max_size_ratio * words * width:
        return EncodedBucket(current.index, "dense", width, words, changed, None, buffer, current.checksum)

    if indices_bytes <= bitmap_bytes:
        changed_at = changed_mask.nonzero().view(-1)
        # gathering the few changed words by position reads far less than selecting through the mask
        encoding, positions, values = "indices", changed_at.to(index_dtype), current_words[changed_at]
    else:
        encoding, positions, values = "bitmap", _pack_bits(changed_mask), current_words[changed_mask]
    # a delta always carries the full bucket's checksum: it is what catches a delta applied to the wrong base
    checksum = current.checksum if current.checksum is not None else bucket_checksum(buffer)
    return EncodedBucket(current.index, encoding, width, words, changed, positions, values, checksum)


def apply(previous: torch.Tensor | None, encoded: EncodedBucket, out: torch.Tensor | None = None) -> torch.Tensor:
    """The full flat uint8 bucket `encoded` stands for, checked against its checksum when it
    carries one: in a new tensor, or rebuilt in `out` (a buffer of the bucket's size on the
    encoding's device, which may hold the encoding itself: a transport's receive buffer).
    previous (on any device) is untouched."""
    if encoded.encoding == "dense":
        if out is None:
            rebuilt = encoded.values.clone()
        else:
            rebuilt = out[:encoded.dense_bytes]
            if encoded.values.data_ptr() != rebuilt.data_ptr():
                rebuilt.copy_(encoded.values)
    else:
        if previous is None or previous.numel() != encoded.dense_bytes:
            held = "nothing" if previous is None else f"{previous.numel()} bytes"
            raise RefitIntegrityError(f"refit: bucket {encoded.index} arrived as a delta of {encoded.dense_bytes} "
                                      f"bytes but this receiver holds {held} to apply it to; it needs a dense "
                                      "refit first")
        if out is None:
            rebuilt = previous.clone()
        else:  # the encoding may sit in out: taken out before the base overwrites it
            encoded = replace(encoded, positions=encoded.positions.clone(), values=encoded.values.clone())
            rebuilt = out[:encoded.dense_bytes].copy_(previous)
        rebuilt_words = rebuilt.view(_WORD_DTYPES[encoded.word_bytes])
        positions = (encoded.positions if encoded.encoding == "indices"
                     else _unpack_bits(encoded.positions, encoded.words))
        selected = positions.numel() if encoded.encoding == "indices" else int(torch.count_nonzero(positions))
        if selected != encoded.values.numel():
            raise RefitIntegrityError(f"refit: bucket {encoded.index}'s delta names {selected} positions for "
                                      f"{encoded.values.numel()} values: it was corrupted in transit")
        if encoded.encoding == "indices":
            rebuilt_words[positions] = encoded.values
        else:
            rebuilt_words.masked_scatter_(positions, encoded.values)  # in mask order, as the sender selected them
    if encoded.checksum is not None:
        actual = bucket_checksum(rebuilt)
        if actual != encoded.checksum:
            raise RefitIntegrityError(f"refit: bucket {encoded.index} failed its checksum after applying its "
                                      f"{encoded.encoding} encoding (sent {encoded.checksum}, rebuilt {actual}): "
                                      "the bytes were corrupted in transit or the delta's base differs from the "
                                      "sender's; the next refit must be dense")
    return rebuilt


FRAME_HEADER_WORDS = 9
_ENCODINGS: tuple[Encoding, ...] = ("dense", "indices", "bitmap")


@dataclass(frozen=True)
class Frame:
    """An EncodedBucket as a transport that moves raw bytes carries it (nccl): a fixed-size
    header of int64 words, sent first because it says how many payload bytes follow (its first
    word), then the payload. `room`: on the receiving side, the transport's buffer of the whole
    bucket whose first bytes hold the payload, for the bucket to be rebuilt in."""
    index: int
    header: tuple[int, ...]
    payload: torch.Tensor  # flat uint8
    room: torch.Tensor | None = None


def frame(encoded: EncodedBucket) -> Frame:
    """A dense encoding's payload is its buffer, uncopied; a delta's is its positions' bytes,
    zero-padded to a multiple of 8 (so the values that follow can be viewed as words), then its
    values'."""
    if encoded.encoding == "dense":
        payload, position_bytes, index_bytes = encoded.values, 0, 0
    else:
        positions = encoded.positions.view(torch.uint8)
        position_bytes = -(-positions.numel() // 8) * 8
        payload = torch.cat([F.pad(positions, (0, position_bytes - positions.numel())),
                             encoded.values.view(torch.uint8)])
        index_bytes = encoded.positions.element_size() if encoded.encoding == "indices" else 0
    header = (payload.numel(), _ENCODINGS.index(encoded.encoding), encoded.word_bytes, encoded.words, encoded.changed,
              position_bytes, index_bytes, int(encoded.checksum is not None), encoded.checksum or 0)
    return Frame(encoded.index, header, payload)


def unframe(received: Frame) -> EncodedBucket:
    """The EncodedBucket a frame carries, its tensors views of the payload."""
    nbytes, encoding, width, words, changed, position_bytes, index_bytes, has_checksum, checksum = received.header
    checksum = checksum if has_checksum else None
    encoding = _ENCODINGS[encoding]
    if encoding == "dense":
        return EncodedBucket(received.index, "dense", width, words, changed, None, received.payload[:nbytes], checksum)
    if encoding == "indices":
        positions = received.payload[:changed * index_bytes].view(_WORD_DTYPES[index_bytes])
    else:
        positions = received.payload[:-(-words // 8)]
    values = received.payload[position_bytes:position_bytes + changed * width].view(_WORD_DTYPES[width])
    return EncodedBucket(received.index, encoding, width, words, changed, positions, values, checksum)


def delta_metrics(encoded: Iterable[EncodedBucket]) -> dict[str, float]:
    """Over the given buckets (one for a bucket's own): the fraction of words that changed, the
    bytes sent, and the bytes a dense refit would have sent."""
    encoded = list(encoded)
    words = sum(e.words for e in encoded)
    return {"refit/delta_fraction": sum(e.changed for e in encoded) / words if words else 0.0,
            "refit/delta_bytes": sum(e.sent_bytes for e in encoded),
            "refit/dense_bytes": sum(e.dense_bytes for e in encoded)}


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as bytes of eight bits each (torch has no packbits)."""
    padded = F.pad(mask.to(torch.uint8), (0, -mask.numel() % 8))
    return (padded.view(-1, 8) * _BIT_WEIGHTS.to(mask.device)).sum(dim=1, dtype=torch.uint8)


def _unpack_bits(bits: torch.Tensor, count: int) -> torch.Tensor:
    """The first `count` entries of the bool mask that _pack_bits made `bits` from."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    # bytes of 0 or 1 are bools already: viewing them skips a pass over every word
    return ((bits.unsqueeze(1) >> shifts) & 1).view(-1)[:count].view(torch.bool)


class HostCopies:
    """Each bucket's last version in host memory. A bucket on a GPU is copied into page-locked
    memory allocated once per bucket and overwritten at every refit: fresh pageable copies of a
    7B model's 15 GB took 13-15 s per refit on each side (benchmarks/refit.py, nccl-delta)."""

    def __init__(self):
        self._copies: dict[int, torch.Tensor] = {}

    def keep(self, index: int, buffer: torch.Tensor, reused: bool) -> torch.Tensor:
        """Bucket `index`'s bytes as they are now. reused: the caller writes into `buffer` again;
        if not, a host buffer is kept as it is. Otherwise they are copied into this bucket's own
        host buffer, page-locked when `buffer` is on a GPU."""
        if not (reused or buffer.is_cuda):
            return buffer
        host = self._copies.get(index)
        if host is None or host.numel() != buffer.numel():
            host = self._copies[index] = torch.empty(buffer.numel(), dtype=torch.uint8, pin_memory=buffer.is_cuda)
        return host.copy_(buffer)  # synchronous: the caller may write into buffer next

    def clear(self) -> None:
        self._copies = {}


class DeltaSender:
    """A sender's memory for delta refit: every bucket as it sent it last, in host memory (one
    copy of the exported model), and the encodings of the refit in progress, for its metrics."""

    def __init__(self, max_size_ratio: float = 0.5):
        self.max_size_ratio = max_size_ratio
        self._plan: RefitPlan | None = None
        self._host = HostCopies()
        self._sent: dict[int, torch.Tensor] = {}
        self._encoded: list[EncodedBucket] = []
        self._seconds = 0.0

    def begin(self, plan: RefitPlan, base_held: bool) -> str | None:
        """base_held: every receiver holds this sender's last version of every bucket. Without it
        (the first refit, a new receiver, one whose delta failed) or with a new plan, the memory
        starts anew, so every bucket of this refit goes dense: returns why, else None."""
        dense_because = None
        if self._plan is None:
            dense_because = "the first refit: no buckets sent before"
        elif plan != self._plan:
            dense_because = "the plan changed"
        elif not base_held:
            dense_because = ("a receiver does not hold the buckets of the last refit (a new or restarted "
                             "generation worker, or a failed delta)")
        if dense_because is not None:
            self._sent = {}
        if plan != self._plan:
            self._host.clear()
        self._plan, self._encoded, self._seconds = plan, [], 0.0
        return dense_because

    def encode(self, packed: PackedBucket) -> EncodedBucket:
        """`packed` against the version of its bucket sent last, which it then replaces. Nothing may
        write into packed.buffer afterwards: on CPU it is kept as it is, not copied."""
        start = time.perf_counter()
        previous = self._sent.pop(packed.index, None)
        encoded = encode(None if previous is None else previous.to(packed.buffer.device), packed,
                         self._plan.buckets[packed.index], self.max_size_ratio)
        self._sent[packed.index] = self._host.keep(packed.index, packed.buffer, reused=False)
        self._encoded.append(encoded)
        self._seconds += time.perf_counter() - start  # encode reads the count of changes: its GPU work is done
        return encoded

    def metrics(self) -> dict[str, float]:
        """delta_metrics of this refit's buckets, and the seconds spent encoding them."""
        return {**delta_metrics(self._encoded), "timing/refit_delta_encode": self._seconds}


class DeltaReceiver:
    """A receiver's memory for delta refit: every bucket as it rebuilt it last. What might not be
    one version of the sender's is dropped, so that the next refit is dense: all of it on a new
    plan or after a refit that did not finish or whose delta failed."""

    def __init__(self):
        self._plan: RefitPlan | None = None
        self._host = HostCopies()
        self._held: dict[int, torch.Tensor] = {}
        self._finished = True
        self.failure: str | None = None  # the first bucket of this refit that did not rebuild, and why
        self.seconds: float | None = None  # spent rebuilding this refit's buckets; None while none arrived

    def begin(self, plan: RefitPlan) -> bool:
        """Whether this receiver holds every bucket of `plan` as last sent (a delta refit can follow)."""
        if plan != self._plan or not self._finished:
            self._held = {}
        if plan != self._plan:
            self._host.clear()
        self._plan, self._finished = plan, False
        self.failure, self.seconds = None, None
        return len(self._held) == len(plan.buckets)

    def rebuild(self, encoded: EncodedBucket, out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The full bucket `encoded` stands for (checked against the checksum it carries; rebuilt
        in `out` if given, see apply), held for the next refit in host memory; None once a bucket of
        this refit failed: the refit is redone dense, so the rest need no work."""
        if self.failure is not None:
            return None
        start = time.perf_counter()
        try:
            rebuilt = apply(self._held.pop(encoded.index, None), encoded, out)
            # a receiver's buffer is reused for the next buckets, and a GPU's memory is the engine's
            self._held[encoded.index] = rebuilt if out is None else self._host.keep(encoded.index, rebuilt, reused=True)
        except RefitIntegrityError as error:
            self.failure, self._held = str(error), {}
            return None
        finally:
            self.seconds = (self.seconds or 0.0) + time.perf_counter() - start
        return rebuilt

    def end(self) -> None:
        """Every bucket of the refit arrived."""
        self._finished = True
