"""RLOO (Ahmadian et al. 2024): each sample's reward minus the mean of the other samples of its
prompt; the KL to the reference is a k3 term in the loss."""

from dataclasses import dataclass

from rlkit.algorithms.policy_gradient_spec import PolicyGradientConfig, group_relative_spec


@dataclass
class RLOOConfig(PolicyGradientConfig):
    pass


def sample_advantages(a: RLOOConfig, rewards, group_ids):
    from rlkit.algorithms.advantages import rloo_advantages  # torch: when a run estimates

    return rloo_advantages(rewards, group_ids)


ALGORITHM = group_relative_spec("rloo", RLOOConfig, sample_advantages)
