"""PPO with a learned critic: the policy-gradient step with a different estimator. The critic's
values and the per-token rewards give GAE advantages (whitened over the batch) and returns; the
critic then regresses the returns with a clipped value loss, and the policy takes the clipped
surrogate step. The critic holds the same rollout shards as the policy; GAE runs on the critic's
workers, and the fields one side needs from the other (the policy's logprobs for a KL penalty in
the reward, the critic's advantages) move between them through the object store."""

from dataclasses import dataclass, field

from omegaconf import MISSING

from rlkit.algorithms import policy_gradient_spec
from rlkit.algorithms.lr_schedule import check_learning_rate
from rlkit.algorithms.policy_gradient_spec import PolicyGradientConfig
from rlkit.algorithms.registry import AlgorithmSpec, Lazy
from rlkit.config.schema import ConfigError


@dataclass
class CriticConfig:
    lr: float = MISSING
    value_clip: float = MISSING


@dataclass
class PPOConfig(PolicyGradientConfig):
    kl_mode: str = MISSING
    gamma: float = MISSING
    lam: float = MISSING
    critic: CriticConfig = field(default_factory=CriticConfig)


def validate(cfg, dp: int) -> None:
    a = cfg.algorithm
    policy_gradient_spec.validate(cfg, dp)
    if a.kl_mode not in ("reward", "loss"):
        raise ConfigError(f"algorithm.kl_mode: must be one of ['reward', 'loss'] (got: {a.kl_mode!r}); pick one of "
                          f"those")
    if not (0 <= a.gamma <= 1 and 0 <= a.lam <= 1):
        raise ConfigError(f"algorithm.gamma / algorithm.lam: must lie in [0, 1] (got: {a.gamma}, {a.lam}); "
                          f"the usual values are 1.0 and 0.95")
    check_learning_rate("algorithm.critic.lr", a.critic.lr, "the policy's learning rate")


ALGORITHM = AlgorithmSpec(
    name="ppo", config=PPOConfig, data="prompts", load_data=Lazy("rlkit.algorithms.policy_gradient:load_prompts"),
    trainer=Lazy("rlkit.algorithms.ppo_trainer:PPO"), rollouts=True, critic=True,
    warm_start=Lazy("rlkit.algorithms.policy_gradient:warm_start_on_answers"),
    uses_reference=lambda a: a.kl_coef > 0, validate=validate,
    estimator=Lazy("rlkit.algorithms.ppo_trainer:estimate"), kl_in_loss=lambda a: a.kl_mode == "loss")
