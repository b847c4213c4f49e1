"""benchmarks/e2e.py's summary of a run's steps (pure)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import e2e  # noqa: E402


def step(generate, logprobs, train, weight_sync, total):
    return {"generate": generate, "logprobs": logprobs, "train": train, "weight_sync": weight_sync, "step": total}


def test_other_and_the_outside_share_are_taken_per_step_before_the_median():
    # the first step is warm-up; medians over steps 2..4
    result = e2e.summary([step(50, 5, 5, 5, 100), step(10, 2, 4, 1, 20), step(14, 2, 2, 1, 20), step(12, 2, 4, 1, 30)])
    median = result["median"]
    assert median["other"] == pytest.approx(3)  # others 3, 1, 11
    # outside shares 0.2, 0.1, 0.4667: the median of the steps, not 1 - (12 + 2 + 4) / 20
    assert result["outside_compute_fraction"] == pytest.approx(0.2)
    assert [s["other"] for s in result["steps"]] == pytest.approx([35, 3, 1, 11])
