"""DAPO's rollout-side techniques (Yu et al. 2025, arXiv:2503.14476), for every RL algorithm:
dynamic sampling (algorithm.dynamic_sampling), the soft overlong penalty (algorithm.overlong_buffer)
and overlong filtering (algorithm.overlong_filtering)."""

import random
from typing import Callable

import torch

from rlkit.algorithms.advantages import group_index
from rlkit.algorithms.episodes import Episodes, concat_episodes


def overlong_penalty(response_lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment, added to each sample's reward [B]: 0 up to
    max_length - buffer response tokens, then falling linearly to -factor at max_length:
    -factor * min(max(length - (max_length - buffer), 0) / buffer, 1)."""
    over = (response_lengths.float() - (max_length - buffer)).clamp(min=0.0)
    return -factor * (over / buffer).clamp(max=1.0)


def overlong_filtered(response_mask: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    """DAPO's overlong filtering: a response cut at the token budget [B] gets no loss, its mask
    [B, S] zeroed (its reward still enters its group's advantages)."""
    return response_mask * (~truncated).to(response_mask.dtype).unsqueeze(1)


def informative_groups(rewards: torch.Tensor, groups: int | torch.Tensor) -> torch.Tensor:
    """[G] bool per group (group_size or [B] group ids, in group_index's order): its rewards are
    not all equal. A group of equal rewards, or of one sample, has zero group-relative advantage:
    no gradient signal."""
    index = group_index(groups, rewards.numel())
    count, values = int(torch.bincount(index).numel()), rewards.float()
    lowest = torch.full((count,), float("inf")).scatter_reduce(0, index, values, "amin")
    highest = torch.full((count,), float("-inf")).scatter_reduce(0, index, values, "amax")
    return lowest < highest


def extra_prompts(rows: list, count: int, seed: int, step: int, round_: int) -> list:
    """Round round_'s prompts of step `step`: `count` rows drawn (with replacement) from `rows` by
    their own seeded generator, a function of (seed, step, round) only, so a resumed run draws the
    same ones and the run's prompt stream (each step's first round) is the one it has without
    dynamic sampling."""
    return random.Random(f"dynamic sampling {seed} {step} {round_}").choices(rows, k=count)


def sample_informative_groups(prompts: list, roll_out: Callable[[list, int], Episodes],
                              draw: Callable[[int], list], max_extra_rounds: int,
                              pad_id: int) -> tuple[Episodes, dict]:
    """DAPO's dynamic sampling: roll out the prompts (roll_out(prompts, round) gives episodes
    whose group_ids tell each prompt's group, of any size), keep the groups whose rewards differ,
    and roll out draw(round) for more until len(prompts) groups are kept or max_extra_rounds
    extra rounds have run. Kept groups beyond len(prompts) are dropped; if the cap is reached
    first, the batch is filled with dropped groups (first dropped first), so the batch keeps its
    number of groups. Every group stays whole and one group in the batch. Metrics, in groups:
    train/dynamic_sampling_rounds (rounds run), train/dynamic_sampling_dropped_groups (groups of
    equal rewards or of one sample, all rounds), train/dynamic_sampling_filled_groups."""
    wanted, kept, dropped, rollouts = len(prompts), [], [], []
    for round_ in range(max_extra_rounds + 1):
        episodes = roll_out(prompts if round_ == 0 else draw(round_), round_)
        rollouts.append(episodes)
        index = group_index(episodes.group_ids, episodes.rewards.numel())
        for group, informative in enumerate(informative_groups(episodes.rewards, index).tolist()):
            rows = episodes.select((index == group).nonzero().squeeze(1).tolist())
            (kept if informative else dropped).append(rows)
        if len(kept) >= wanted:
            break
    filled = max(wanted - len(kept), 0)
    batch = concat_episodes((kept + dropped[:filled])[:wanted], pad_id, rollouts)
    return batch, {"train/dynamic_sampling_rounds": len(rollouts), "train/dynamic_sampling_dropped_groups": len(dropped),
                   "train/dynamic_sampling_filled_groups": filled}
