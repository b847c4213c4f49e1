"""GRPO (Shao et al. 2024): advantage = reward minus the group mean, over the group std
(normalize_std=false: Dr.GRPO); the KL to the reference is a k3 term in the loss."""

from dataclasses import dataclass

from omegaconf import MISSING

from rlkit.algorithms import policy_gradient_spec
from rlkit.algorithms.policy_gradient_spec import PolicyGradientConfig, per_sample
from rlkit.algorithms.registry import AlgorithmSpec, Lazy


@dataclass
class GRPOConfig(PolicyGradientConfig):
    normalize_std: bool = MISSING


def sample_advantages(a: GRPOConfig, rewards, group_ids):
    from rlkit.algorithms.advantages import grpo_advantages  # torch: when a run estimates

    return grpo_advantages(rewards, group_ids, a.normalize_std)


ALGORITHM = AlgorithmSpec(
    name="grpo", config=GRPOConfig, data="prompts", load_data=Lazy("rlkit.algorithms.policy_gradient:load_prompts"),
    trainer=Lazy("rlkit.algorithms.policy_gradient:PolicyGradientTrainer"), rollouts=True,
    warm_start=Lazy("rlkit.algorithms.policy_gradient:warm_start_on_answers"),
    uses_reference=lambda a: a.kl_coef > 0,
    validate=lambda cfg, dp: policy_gradient_spec.validate(cfg, dp, min_group_size=2),
    estimator=per_sample(sample_advantages),
    kl_in_loss=lambda a: True)
