"""PPO's trainer (the algorithm, its config and checks: rlkit/algorithms/ppo.py): GAE on the
critic's workers as the estimator, and a critic step before each policy step."""

from dataclasses import dataclass

import torch

from rlkit.algorithms import policy_gradient
from rlkit.algorithms.advantages import explained_variance, gae_advantages, token_rewards, whiten
from rlkit.algorithms.losses import kl_estimate
from rlkit.algorithms.lr_schedule import schedule_of
from rlkit.algorithms.objectives import ValueRegression
from rlkit.algorithms.policy_gradient import PolicyGradientTrainer, kl_estimator, train_minibatches
from rlkit.cluster.setup import start_critic
from rlkit.data.batch import Batch, BatchTotals
from rlkit.observability.throughput import training_flops


@dataclass(frozen=True)
class GAE:
    """On a critic's held shard (values in old_values): whitened GAE advantages and returns, and
    the explained variance's sums. kl_coef > 0 puts the policy's KL penalty (kl_estimator) into
    the rewards."""

    gamma: float
    lam: float
    kl_coef: float
    kl_estimator: str

    @property
    def fields(self) -> tuple[str, ...]:
        return ("response_mask", "old_values") + (("old_logprobs", "reference_logprobs") if self.kl_coef > 0 else ())

    def __call__(self, held: Batch, rewards: torch.Tensor, reduce) -> tuple[dict, dict]:
        mask, values = held["response_mask"], held["old_values"]
        kl_penalty = self.kl_coef * kl_estimate(held["old_logprobs"], held["reference_logprobs"], self.kl_estimator) \
            if self.kl_coef > 0 else None
        advantages, returns = gae_advantages(token_rewards(rewards, mask, kl_penalty), values, mask, self.gamma,
                                             self.lam)
        metrics = {"critic/explained_variance": explained_variance(values, returns, mask, reduce)}
        return {"advantages": whiten(advantages, mask, reduce=reduce), "returns": returns}, metrics


def estimate(trainer: "PPO", rewards: torch.Tensor, group_ids: torch.Tensor) -> dict:
    """The critic is the baseline: PPO reads no groups."""
    a = trainer.cfg.algorithm
    kl_coef = a.kl_coef if a.kl_mode == "reward" else 0.0
    trainer.critic.forward_held("old_values")
    if kl_coef > 0:
        trainer.critic.extend_held(trainer.policy.export_held("old_logprobs", "reference_logprobs"))
    sums = trainer.critic.estimate_held(GAE(a.gamma, a.lam, kl_coef, kl_estimator(a, in_loss=False)), rewards)
    trainer.policy.extend_held(trainer.critic.export_held("advantages"))
    return sums[0]  # every shard computed the whole batch's explained variance


class PPO(PolicyGradientTrainer):
    def start_critic(self, ctx):
        """Initialised from the checkpoint the policy starts from (after any warm start)."""
        critic, a = start_critic(ctx.cfg, ctx.workers, str(ctx.start_dir)), ctx.cfg.algorithm
        self.value_objective = ValueRegression(a.critic.value_clip, a.loss_aggregation,
                                               policy_gradient.max_response_tokens(ctx.cfg))
        self.critic_lr = schedule_of(ctx.cfg.policy.optimizer, a.num_steps * self.minibatches, lr=a.critic.lr)
        return critic

    def hold(self, rollout: Batch) -> None:
        self.critic.hold(self.policy.hold(rollout))  # the same shards: stored once

    def train(self, totals: list[BatchTotals], first_optimizer_step: int) -> dict:
        """The critic's step, then the policy's (timed together as timing/train)."""
        return {**self.train_critic(totals, first_optimizer_step), **super().train(totals, first_optimizer_step)}

    def train_flops(self, lengths: list[int]) -> float:
        """The critic trains on the same rows: the policy's trunk, no LM head (its value head is
        hidden x 1, negligible)."""
        return super().train_flops(lengths) + training_flops(self.shape, lengths, lm_head=False)

    def train_critic(self, totals: list[BatchTotals], first_optimizer_step: int) -> dict:
        """One critic optimizer step per mini-batch, like the policy's."""
        sums = train_minibatches(self.critic, totals, self.value_objective, self.critic_lr, first_optimizer_step)
        tokens = max(sum(t.num_tokens for t in totals), 1.0)
        out = {"critic/value_loss": sums["loss"] / len(totals), "critic/grad_norm": sums["grad_norm"] / len(totals),
               "critic/lr": sums["lr"],
               "critic/value_error": sums["value_error"] / tokens}
        if "value_clipped_tokens" in sums:
            out["critic/clip_fraction"] = sums["value_clipped_tokens"] / tokens
        return out

    # the critic is always saved as a Megatron dist checkpoint: its value head has no HF name
    def save(self, checkpoint_dir: str) -> dict[str, float]:
        policy, critic = super().save(checkpoint_dir), self.critic.save_checkpoint(checkpoint_dir, "dist")
        return {part: policy.get(part, 0.0) + critic.get(part, 0.0) for part in {**policy, **critic}}

    def saved(self, wait: bool) -> dict[str, str] | None:
        policy, critic = super().saved(wait), self.critic.finish_checkpoint(wait)  # both asked, every time
        return None if policy is None or critic is None else {**policy, **critic}

    def load(self, checkpoint_dir: str, step: int):
        super().load(checkpoint_dir, step)
        self.critic.load_checkpoint(checkpoint_dir, "dist")
