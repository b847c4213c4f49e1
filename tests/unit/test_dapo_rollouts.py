"""DAPO's rollout-side techniques on hand-computed cases: the soft overlong penalty, overlong
filtering and how truncation is detected, dynamic sampling's group filter and its loop (rounds,
dropped groups, the cap's fill, determinism of extra prompts; groups of uneven size, one-sample
groups, the group ids the batch keeps), the group ids episodes are made with, and the keys'
defaults (their validation: test_loss_variants.py)."""

from types import SimpleNamespace

import torch

from rlkit.algorithms.dapo_rollouts import (extra_prompts, informative_groups, overlong_filtered, overlong_penalty,
                                            sample_informative_groups)
from rlkit.algorithms.episodes import Episodes, run_episodes
from rlkit.config.schema import EnvRunnerConfig
from rlkit.data.batch import Batch
from rlkit.data.generation import Generations, SamplingParams
from rlkit.data.prompts import Prompt
from rlkit.envs.base import EnvStep
from rlkit.envs.runner import Stepped
from rlkit.launch.config import load_config


def test_soft_overlong_penalty_is_linear_over_the_buffer():
    # budget 10, buffer 4: no penalty up to 6 tokens, then -1/4 per token down to -1 at 10
    lengths = torch.tensor([3, 6, 7, 8, 10])
    assert overlong_penalty(lengths, 10, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


def test_overlong_filtering_zeroes_truncated_rows():
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    assert overlong_filtered(mask, torch.tensor([True, False])).tolist() == [[0, 0, 0], [0, 1, 0]]


class _Tokenizer:
    eos_token_id, pad_token_id = 9, 0

    def decode(self, ids, skip_special_tokens):
        return " ".join(map(str, ids))


class _Engine:
    """Prompt i answers with answers[i]: [9] ends with EOS, [5, 5] uses a budget of 2."""

    def __init__(self, answers):
        self.answers = answers

    def generate(self, prompt_ids, params):
        ids = [self.answers[p[0]][:params.max_new_tokens] for p in prompt_ids]
        return Generations(ids, [[-0.5] * len(a) for a in ids])


class _Envs:
    def step(self, items):
        return [Stepped(EnvStep(1.0, True), {}, 0.0) for _ in items]


def test_truncation_is_a_full_budget_without_eos():
    answers = {0: [4, 9], 1: [5, 5], 2: [7], 3: [6, 9]}  # EOS at the budget's end is not truncation
    prompts = [Prompt([], [i], {}) for i in answers]
    cfg = EnvRunnerConfig(num_workers=1, timeout_s=1.0, failure_reward=0.0, fail_fast=True, max_turns=1,
                          max_total_tokens=100, max_tool_seconds=0, observation_format="raw",
                          flow="per_turn")
    out = run_episodes(prompts, SimpleNamespace(tokenizer=_Tokenizer()), _Engine(answers), _Envs(),
                       SamplingParams(2, 1.0, 1.0, 0, seed=0), cfg)
    assert out.truncated.tolist() == [False, True, False, False]


def test_episodes_of_one_prompt_share_a_group_id():
    answers = {0: [4, 9], 1: [5, 9], 2: [7, 9]}
    cfg = EnvRunnerConfig(num_workers=1, timeout_s=1.0, failure_reward=0.0, fail_fast=True, max_turns=1,
                          max_total_tokens=100, max_tool_seconds=0, observation_format="raw",
                          flow="per_turn")
    out = run_episodes([Prompt([], [i], {}) for i in answers], SimpleNamespace(tokenizer=_Tokenizer()),
                       _Engine(answers), _Envs(), SamplingParams(2, 1.0, 1.0, 0, seed=0), cfg, samples_per_prompt=2)
    assert out.batch["input_ids"][:, 0].tolist() == [0, 0, 1, 1, 2, 2]  # each prompt's samples adjacent
    assert out.group_ids.tolist() == [0, 0, 1, 1, 2, 2]
    assert out.select([5, 0, 1]).group_ids.tolist() == [2, 0, 0]


def test_informative_groups_have_differing_rewards():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5, 0.5])
    assert informative_groups(rewards, 2).tolist() == [False, True, False, False]
    assert informative_groups(rewards, 4).tolist() == [True, True]
    # by id, uneven: 3 -> [1, 0, 0.5] differs; 8 -> [1] alone (nothing to compare); 5 -> [0, 0] equal;
    # 6 -> [1, 0.5] differs
    ids = torch.tensor([3, 3, 5, 8, 5, 3, 6, 6])
    assert informative_groups(torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.5, 1.0, 0.5]), ids).tolist() == \
        [True, False, True, False]  # ids in sorted order: 3, 5, 6, 8


def _rollout(prompts: list[str], rewards: dict, width: int) -> Episodes:
    """Episodes of prompts (one per reward of rewards[prompt], a group per prompt) with rows
    `width` tokens wide; input_ids hold the prompt's index."""
    group_ids = torch.tensor([g for g, p in enumerate(prompts) for _ in rewards[p]])
    n = len(group_ids)
    ids = torch.tensor([[ord(p)] * width for p in prompts for _ in rewards[p]])
    batch = Batch({"input_ids": ids, "response_mask": torch.ones(n, width), "generation_logprobs": torch.zeros(n, width)})
    return Episodes(batch, torch.full((n,), width), torch.tensor([r for p in prompts for r in rewards[p]]),
                    torch.zeros(n), torch.zeros(n, dtype=torch.bool), {"train/turns": 1.0, "env/failures": 1},
                    group_ids)


REWARDS = {"a": [1.0, 1.0], "b": [0.0, 1.0], "c": [1.0, 0.0], "d": [0.0, 0.0]}


def _sample(first, more, max_extra_rounds, rewards=REWARDS):
    rounds = []

    def roll_out(prompts, round_):
        rounds.append((round_, list(prompts)))
        return _rollout(prompts, rewards, width=3 + round_)

    batch, metrics = sample_informative_groups(first, roll_out, lambda round_: more[round_ - 1], max_extra_rounds,
                                               pad_id=0)
    return batch, metrics, rounds


def test_dynamic_sampling_rolls_out_more_until_the_batch_is_full():
    batch, metrics, rounds = _sample(["a", "b"], [["d", "c"], ["b", "b"]], max_extra_rounds=3)
    assert rounds == [(0, ["a", "b"]), (1, ["d", "c"])]  # full after one extra round: no third
    assert metrics == {"train/dynamic_sampling_rounds": 2, "train/dynamic_sampling_dropped_groups": 2,
                       "train/dynamic_sampling_filled_groups": 0}
    assert batch.rewards.tolist() == [0.0, 1.0, 1.0, 0.0]  # groups b then c, whole and in order
    assert batch.group_ids.tolist() == [0, 0, 1, 1]  # each round's group 1 (b, then c) stays its own
    # round 0's rows (3 wide) padded to round 1's width: input_ids with pad_id, the masks with 0
    assert batch.batch["input_ids"].tolist() == [[98, 98, 98, 0]] * 2 + [[99] * 4] * 2
    assert batch.batch["response_mask"].sum(1).tolist() == [3, 3, 4, 4]
    assert batch.metrics == {"train/turns": 1.0, "env/failures": 2}  # over both rounds: means weighted, counts added


def test_dynamic_sampling_keeps_the_first_informative_groups_only():
    batch, metrics, _ = _sample(["b", "a"], [["c", "b"]], max_extra_rounds=1)
    assert batch.rewards.tolist() == [0.0, 1.0, 1.0, 0.0]  # b, then c; the extra b is not used
    assert metrics["train/dynamic_sampling_rounds"] == 2


def test_at_the_cap_dropped_groups_fill_the_batch():
    batch, metrics, rounds = _sample(["a", "b", "d"], [["a", "d", "d"]], max_extra_rounds=1)
    assert len(rounds) == 2
    assert metrics == {"train/dynamic_sampling_rounds": 2, "train/dynamic_sampling_dropped_groups": 5,
                       "train/dynamic_sampling_filled_groups": 2}
    assert batch.rewards.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]  # b, then the first dropped: a, d
    assert batch.group_ids.tolist() == [0, 0, 1, 1, 2, 2]  # filled groups keep their groups


# uneven groups: e.g. failed samples removed; "s" has one sample (never informative)
UNEVEN = {"u": [1.0, 0.0, 0.0], "s": [1.0], "e": [0.5, 0.5], "v": [0.0, 1.0], "w": [2.0, 0.0, 1.0, 3.0]}


def test_dynamic_sampling_keeps_uneven_groups_whole_and_counts_groups():
    batch, metrics, rounds = _sample(["u", "s", "e"], [["w", "s", "v"]], max_extra_rounds=1, rewards=UNEVEN)
    assert len(rounds) == 2  # round 0 kept only u: one extra round
    assert metrics == {"train/dynamic_sampling_rounds": 2, "train/dynamic_sampling_dropped_groups": 3,
                       "train/dynamic_sampling_filled_groups": 0}  # s, e, then s again: groups, not rows
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 2.0, 0.0, 1.0, 3.0, 0.0, 1.0]  # u, w, v: whole
    assert batch.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2]


def test_extra_prompts_are_a_function_of_seed_step_and_round():
    rows = list(range(100))
    assert extra_prompts(rows, 8, 0, 5, 1) == extra_prompts(rows, 8, 0, 5, 1)
    assert len({tuple(extra_prompts(rows, 8, *key)) for key in [(0, 5, 1), (0, 5, 2), (0, 6, 1), (1, 5, 1)]}) == 4


def test_keys_are_off_by_default():
    for recipe in ("grpo_tiny_cpu", "rloo_tiny_cpu", "reinforce_pp_tiny_cpu", "ppo_tiny_cpu"):
        a = load_config(recipe, [])[0].algorithm
        assert (a.dynamic_sampling, a.dynamic_sampling_max_rounds, a.overlong_filtering, a.overlong_buffer,
                a.overlong_penalty_factor) == (False, 3, False, 0, 1.0)
