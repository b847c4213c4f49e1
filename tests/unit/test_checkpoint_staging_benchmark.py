"""benchmarks/checkpoint_staging.py on CPU, shrunk: each way of preparing the first save's host
buffers copies the state exactly, and only plain views of one block fail to serialize as their own
bytes (why the checkpoint's buffers are untyped-storage slices)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import checkpoint_staging  # noqa: E402


def test_every_way_copies_the_state_and_only_views_serialize_the_whole_block():
    results = {variant: checkpoint_staging.run_variant(variant, scale=0.01) for variant in checkpoint_staging.VARIANTS}
    assert {r["tensors"] for r in results.values()} == {728}  # SmolLM2's 182 tensors, four copies each
    assert all(r["copies_equal"] for r in results.values())
    assert {v for v, r in results.items() if not r["serializes_alone"]} == {"block_views"}
