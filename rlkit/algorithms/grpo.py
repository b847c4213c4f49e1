"""GRPO (Shao et al. 2024): advantage = reward minus the group mean, over the group std
(normalize_std=false: Dr.GRPO); the KL to the reference is a k3 term in the loss."""

from dataclasses import dataclass

from omegaconf import MISSING

from rlkit.algorithms import policy_gradient
from rlkit.algorithms.advantages import grpo_advantages
from rlkit.algorithms.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer, per_sample
from rlkit.algorithms.registry import AlgorithmSpec


@dataclass
class GRPOConfig(PolicyGradientConfig):
    normalize_std: bool = MISSING


ALGORITHM = AlgorithmSpec(
    name="grpo", config=GRPOConfig, data="prompts", load_data=policy_gradient.load_prompts,
    trainer=PolicyGradientTrainer, rollouts=True, warm_start=policy_gradient.warm_start_on_answers,
    uses_reference=lambda a: a.kl_coef > 0,
    validate=lambda cfg, dp: policy_gradient.validate(cfg, dp, min_group_size=2),
    estimator=per_sample(lambda a, rewards, group_ids: grpo_advantages(rewards, group_ids, a.normalize_std)),
    kl_in_loss=lambda a: True)
