"""The closing line of `rlkit train` names the validation metrics from the first validation to the
last, whether or not the run validated before training."""

from rlkit.cli import _validation_summary


def test_the_summary_spans_the_first_and_last_validation():
    history = [{"step": 0, "val/accuracy": 0.25}, {"step": 1}, {"step": 2, "val/accuracy": 0.5}]
    assert _validation_summary(history) == "val/accuracy 0.250 -> 0.500"


def test_a_run_that_validated_once_names_that_value():
    history = [{"step": 1, "train/reward": 0.0}, {"step": 2, "val/accuracy": 0.5, "val/reward": 0.75}]
    assert _validation_summary(history) == "val/accuracy 0.500, val/reward 0.750"


def test_a_run_without_validation_says_so():
    assert _validation_summary([{"step": 1, "train/reward": 0.0}]) == "no validation ran"
    assert _validation_summary([]) == "no validation ran"
