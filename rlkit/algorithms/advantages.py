"""Advantage estimators: pure functions of rewards. Registry at the bottom."""

import torch


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages (GRPO, Shao et al. 2024, arXiv:2402.03300).

    rewards: [num_prompts * group_size], the samples of one prompt adjacent.
    A_i = (r_i - mean(group)) / (std(group) + eps). With normalize_std=False this is
    Dr.GRPO (Liu et al. 2025, arXiv:2503.20783), which drops the std division because it
    over-weights prompts whose rewards barely vary. std is the unbiased sample std.
    Groups with equal rewards get advantage 0. Returns [num_prompts * group_size].
    """
    if group_size < 2 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not form groups of {group_size} (need group_size >= 2)")
    grouped = rewards.float().view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    # float rounding of the mean would otherwise give equal-reward groups a tiny shared advantage
    all_equal = (grouped == grouped[:, :1]).all(dim=1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(centered), centered).view(-1)


ADVANTAGE_ESTIMATORS = {"grpo": grpo_advantages}
