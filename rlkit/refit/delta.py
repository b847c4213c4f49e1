"""Delta refit's pure core: a packed bucket encoded against the version sent before it.

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
from dataclasses import dataclass
from typing import Iterable, Literal

import torch
import torch.nn.functional as F

from rlkit.refit.plan import Bucket, PackedBucket, RefitIntegrityError, bucket_checksum

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
    changed = int(changed_mask.sum())
    index_dtype = torch.int32 if words <= 2**31 else torch.int64
    indices_bytes = changed * (index_dtype.itemsize + width)
    bitmap_bytes = -(-words // 8) + changed * width
    if min(indices_bytes, bitmap_bytes) >= max_size_ratio * words * width:
        return EncodedBucket(current.index, "dense", width, words, changed, None, buffer, current.checksum)

    if indices_bytes <= bitmap_bytes:
        encoding, positions = "indices", changed_mask.nonzero().view(-1).to(index_dtype)
    else:
        encoding, positions = "bitmap", _pack_bits(changed_mask)
    # a delta always carries the full bucket's checksum: it is what catches a delta applied to the wrong base
    checksum = current.checksum if current.checksum is not None else bucket_checksum(buffer)
    return EncodedBucket(current.index, encoding, width, words, changed, positions, current_words[changed_mask],
                         checksum)


def apply(previous: torch.Tensor | None, encoded: EncodedBucket) -> torch.Tensor:
    """The full flat uint8 bucket `encoded` stands for, in a new tensor (previous is untouched),
    checked against its checksum when it carries one."""
    if encoded.encoding == "dense":
        rebuilt = encoded.values.clone()
    else:
        if previous is None or previous.numel() != encoded.dense_bytes:
            held = "nothing" if previous is None else f"{previous.numel()} bytes"
            raise RefitIntegrityError(f"refit: bucket {encoded.index} arrived as a delta of {encoded.dense_bytes} "
                                      f"bytes but this receiver holds {held} to apply it to; it needs a dense "
                                      "refit first")
        rebuilt = previous.clone()
        rebuilt_words = rebuilt.view(_WORD_DTYPES[encoded.word_bytes])
        positions = (encoded.positions if encoded.encoding == "indices"
                     else _unpack_bits(encoded.positions, encoded.words))
        selected = positions.numel() if encoded.encoding == "indices" else int(positions.sum())
        if selected != encoded.values.numel():
            raise RefitIntegrityError(f"refit: bucket {encoded.index}'s delta names {selected} positions for "
                                      f"{encoded.values.numel()} values: it was corrupted in transit")
        rebuilt_words[positions] = encoded.values
    if encoded.checksum is not None:
        actual = bucket_checksum(rebuilt)
        if actual != encoded.checksum:
            raise RefitIntegrityError(f"refit: bucket {encoded.index} failed its checksum after applying its "
                                      f"{encoded.encoding} encoding (sent {encoded.checksum}, rebuilt {actual}): "
                                      "the bytes were corrupted in transit or the delta's base differs from the "
                                      "sender's; the next refit must be dense")
    return rebuilt


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
    return ((bits.unsqueeze(1) >> shifts) & 1).view(-1)[:count].bool()
