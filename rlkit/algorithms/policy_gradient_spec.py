"""What the RL family's algorithm modules (grpo, rloo, reinforce_pp, ppo) are made of, without
torch: the config keys they share, the checks of those, the adapter that makes an estimator
from a per-sample advantage function, and the spec of the group-relative ones (grpo, rloo). Loading a config imports these; the controller that runs
a step is rlkit/algorithms/policy_gradient.py, which re-exports them."""

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Protocol

from omegaconf import MISSING

from rlkit.algorithms.registry import POLICY_LOSSES, AlgorithmConfig, AlgorithmSpec, Lazy, own_policy_loss
from rlkit.algorithms.warm_start import validate_episode_warm_start
from rlkit.config.choices import IMPORTANCE_RATIOS, KL_ESTIMATORS, LOSS_AGGREGATIONS, OFF_POLICY_CORRECTIONS
from rlkit.config.schema import ConfigError, EpisodeWarmStartConfig, RootConfig, check_choice, check_positive

if TYPE_CHECKING:
    import torch


@dataclass
class PolicyGradientConfig(AlgorithmConfig):
    """What every RL algorithm shares: rollouts, advantages, the policy loss (clipped by default)."""

    prompts_per_step: int = MISSING
    group_size: int = MISSING
    policy_loss: str = MISSING
    clip_low: float = MISSING
    clip_high: float = MISSING
    dual_clip_c: Optional[float] = MISSING
    importance_ratio: str = MISSING
    kl_coef: float = MISSING
    kl_estimator: Optional[str] = MISSING
    entropy_coef: float = MISSING
    loss_aggregation: str = MISSING
    off_policy_correction: str = MISSING
    tis_cap: float = MISSING
    seq_mask_low: float = MISSING
    seq_mask_high: float = MISSING
    dynamic_sampling: bool = MISSING
    dynamic_sampling_max_rounds: int = MISSING
    overlong_filtering: bool = MISSING
    overlong_buffer: int = MISSING
    overlong_penalty_factor: float = MISSING
    max_staleness: int = MISSING
    val_greedy: bool = MISSING
    warm_start: EpisodeWarmStartConfig = field(default_factory=EpisodeWarmStartConfig)


def validate(cfg: RootConfig, dp: int, min_group_size: int = 1) -> None:
    """The family's checks; min_group_size 2 for estimators that compare a prompt's samples."""
    p, g, a = cfg.policy, cfg.generation, cfg.algorithm
    # first: the checks below compute with these (the response budget from max_new_tokens)
    check_positive(("generation.num_workers", g.num_workers), ("algorithm.prompts_per_step", a.prompts_per_step),
                   ("generation.max_new_tokens", g.max_new_tokens))
    check_choice("algorithm.loss_aggregation", a.loss_aggregation, LOSS_AGGREGATIONS)
    check_choice("algorithm.importance_ratio", a.importance_ratio, IMPORTANCE_RATIOS)
    check_choice("algorithm.kl_estimator", a.kl_estimator, (None, *KL_ESTIMATORS))
    check_choice("algorithm.off_policy_correction", a.off_policy_correction, OFF_POLICY_CORRECTIONS)
    if a.policy_loss not in POLICY_LOSSES:
        own_policy_loss(a.policy_loss)
    if a.dual_clip_c is not None and a.dual_clip_c <= 1:
        raise ConfigError(f"algorithm.dual_clip_c: must be > 1, a bound above the clipped ratios (Ye et al. 2019) "
                          f"(got: {a.dual_clip_c}); e.g. 3.0, or null to turn dual-clip off")
    # a weight of 1 (the rollout's own policy) must pass both corrections unchanged
    if a.tis_cap < 1:
        raise ConfigError(f"algorithm.tis_cap: must be >= 1, or on-policy tokens would be down-weighted "
                          f"(got: {a.tis_cap}); e.g. 2.0")
    if not 0 < a.seq_mask_low <= 1 <= a.seq_mask_high:
        raise ConfigError(f"algorithm.seq_mask_low / seq_mask_high: need 0 < seq_mask_low <= 1 <= seq_mask_high, so "
                          f"on-policy sequences are kept (got: {a.seq_mask_low}, {a.seq_mask_high}); e.g. 0.999, 1.002")
    if a.dynamic_sampling and (a.group_size < 2 or a.dynamic_sampling_max_rounds < 0):
        raise ConfigError(f"algorithm.dynamic_sampling: needs group_size >= 2 (a single sample's group is never "
                          f"informative) and dynamic_sampling_max_rounds >= 0 (got: {a.group_size}, "
                          f"{a.dynamic_sampling_max_rounds}); e.g. group_size=8, dynamic_sampling_max_rounds=3")
    if not 0 <= a.overlong_buffer <= max_response_tokens(cfg) or a.overlong_penalty_factor < 0:
        raise ConfigError(f"algorithm.overlong_buffer / overlong_penalty_factor: need 0 <= overlong_buffer <= the "
                          f"response budget {max_response_tokens(cfg)} and a factor >= 0 (got: {a.overlong_buffer}, "
                          f"{a.overlong_penalty_factor}); e.g. a quarter of generation.max_new_tokens and 1.0, or 0 "
                          f"to turn the penalty off")
    validate_episode_warm_start(cfg, dp)
    if a.max_staleness < 0 or (a.max_staleness > 0 and cfg.cluster.placement != "disaggregated"):
        raise ConfigError(f"algorithm.max_staleness: must be >= 0, and > 0 only with cluster.placement=disaggregated "
                          f"(colocated generation and training take turns on the same devices) (got: "
                          f"{a.max_staleness} with {cfg.cluster.placement}); use 0, or cluster.placement=disaggregated")
    # the trainer's logprobs are log_softmax(logits / T) over the full vocabulary: the sampler must
    # draw from that same distribution, or every ratio in the loss is off-policy
    if g.temperature <= 0 or g.top_p != 1.0 or g.top_k != 0:
        raise ConfigError(f"generation.temperature / top_p / top_k: RL samples must come from the distribution the "
                          f"trainer scores (got: {g.temperature}, {g.top_p}, {g.top_k}); use temperature > 0, "
                          f"top_p=1.0, top_k=0 (greedy validation: algorithm.val_greedy=true)")
    if a.entropy_coef < 0:
        raise ConfigError(f"algorithm.entropy_coef: must be >= 0, a bonus for entropy (got: {a.entropy_coef}); "
                          f"e.g. 0.001, or 0.0 to turn the bonus off")
    if a.kl_coef < 0 or not 0 < a.clip_low < 1 or a.clip_high <= 0:
        raise ConfigError(f"algorithm.kl_coef / clip_low / clip_high: need kl_coef >= 0, 0 < clip_low < 1, "
                          f"clip_high > 0 (got: {a.kl_coef}, {a.clip_low}, {a.clip_high}); e.g. 0.0, 0.2, 0.28")
    if a.group_size < min_group_size:
        raise ConfigError(f"algorithm.group_size: {a.name.upper()} needs at least 2 samples per prompt to compare "
                          f"(got: {a.group_size}); set it to 2 or more" if min_group_size > 1 else
                          f"algorithm.group_size: must be >= 1 (got: {a.group_size}); set a positive value")
    rollout = a.prompts_per_step * a.group_size
    if rollout % p.train_global_batch_size:
        raise ConfigError(f"policy.train_global_batch_size: must divide the rollout size algorithm.prompts_per_step "
                          f"x algorithm.group_size = {rollout} (got: {p.train_global_batch_size}); pick a divisor "
                          f"of {rollout}")


def kl_estimator(a, in_loss: bool) -> str:
    """algorithm.kl_estimator; null picks the usual one for where the KL goes: k3 as a loss term,
    k1 as a reward penalty (its sum over a response is the response's log-ratio)."""
    return a.kl_estimator or ("k3" if in_loss else "k1")


def max_response_tokens(cfg: RootConfig) -> int:
    """The most response tokens one sample can have: seq-mean-token-sum-norm's constant
    normaliser. Each turn generates at most generation.max_new_tokens, an episode at most
    env_runner.max_total_tokens."""
    return min(cfg.generation.max_new_tokens * cfg.env_runner.max_turns, cfg.env_runner.max_total_tokens)


class EstimatingTrainer(Protocol):
    """What an estimator reads of the trainer (policy_gradient.PolicyGradientTrainer is one)."""
    cfg: RootConfig
    policy: object  # ModelWorkers: extend_held


def per_sample(advantages):
    """An estimator from a pure function (algorithm config, rewards [B], group ids [B]) ->
    advantages [B], computed on the controller (rewards are there) and sent to the held shards.
    Samples with one group id are one prompt's (Episodes.group_ids): groups may differ in size."""
    def estimate(trainer: EstimatingTrainer, rewards: "torch.Tensor", group_ids: "torch.Tensor") -> dict:
        from rlkit.data.batch import Batch  # torch: when a run estimates, not when its config loads

        trainer.policy.extend_held(Batch({"advantages": advantages(trainer.cfg.algorithm, rewards, group_ids)}))
        return {}
    return estimate


def group_relative_spec(name: str, config: type, sample_advantages) -> AlgorithmSpec:
    """The spec of an algorithm whose advantages compare the samples of a prompt (GRPO, RLOO):
    sample_advantages as for per_sample, at least 2 samples a prompt, the KL a k3 loss term."""
    return AlgorithmSpec(
        name=name, config=config, data="prompts", load_data=Lazy("rlkit.algorithms.policy_gradient:load_prompts"),
        trainer=Lazy("rlkit.algorithms.policy_gradient:PolicyGradientTrainer"), rollouts=True,
        warm_start=Lazy("rlkit.algorithms.policy_gradient:warm_start_on_answers"),
        uses_reference=lambda a: a.kl_coef > 0,
        validate=lambda cfg, dp: validate(cfg, dp, min_group_size=2),
        estimator=per_sample(sample_advantages),
        kl_in_loss=lambda a: True)
