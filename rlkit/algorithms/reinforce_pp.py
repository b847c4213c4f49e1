"""REINFORCE++ (Hu 2025): a per-token KL penalty in the reward, return-to-go (discount gamma),
whitened over the whole batch (baseline=true first subtracts each prompt group's mean reward). The token-level part
runs on the policy workers, where the logprobs are."""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from omegaconf import MISSING

from rlkit.algorithms import policy_gradient_spec
from rlkit.algorithms.policy_gradient_spec import PolicyGradientConfig, kl_estimator
from rlkit.algorithms.registry import AlgorithmSpec, Lazy
from rlkit.config.schema import ConfigError

if TYPE_CHECKING:  # torch is imported where the estimator runs, not where the config loads
    import torch

    from rlkit.algorithms.policy_gradient import PolicyGradientTrainer
    from rlkit.data.batch import Batch


@dataclass
class ReinforcePPConfig(PolicyGradientConfig):
    baseline: bool = MISSING
    gamma: float = MISSING


@dataclass(frozen=True)
class KLPenalizedReturns:
    """On a held shard: rewards (already group-centred when asked) plus the per-token KL penalty,
    summed to go with discount gamma, whitened over every shard's tokens (reduce spans the
    data-parallel ranks)."""

    kl_coef: float
    kl_estimator: str
    gamma: float

    @property
    def fields(self) -> tuple[str, ...]:
        return ("response_mask",) + (("old_logprobs", "reference_logprobs") if self.kl_coef > 0 else ())

    def __call__(self, held: "Batch", rewards: "torch.Tensor", reduce) -> tuple[dict, dict]:
        from rlkit.algorithms.advantages import reinforce_pp_advantages
        from rlkit.algorithms.losses import kl_estimate

        kl = kl_estimate(held["old_logprobs"], held["reference_logprobs"], self.kl_estimator) if self.kl_coef > 0 \
            else None
        return {"advantages": reinforce_pp_advantages(rewards, held["response_mask"], kl, self.kl_coef,
                                                      reduce=reduce, gamma=self.gamma)}, {}


def estimate(trainer: "PolicyGradientTrainer", rewards: "torch.Tensor", group_ids: "torch.Tensor") -> dict:
    from rlkit.algorithms.advantages import group_centered

    a = trainer.cfg.algorithm
    scalar = group_centered(rewards, group_ids) if a.baseline else rewards  # groups may straddle shards
    trainer.policy.estimate_held(KLPenalizedReturns(a.kl_coef, kl_estimator(a, in_loss=False), a.gamma), scalar)
    return {}


def validate(cfg, dp: int) -> None:
    policy_gradient_spec.validate(cfg, dp, min_group_size=2 if cfg.algorithm.baseline else 1)
    if not 0 <= cfg.algorithm.gamma <= 1:
        raise ConfigError(f"algorithm.gamma: must lie in [0, 1] (got: {cfg.algorithm.gamma}); 1.0 is REINFORCE++ "
                          f"as published")


ALGORITHM = AlgorithmSpec(
    name="reinforce_pp", config=ReinforcePPConfig, data="prompts",
    load_data=Lazy("rlkit.algorithms.policy_gradient:load_prompts"),
    trainer=Lazy("rlkit.algorithms.policy_gradient:PolicyGradientTrainer"), rollouts=True,
    warm_start=Lazy("rlkit.algorithms.policy_gradient:warm_start_on_answers"),
    uses_reference=lambda a: a.kl_coef > 0,
    validate=validate,
    estimator=estimate, kl_in_loss=lambda a: False)
