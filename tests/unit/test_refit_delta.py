"""Delta refit's core (rlkit/refit/delta.py): buckets packed by RefitPlan, encoded against the
previous version, rebuilt bit-exact; encoding choice, integrity errors, metrics."""

from dataclasses import replace

import pytest
import torch

from rlkit.refit.delta import HostCopies, _pack_bits, _unpack_bits, apply, delta_metrics, encode, word_bytes
from rlkit.refit.plan import RefitIntegrityError, RefitPlan


def pack(plan: RefitPlan, index: int, tensors: dict, with_checksum=True):
    """Bucket `index` of `tensors`, packed into a zeroed buffer: pack leaves padding bytes as they
    were, and a test that packs the same tensors twice must get the same padding."""
    bucket = plan.buckets[index]
    sources = {s.name: [(tensors[s.name], 0)] for s in bucket.slots}
    return plan.pack(index, sources, with_checksum, out=torch.zeros(bucket.nbytes, dtype=torch.uint8))


def round_trip(plan, index, previous_tensors, current_tensors, **encode_options):
    """(encoded, rebuilt buffer, packed current) for bucket `index` going from one set of tensors
    to the next; checks the rebuilt bucket is bit-exact and the base untouched."""
    previous = pack(plan, index, previous_tensors).buffer
    kept = previous.clone()
    current = pack(plan, index, current_tensors)
    encoded = encode(previous, current, plan.buckets[index], **encode_options)
    rebuilt = apply(previous, encoded)
    assert torch.equal(rebuilt, current.buffer)
    assert torch.equal(previous, kept), "apply wrote into its base"
    return encoded, rebuilt, current


def bf16_plan(numel=4096):
    return RefitPlan.build([("w", (numel,), "bfloat16")], bucket_bytes=1 << 20)


def bf16_weights(numel=4096, seed=0):
    return {"w": torch.randn(numel, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)}


def changed_at(tensors: dict, name: str, positions) -> dict:
    """A copy of `tensors` whose `name` has one bf16 unit of last place added at `positions`."""
    changed = {n: t.clone() for n, t in tensors.items()}
    changed[name].view(torch.int16)[positions] += 1
    return changed


@pytest.mark.parametrize("dtypes, width", [(["bfloat16"], 2), (["bfloat16", "float32"], 2), (["float32"], 4),
                                           (["float32", "int64"], 4), (["int64"], 8), (["bfloat16", "bool"], 1)])
def test_word_bytes_is_the_widest_width_dividing_every_element(dtypes, width):
    plan = RefitPlan.build([(f"t{i}", (3,), dtype) for i, dtype in enumerate(dtypes)], bucket_bytes=1 << 20)
    assert word_bytes(plan.buckets[0]) == width


def test_without_previous_the_bucket_goes_dense_and_round_trips():
    plan = bf16_plan()
    current = pack(plan, 0, bf16_weights())
    encoded = encode(None, current, plan.buckets[0])
    assert encoded.encoding == "dense" and encoded.positions is None
    assert encoded.sent_bytes == encoded.dense_bytes == plan.buckets[0].nbytes
    assert encoded.changed == encoded.words == plan.buckets[0].nbytes // 2
    assert torch.equal(apply(None, encoded), current.buffer)


def test_few_changed_bf16_elements_travel_as_indices():
    plan, weights = bf16_plan(), bf16_weights()
    encoded, _, _ = round_trip(plan, 0, weights, changed_at(weights, "w", [5, 700, 4095]))
    assert encoded.encoding == "indices" and encoded.changed == 3
    assert encoded.positions.tolist() == [5, 700, 4095] and encoded.positions.dtype == torch.int32
    assert encoded.sent_bytes == 3 * (4 + 2)  # an int32 index and a bf16 value each


def test_moderately_sparse_change_travels_as_bitmap():
    plan, weights = bf16_plan(), bf16_weights()
    encoded, _, _ = round_trip(plan, 0, weights, changed_at(weights, "w", slice(0, None, 10)))  # 10% changed
    changed = len(range(0, 4096, 10))
    assert encoded.encoding == "bitmap" and encoded.changed == changed
    assert encoded.sent_bytes == 4096 // 8 + changed * 2 < changed * (4 + 2)  # smaller than indices would be


def test_mixed_dtype_bucket_round_trips_and_unpacks_the_new_tensors():
    manifest = [("embed.weight", (40, 8), "float32"), ("router.bias", (8,), "float32"),
                ("norm.weight", (8,), "float32")]
    plan = RefitPlan.build(manifest, bucket_bytes=1 << 20, transfer_dtype="bfloat16", keep_fp32=("router.bias",))
    assert len(plan.buckets) == 1 and {s.dtype for s in plan.buckets[0].slots} == {"bfloat16", "float32"}
    gen = torch.Generator().manual_seed(1)
    before = {name: torch.randn(shape, generator=gen) for name, shape, _ in manifest}
    after = {name: t.clone() for name, t in before.items()}
    after["embed.weight"][3, 4] += 1.0  # one bf16 element
    after["router.bias"][2] += 1e-6  # one float32 element, whose high 2-byte word stays the same
    encoded, rebuilt, current = round_trip(plan, 0, before, after)
    assert encoded.encoding == "indices" and encoded.word_bytes == 2 and encoded.changed == 2
    received = dict(plan.unpack(replace(current, buffer=rebuilt), verify=True))
    for name, tensor in after.items():
        expected = tensor.to(received[name].dtype)
        assert torch.equal(received[name].view(torch.uint8), expected.view(torch.uint8)), name
    assert received["router.bias"].dtype == torch.float32


def test_all_changed_falls_back_to_dense():
    plan = bf16_plan()
    encoded, _, _ = round_trip(plan, 0, bf16_weights(seed=0), bf16_weights(seed=1))
    assert encoded.encoding == "dense" and encoded.sent_bytes == encoded.dense_bytes
    assert encoded.changed > 0.9 * encoded.words  # still counted: it feeds refit/delta_fraction


def test_nothing_changed_is_an_empty_delta():
    plan, weights = bf16_plan(), bf16_weights()
    encoded, _, current = round_trip(plan, 0, weights, weights)
    assert encoded.encoding == "indices" and encoded.changed == 0 and encoded.sent_bytes == 0
    assert encoded.checksum == current.checksum


def test_sign_of_zero_and_nan_payload_are_changes():
    plan = bf16_plan()
    before = {"w": torch.zeros(4096, dtype=torch.bfloat16)}
    before["w"].view(torch.int16)[1] = 0x7FC0  # a quiet NaN
    after = {"w": before["w"].clone()}
    after["w"][0] = -0.0  # equal to +0.0 as a number
    after["w"].view(torch.int16)[1] = 0x7FC1  # another NaN payload
    encoded, rebuilt, _ = round_trip(plan, 0, before, after)
    assert encoded.changed == 2 and encoded.positions.tolist() == [0, 1]
    assert rebuilt.view(torch.int16)[:2].tolist() == [-0x8000, 0x7FC1]


def test_a_delta_without_checksum_still_carries_one():
    plan, weights = bf16_plan(), bf16_weights()
    previous = pack(plan, 0, weights).buffer
    current = pack(plan, 0, changed_at(weights, "w", [1]), with_checksum=False)
    assert encode(previous, current, plan.buckets[0]).checksum is not None
    assert encode(None, current, plan.buckets[0]).checksum is None  # dense travels as the plan says


def two_bucket_case():
    manifest = [("a", (256,), "bfloat16"), ("b", (256,), "bfloat16")]
    plan = RefitPlan.build(manifest, bucket_bytes=512)
    assert len(plan.buckets) == 2
    gen = torch.Generator().manual_seed(2)
    before = {name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape, _ in manifest}
    return plan, before


@pytest.mark.parametrize("spread", [3, 32], ids=["indices", "bitmap"])
def test_corrupted_delta_names_the_bucket(spread):
    plan, before = two_bucket_case()
    previous = pack(plan, 1, before).buffer
    encoded = encode(previous, pack(plan, 1, changed_at(before, "b", slice(0, spread))), plan.buckets[1])
    assert encoded.encoding == ("indices" if spread == 3 else "bitmap")
    flipped_value = encoded.values.clone()
    flipped_value[0] ^= 1
    flipped_position = encoded.positions.clone()
    flipped_position[-1] ^= 1
    for corrupted in (replace(encoded, values=flipped_value), replace(encoded, positions=flipped_position)):
        with pytest.raises(RefitIntegrityError, match="bucket 1"):
            apply(previous, corrupted)


def test_delta_applied_to_another_base_names_the_bucket():
    plan, before = two_bucket_case()
    encoded = encode(pack(plan, 1, before).buffer, pack(plan, 1, changed_at(before, "b", [0])), plan.buckets[1])
    stale = pack(plan, 1, changed_at(before, "b", [9])).buffer  # the receiver missed a refit
    with pytest.raises(RefitIntegrityError, match="bucket 1 failed its checksum.*the next refit must be dense"):
        apply(stale, encoded)


def test_delta_without_a_base_needs_a_dense_refit():
    plan, before = two_bucket_case()
    encoded = encode(pack(plan, 0, before).buffer, pack(plan, 0, changed_at(before, "a", [0])), plan.buckets[0])
    with pytest.raises(RefitIntegrityError, match="bucket 0 arrived as a delta.*needs a dense refit first"):
        apply(None, encoded)
    with pytest.raises(RefitIntegrityError, match="holds 16 bytes.*needs a dense refit first"):
        apply(torch.zeros(16, dtype=torch.uint8), encoded)


def test_previous_of_another_size_goes_dense():
    plan = bf16_plan()
    current = pack(plan, 0, bf16_weights())
    assert encode(torch.zeros(16, dtype=torch.uint8), current, plan.buckets[0]).encoding == "dense"


def test_max_size_ratio_decides_dense():
    plan, weights = bf16_plan(), bf16_weights()
    after = changed_at(weights, "w", slice(0, None, 10))
    assert round_trip(plan, 0, weights, after, max_size_ratio=0.1)[0].encoding == "dense"
    assert round_trip(plan, 0, weights, after, max_size_ratio=0.2)[0].encoding == "bitmap"  # 0.16 of dense


def test_delta_metrics_per_bucket_and_summed():
    plan, before = two_bucket_case()
    encoded = [encode(pack(plan, 0, before).buffer, pack(plan, 0, changed_at(before, "a", [0, 1])), plan.buckets[0]),
               encode(None, pack(plan, 1, before), plan.buckets[1])]
    assert delta_metrics(encoded[:1]) == {"refit/delta_fraction": 2 / 256, "refit/delta_bytes": 2 * 6,
                                          "refit/dense_bytes": 512}
    assert delta_metrics(encoded) == {"refit/delta_fraction": (2 + 256) / 512, "refit/delta_bytes": 12 + 512,
                                      "refit/dense_bytes": 1024}
    assert delta_metrics([]) == {"refit/delta_fraction": 0.0, "refit/delta_bytes": 0, "refit/dense_bytes": 0}


@pytest.mark.parametrize("count", [1, 7, 8, 9, 17])
def test_bitmap_round_trips_any_length(count):
    mask = torch.rand(count, generator=torch.Generator().manual_seed(count)) < 0.5
    bits = _pack_bits(mask)
    assert bits.dtype == torch.uint8 and bits.numel() == -(-count // 8)
    assert torch.equal(_unpack_bits(bits, count), mask)


def test_small_adam_steps_change_few_exported_bf16_weights():
    """fp32 master weights trained by Adam at lr 1e-5 and exported in bf16, as refit sends them:
    most bf16 values do not move between two refits, and every delta rebuilds its bucket exactly."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.GELU(), torch.nn.Linear(256, 128))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    manifest = [(name, tuple(p.shape), "float32") for name, p in model.named_parameters()]
    plan = RefitPlan.build(manifest, bucket_bytes=1 << 16, transfer_dtype="bfloat16")
    assert len(plan.buckets) > 1

    def export():
        weights = {name: p.detach() for name, p in model.named_parameters()}
        return [pack(plan, b.index, weights) for b in plan.buckets]

    sent = [p.buffer for p in export()]  # the first refit: dense
    for step in range(3):
        inputs = torch.randn(32, 128)
        loss = (model(inputs) - inputs).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        packed = export()
        encoded = [encode(previous, current, bucket) for previous, current, bucket in zip(sent, packed, plan.buckets)]
        sent = [apply(previous, e) for previous, e in zip(sent, encoded)]
        for rebuilt, current in zip(sent, packed):
            assert torch.equal(rebuilt, current.buffer)
        metrics = delta_metrics(encoded)
        assert 0 < metrics["refit/delta_fraction"] < 0.25, f"step {step}: {metrics}"
        assert metrics["refit/delta_bytes"] < 0.5 * metrics["refit/dense_bytes"], f"step {step}: {metrics}"
        assert {e.encoding for e in encoded} <= {"indices", "bitmap"}, f"step {step}: {metrics}"


def test_host_copies_keep_a_reused_buffer_in_one_buffer_per_bucket_and_an_unused_one_as_it_is():
    copies, buffer = HostCopies(), torch.arange(16, dtype=torch.uint8)
    kept = copies.keep(3, buffer, reused=True)
    buffer.zero_()  # the receiver's transfer buffer takes the next bucket
    assert torch.equal(kept, torch.arange(16, dtype=torch.uint8))
    again = copies.keep(3, torch.full((16,), 7, dtype=torch.uint8), reused=True)
    assert again.data_ptr() == kept.data_ptr() and int(again[0]) == 7  # overwritten at every refit, not reallocated
    unused = torch.ones(16, dtype=torch.uint8)
    assert copies.keep(4, unused, reused=False) is unused  # the sender's own packed bucket: no copy
