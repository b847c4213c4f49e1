"""Episode summaries: accuracy over the episodes the environment gave a verdict on; each
episode's budgets (turns, tokens, environment seconds) and its requests' seeds."""

import math

import pytest
import torch

from rlkit.algorithms.episodes import Episode, Episodes, used_up_budget
from rlkit.algorithms.trajectories import request_seed
from rlkit.config.schema import EnvRunnerConfig
from rlkit.data.batch import Batch
from rlkit.envs.base import EnvStep
from rlkit.envs.runner import Stepped


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


# ---- per-episode budgets and request seeds ------------------------------------------------------

def _runner_cfg(**overrides) -> EnvRunnerConfig:
    values = dict(num_workers=1, timeout_s=1.0, failure_reward=0.0, fail_fast=False, max_turns=3,
                  max_total_tokens=10, max_tool_seconds=2.0, observation_format="{observation}", flow="per_trajectory")
    return EnvRunnerConfig(**{**values, **overrides})


def _episode(**state) -> Episode:
    return Episode(token_ids=[1], trained=[False], logprobs=[0.0], messages=[], metadata={}, group=0, **state)


@pytest.mark.parametrize("state, budget", [
    (dict(turns=1, generated=4, env_seconds=0.5), None),
    (dict(turns=3, generated=4, env_seconds=0.5), "max_turns"),
    (dict(turns=1, generated=10, env_seconds=0.5), "max_total_tokens"),
    (dict(turns=1, generated=4, env_seconds=2.0), "max_tool_seconds"),
    (dict(turns=3, generated=10, env_seconds=9.0), "max_turns"),  # the first in BUDGETS' order counts
])
def test_used_up_budget_names_the_first_budget_reached(state, budget):
    assert used_up_budget(_episode(**state), _runner_cfg()) == budget


def test_no_tool_time_limit_at_zero():
    assert used_up_budget(_episode(turns=1, env_seconds=1e6), _runner_cfg(max_tool_seconds=0)) is None


class _Renderer:
    def appended_ids(self, generated, messages):
        return [7] * len(messages)


def test_a_budget_ends_the_episode_cleanly_and_is_counted():
    """An environment that would go on: the step's reward counts, nothing more is appended, and
    env/ended_<budget> says which budget ended it; an environment that ends it is no budget's doing."""
    going_on = Stepped(EnvStep(reward=0.5, done=False, observation="more"), {}, 1.5)
    episode = _episode(turns=1)
    episode.add_step(going_on, [5], _Renderer(), _runner_cfg())
    assert not episode.done and episode.token_ids == [1, 7] and episode.env_seconds == 1.5
    episode.add_step(going_on, [5], _Renderer(), _runner_cfg())  # 3.0 s of 2.0
    assert episode.done and episode.token_ids == [1, 7] and episode.reward == 1.0
    assert episode.counts == {"env/ended_max_tool_seconds": 1}
    finished = _episode(turns=3)
    finished.add_step(Stepped(EnvStep(reward=1.0, done=True), {}, 5.0), [5], _Renderer(), _runner_cfg())
    assert finished.done and finished.counts == {}


def test_request_seeds_are_fixed_and_distinct():
    seeds = {request_seed(rollout, episode, turn) for rollout in (0, 1, 100) for episode in range(64)
             for turn in range(4)}
    assert len(seeds) == 3 * 64 * 4 and all(0 <= s < 2**63 for s in seeds)
    # a function of the three numbers alone: a resumed run draws the same samples
    assert request_seed(3, 1, 0) == request_seed(3, 1, 0) != request_seed(3, 0, 1)
    assert request_seed(0, 0, 0) == 759540517790923586
