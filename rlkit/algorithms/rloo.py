"""RLOO (Ahmadian et al. 2024): each sample's reward minus the mean of the other samples of its
prompt; the KL to the reference is a k3 term in the loss."""

from dataclasses import dataclass

from rlkit.algorithms import policy_gradient
from rlkit.algorithms.advantages import rloo_advantages
from rlkit.algorithms.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer, per_sample
from rlkit.algorithms.registry import AlgorithmSpec


@dataclass
class RLOOConfig(PolicyGradientConfig):
    pass


ALGORITHM = AlgorithmSpec(
    name="rloo", config=RLOOConfig, data="prompts", load_data=policy_gradient.load_prompts,
    trainer=PolicyGradientTrainer, rollouts=True, warm_start=policy_gradient.warm_start_on_answers,
    uses_reference=lambda a: a.kl_coef > 0,
    validate=lambda cfg, dp: policy_gradient.validate(cfg, dp, min_group_size=2),
    estimator=per_sample(lambda a, rewards, group_ids: rloo_advantages(rewards, group_ids)),
    kl_in_loss=lambda a: True)
