"""Episode summaries: accuracy over the episodes the environment gave a verdict on."""

import math

import pytest
import torch

from rlkit.algorithms.episodes import Episodes
from rlkit.data.batch import Batch


def _episodes(correct: list[float]) -> Episodes:
    n = len(correct)
    batch = Batch({"input_ids": torch.zeros(n, 3, dtype=torch.long), "response_mask": torch.ones(n, 3),
                   "generation_logprobs": torch.zeros(n, 3)})
    truncated = torch.zeros(n, dtype=torch.bool)
    return Episodes(batch, torch.full((n,), 3), torch.zeros(n), torch.tensor(correct), truncated, {}, torch.arange(n))


def test_one_failed_call_neither_hides_accuracy_nor_counts_as_wrong():
    summary = _episodes([1.0, 0.0, math.nan, 1.0]).summary("train")
    assert summary["train/accuracy"] == pytest.approx(2 / 3)
    assert summary["train/accuracy_scored"] == 3


def test_no_verdict_at_all_reports_no_accuracy():
    summary = _episodes([math.nan, math.nan]).summary("val")
    assert "val/accuracy" not in summary and "val/accuracy_scored" not in summary
    assert summary["val/reward"] == 0.0
