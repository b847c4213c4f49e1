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


def test_trl_optimizer_steps_group_into_generation_rounds_with_their_own_phases():
    import e2e_trl

    begins, ends = [0, 10, 20, 30], [9, 19, 29, 39]
    timings = [(0, "GRPOTrainer.vLLM.generate", 6.0), (0, "GRPOTrainer.sync_weights", 0.5),
               (1, "GRPOTrainer.compute_loss", 2.0), (2, "GRPOTrainer.vLLM.generate", 5.0),
               (2, "GRPOTrainer.sync_weights", 0.25)]
    assert e2e_trl.rounds(begins, ends, timings, per_round=2) == [
        {"step": 19, "generate": 6.0, "weight_sync": 0.5}, {"step": 19, "generate": 5.0, "weight_sync": 0.25}]
    assert len(e2e_trl.rounds(begins, ends[:3], timings, per_round=2)) == 1  # an unfinished round is left out


def test_ratios_cover_start_up_first_step_and_the_phases_both_report():
    rlkit = {"to_first_step_s": 30.0, "first_step_s": 12.0, "median": {"step": 8.0, "generate": 4.0, "train": 2.0}}
    peer = {"to_first_step_s": 60.0, "first_step_s": 16.0, "median": {"step": 10.0, "generate": 5.0, "other": 3.0}}
    assert e2e.ratios(rlkit, peer) == pytest.approx({"step": 0.8, "generate": 0.8, "to_first_step_s": 0.5,
                                                     "first_step_s": 0.75})
