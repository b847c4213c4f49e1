"""RLOO (Ahmadian et al. 2024): each sample's reward minus the mean of the other samples of its
prompt; the KL to the reference is a k3 term in the loss."""

from dataclasses import dataclass

from rlkit.algorithms import policy_gradient_spec
from rlkit.algorithms.policy_gradient_spec import PolicyGradientConfig, per_sample
from rlkit.algorithms.registry import AlgorithmSpec, Lazy


@dataclass
class RLOOConfig(PolicyGradientConfig):
    pass


def sample_advantages(a: RLOOConfig, rewards, group_ids):
    from rlkit.algorithms.advantages import rloo_advantages  # torch: when a run estimates

    return rloo_advantages(rewards, group_ids)


ALGORITHM = AlgorithmSpec(
    name="rloo", config=RLOOConfig, data="prompts", load_data=Lazy("rlkit.algorithms.policy_gradient:load_prompts"),
    trainer=Lazy("rlkit.algorithms.policy_gradient:PolicyGradientTrainer"), rollouts=True,
    warm_start=Lazy("rlkit.algorithms.policy_gradient:warm_start_on_answers"),
    uses_reference=lambda a: a.kl_coef > 0,
    validate=lambda cfg, dp: policy_gradient_spec.validate(cfg, dp, min_group_size=2),
    estimator=per_sample(sample_advantages),
    kl_in_loss=lambda a: True)
