"""RefitPlan: layout, dtype policy, bit-exact pack/unpack round trips, integrity errors."""

import pytest
import torch

from rlkit.refit.plan import PackedBucket, RefitIntegrityError, RefitPlan, Slot
from rlkit.refit.receiver import ObjectStoreReceiver

MIXED = [  # interleaved dtypes so the per-dtype regions have to reorder them
    ("model.embed.weight", (3, 5), "float32"),
    ("model.norm.weight", (7,), "bfloat16"),
    ("model.position_ids", (4,), "int64"),
    ("model.half.weight", (2, 3), "float16"),
    ("model.layers.0.mlp.gate.e_score_correction_bias", (3,), "float32"),
    ("model.scalar", (), "bfloat16"),
]


def make_tensors(manifest, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape, dtype in manifest:
        dt = getattr(torch, dtype)
        if dt.is_floating_point:
            t = torch.randn(shape, generator=gen).to(dt)
            if t.numel() >= 4:  # bit patterns that value comparisons would miss
                flat = t.view(-1)
                flat[0], flat[1], flat[2], flat[3] = float("nan"), float("-inf"), -0.0, torch.finfo(dt).tiny / 2
        elif dt == torch.bool:
            t = torch.randint(0, 2, shape, generator=gen).bool()
        else:
            info = torch.iinfo(dt)
            t = torch.randint(info.min, info.max, shape, generator=gen, dtype=dt)
        out[name] = t
    return out


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).tolist())


def whole(tensors: dict) -> dict:
    """Each tensor as a single piece starting at row 0, the way the bridge export packs."""
    return {name: [(tensor, 0)] for name, tensor in tensors.items()}


def round_trip(plan, tensors, verify=True):
    received = {}
    for bucket in plan.buckets:
        packed = plan.pack(bucket.index, whole({s.name: tensors[s.name] for s in bucket.slots}), with_checksum=verify)
        for name, tensor in plan.unpack(packed, verify=verify):
            assert name not in received
            received[name] = tensor
    return received


def test_mixed_dtypes_in_one_bucket_round_trip_bit_exact():
    plan = RefitPlan.build(MIXED, bucket_bytes=1 << 20)
    assert len(plan.buckets) == 1
    tensors = make_tensors(MIXED)
    received = round_trip(plan, tensors)
    assert set(received) == {name for name, _, _ in MIXED}
    for name, shape, dtype in MIXED:
        assert received[name].dtype == getattr(torch, dtype) and tuple(received[name].shape) == shape
        assert bits(received[name]) == bits(tensors[name]), name


def test_hand_computed_layout():
    manifest = [("a", (3,), "float32"), ("b", (5,), "bfloat16"), ("c", (1,), "float32")]
    plan = RefitPlan.build(manifest, bucket_bytes=1000)
    # float32 region first (first-seen dtype), each slot padded to 16 bytes
    assert plan.buckets[0].slots == (Slot("a", (3,), "float32", 0, 12), Slot("c", (1,), "float32", 16, 4),
                                     Slot("b", (5,), "bfloat16", 32, 10))
    assert plan.buckets[0].nbytes == plan.total_bytes == 48
    # a budget of 32 bytes fits a and b (16 + 16 aligned), c opens a second bucket
    plan = RefitPlan.build(manifest, bucket_bytes=32)
    assert [[s.name for s in b.slots] for b in plan.buckets] == [["a", "b"], ["c"]]
    assert [b.index for b in plan.buckets] == [0, 1]


def test_tensor_larger_than_budget_gets_its_own_bucket():
    manifest = [("small.a", (4,), "float32"), ("big", (100,), "float32"), ("small.b", (2,), "float32")]
    plan = RefitPlan.build(manifest, bucket_bytes=64)
    assert [[s.name for s in b.slots] for b in plan.buckets] == [["small.a"], ["big"], ["small.b"]]
    assert plan.buckets[1].nbytes == 400
    tensors = make_tensors(manifest)
    received = round_trip(plan, tensors)
    for name in tensors:
        assert bits(received[name]) == bits(tensors[name])


def test_empty_manifest():
    plan = RefitPlan.build([], bucket_bytes=1024)
    assert plan.buckets == () and plan.names == [] and plan.bucket_of() == {} and plan.total_bytes == 0


def random_manifest(n=40, seed=3):
    gen = torch.Generator().manual_seed(seed)
    dtypes = ["float32", "bfloat16", "int64", "float16", "int32", "bool"]
    manifest = []
    for i in range(n):
        shape = tuple(int(d) for d in torch.randint(1, 9, (int(torch.randint(0, 3, ())),), generator=gen))
        manifest.append((f"layer.{i}.w", shape, dtypes[int(torch.randint(0, len(dtypes), ()))]))
    return manifest


def test_slots_aligned_non_overlapping_and_within_budget():
    budget = 128
    plan = RefitPlan.build(random_manifest(), bucket_bytes=budget)
    assert len(plan.buckets) > 3
    for bucket in plan.buckets:
        end = 0
        for slot in sorted(bucket.slots, key=lambda s: s.offset):
            assert slot.offset % 16 == 0, slot
            assert slot.offset >= end, f"{slot.name} overlaps the previous slot"
            end = slot.offset + slot.nbytes
        assert end <= bucket.nbytes and bucket.nbytes % 16 == 0
        if len(bucket.slots) > 1:
            assert bucket.nbytes <= budget


def test_every_tensor_in_exactly_one_bucket_in_manifest_order():
    manifest = random_manifest()
    plan = RefitPlan.build(manifest, bucket_bytes=128)
    names = [name for name, _, _ in manifest]
    assert sorted(plan.names) == sorted(names) and len(set(plan.names)) == len(names)
    bucket_of = plan.bucket_of()
    for bucket in plan.buckets:
        for slot in bucket.slots:
            assert bucket_of[slot.name] == bucket.index
    # walking the manifest, bucket indices never go back: bucket k is a contiguous run of it
    position = 0
    for bucket in plan.buckets:
        run = names[position: position + len(bucket.slots)]
        assert sorted(run) == sorted(s.name for s in bucket.slots)
        position += len(bucket.slots)
    assert position == len(names)
    # with a single dtype no regrouping happens, so names is exactly the manifest order
    single = [(n, s, "float32") for n, s, _ in manifest]
    assert RefitPlan.build(single, bucket_bytes=128).names == names


def test_random_manifest_round_trips_bit_exact():
    manifest = random_manifest()
    plan = RefitPlan.build(manifest, bucket_bytes=128)
    tensors = make_tensors(manifest)
    received = round_trip(plan, tensors)
    for name in tensors:
        assert bits(received[name]) == bits(tensors[name]), name


def test_transfer_dtype_and_keep_fp32():
    plan = RefitPlan.build(MIXED, bucket_bytes=1 << 20, transfer_dtype="bfloat16",
                           keep_fp32=("*e_score_correction_bias",))
    wire = {s.name: s.dtype for b in plan.buckets for s in b.slots}
    assert wire == {
        "model.embed.weight": "bfloat16",
        "model.norm.weight": "bfloat16",
        "model.position_ids": "int64",  # integers are never cast
        "model.half.weight": "bfloat16",
        "model.layers.0.mlp.gate.e_score_correction_bias": "float32",  # glob keeps it fp32
        "model.scalar": "bfloat16",
    }
    tensors = make_tensors(MIXED)
    received = round_trip(plan, tensors)
    for name, tensor in tensors.items():
        expected = tensor.to(getattr(torch, wire[name]))
        assert received[name].dtype == expected.dtype and bits(received[name]) == bits(expected), name


def test_receiver_refuses_float32_into_a_narrower_tensor():
    plan = RefitPlan.build([("w", (2,), "float32"), ("b", (2,), "float32")], bucket_bytes=1 << 20,
                           transfer_dtype="bfloat16", keep_fp32=("b",))
    held = {"w": torch.zeros(2, dtype=torch.bfloat16), "b": torch.zeros(2, dtype=torch.bfloat16)}
    with pytest.raises(RefitIntegrityError, match=r"refit.keep_fp32: worker 0 holds \['b'\] in torch.bfloat16"):
        ObjectStoreReceiver(held, "worker 0").begin(plan, verify_checksums=False)
    held["b"] = torch.zeros(2)
    ObjectStoreReceiver(held, "worker 0").begin(plan, verify_checksums=False)


def test_corrupted_byte_names_bucket_and_tensor():
    manifest = [("first.w", (8,), "float32"), ("second.w", (8,), "float32"), ("third.b", (3,), "bfloat16")]
    plan = RefitPlan.build(manifest, bucket_bytes=32)
    assert len(plan.buckets) == 3
    tensors = make_tensors(manifest)
    packed = plan.pack(1, whole({"second.w": tensors["second.w"]}), with_checksum=True)
    plan.unpack(packed, verify=True)  # intact: no error
    for position in range(packed.buffer.numel()):  # every single-byte corruption is caught
        corrupted = packed.buffer.clone()
        corrupted[position] ^= 0x01
        with pytest.raises(RefitIntegrityError) as info:
            plan.unpack(PackedBucket(1, corrupted, packed.checksum), verify=True)
        assert "bucket 1" in str(info.value) and "second.w" in str(info.value)
    plan.unpack(PackedBucket(1, corrupted, packed.checksum), verify=False)  # no verification, no error
    swapped = packed.buffer.clone()  # two reordered 4-byte words are caught too
    swapped[0:4], swapped[4:8] = packed.buffer[4:8], packed.buffer[0:4]
    assert not torch.equal(swapped, packed.buffer)
    with pytest.raises(RefitIntegrityError, match="bucket 1"):
        plan.unpack(PackedBucket(1, swapped, packed.checksum), verify=True)


def test_checksum_is_the_position_weighted_word_sum_whatever_its_row_width(monkeypatch):
    """The checksum reads a buffer's words as rows (two reductions, no temporary the bucket's size);
    its value must be the plain definition's, sum(w) * 1_000_003 + sum(i * w_i) over the words'
    1-based positions modulo 2**64, at any row width and for a buffer that does not start on a
    word, or senders and receivers that read them otherwise would disagree."""
    from rlkit.refit import plan as plan_module

    def by_definition(buffer: torch.Tensor) -> int:
        data = bytes(buffer.tolist()) + bytes(-buffer.numel() % 4)
        words = [int.from_bytes(data[i:i + 4], "little", signed=True) for i in range(0, len(data), 4)]
        value = (sum(words) * 1_000_003 + sum(i * w for i, w in enumerate(words, 1))) % 2**64
        return value - 2**64 if value >= 2**63 else value

    gen = torch.Generator().manual_seed(0)
    buffers = [torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8) for n in (1, 4001, 12_345)]
    buffers.append(torch.full((10_000,), 255, dtype=torch.uint8))  # all words -1: negative sums
    buffers.append(buffers[2][1:])  # a view one byte into its storage
    expected = [by_definition(b) for b in buffers]
    for columns in (plan_module._CHECKSUM_COLUMNS, 1000, 1):
        monkeypatch.setattr(plan_module, "_CHECKSUM_COLUMNS", columns)
        assert [plan_module.bucket_checksum(b) for b in buffers] == expected, columns


@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_size_buffer_raises(delta):
    plan = RefitPlan.build(MIXED, bucket_bytes=1 << 20)
    packed = plan.pack(0, whole(make_tensors(MIXED)), with_checksum=False)
    wrong = torch.zeros(packed.buffer.numel() + delta, dtype=torch.uint8)
    with pytest.raises(RefitIntegrityError, match="bucket 0"):
        plan.unpack(PackedBucket(0, wrong, None), verify=False)


def test_shape_mismatch_at_pack_raises():
    plan = RefitPlan.build(MIXED, bucket_bytes=1 << 20)
    tensors = make_tensors(MIXED)
    tensors["model.half.weight"] = torch.zeros(3, 2, dtype=torch.float16)  # same numel, wrong shape
    with pytest.raises(RefitIntegrityError, match="model.half.weight"):
        plan.pack(0, whole(tensors), with_checksum=False)


def test_verify_without_checksum_raises():
    plan = RefitPlan.build(MIXED, bucket_bytes=1 << 20)
    packed = plan.pack(0, whole(make_tensors(MIXED)), with_checksum=False)
    assert packed.checksum is None
    with pytest.raises(RefitIntegrityError, match="no checksum"):
        plan.unpack(packed, verify=True)
    assert len(plan.unpack(packed, verify=False)) == len(MIXED)


def test_row_pieces_pack_like_the_assembled_tensor():
    """A direct export sends row runs of source tensors (a fused qkv split into q, k, v); the
    bucket must hold exactly the bytes of the tensors those runs assemble."""
    manifest = [("q", (4, 3), "bfloat16"), ("k", (2, 3), "bfloat16"), ("norm", (3,), "float32"), ("s", (), "float32")]
    plan = RefitPlan.build(manifest, bucket_bytes=1 << 20, transfer_dtype="bfloat16", keep_fp32=("norm",))
    fused = torch.randn(6, 3)  # rows interleaved per group: q0 q1 k0 q2 q3 k1
    norm, scalar = torch.randn(3, dtype=torch.bfloat16), torch.tensor(2.5)
    pieces = {"q": [(fused[0:2], 0), (fused[3:5], 2)], "k": [(fused[2:3], 0), (fused[5:6], 1)],
              "norm": [(norm[:1], 0), (norm[1:], 1)], "s": [(scalar, 0)]}
    assembled = {"q": torch.cat([fused[0:2], fused[3:5]]), "k": fused[[2, 5]], "norm": norm, "s": scalar}
    by_pieces = plan.unpack(plan.pack(0, pieces, with_checksum=False), verify=False)
    by_tensors = plan.unpack(plan.pack(0, whole(assembled), with_checksum=False), verify=False)
    for (name, got), (_, expected) in zip(by_pieces, by_tensors):
        assert got.dtype == expected.dtype and bits(got) == bits(expected), name


def test_pieces_that_leave_rows_unfilled_raise():
    plan = RefitPlan.build([("q", (4, 3), "float32")], bucket_bytes=1 << 20)
    with pytest.raises(RefitIntegrityError, match="q got 3 rows"):
        plan.pack(0, {"q": [(torch.zeros(3, 3), 0)]}, with_checksum=False)
