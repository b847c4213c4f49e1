"""GRPO (Shao et al. 2024): advantage = reward minus the group mean, over the group std
(normalize_std=false: Dr.GRPO); the KL to the reference is a k3 term in the loss."""

from dataclasses import dataclass

from omegaconf import MISSING

from rlkit.algorithms.policy_gradient_spec import PolicyGradientConfig, group_relative_spec


@dataclass
class GRPOConfig(PolicyGradientConfig):
    normalize_std: bool = MISSING


def sample_advantages(a: GRPOConfig, rewards, group_ids):
    from rlkit.algorithms.advantages import grpo_advantages  # torch: when a run estimates

    return grpo_advantages(rewards, group_ids, a.normalize_std)


ALGORITHM = group_relative_spec("grpo", GRPOConfig, sample_advantages)
