"""PPO with a learned critic: the policy-gradient step with a different estimator. The critic's
values and the per-token rewards give GAE advantages (whitened over the batch) and returns; the
critic then regresses the returns with a clipped value loss, and the policy takes the clipped
surrogate step."""

from pathlib import Path

import torch

from rlkit.algorithms.advantages import explained_variance, gae_advantages, token_rewards, whiten
from rlkit.algorithms.policy_gradient import PolicyGradientTrainer
from rlkit.algorithms.losses import batch_totals
from rlkit.algorithms.objectives import ValueRegression
from rlkit.cluster.setup import start_critic
from rlkit.data.batch import Batch


class PPO(PolicyGradientTrainer):
    def __init__(self, cfg, workers, tokenizer, envs, reference_dir: Path | None = None, val_rows=None):
        super().__init__(cfg, workers, tokenizer, envs, reference_dir, val_rows)
        # initialised from the checkpoint the policy starts from (after any warm start)
        self.critic = start_critic(cfg, workers, str(reference_dir))
        if cfg.cluster.placement == "colocated":
            self.sleepers.append(self.critic)
        self.value_objective = ValueRegression(cfg.algorithm.critic.value_clip, cfg.algorithm.loss_aggregation)

    def advantages(self, rollout: Batch, rewards: torch.Tensor) -> tuple[Batch, dict]:
        a, mask = self.cfg.algorithm, rollout["response_mask"]
        values = self.critic.values(rollout)
        kl_penalty = a.kl_coef * (rollout["old_logprobs"] - rollout["reference_logprobs"]) \
            if a.kl_coef > 0 and a.kl_mode == "reward" else None
        advantages, returns = gae_advantages(token_rewards(rewards, mask, kl_penalty), values, mask, a.gamma, a.lam)
        rollout = rollout.with_fields(advantages=whiten(advantages, mask), returns=returns, old_values=values)
        return rollout, {}

    def train(self, rollout: Batch) -> dict:
        """The critic's step, then the policy's (timed together as timing/train)."""
        return {**self.train_critic(rollout), **super().train(rollout)}

    def train_critic(self, rollout: Batch) -> dict:
        """One critic optimizer step per mini-batch, like the policy's."""
        mask = rollout["response_mask"]
        minibatches = rollout.select("input_ids", "response_mask", "returns", "old_values").split(
            len(rollout) // self.cfg.policy.train_global_batch_size)
        sums = {}
        for minibatch in minibatches:
            for k, v in self.critic.train(minibatch, batch_totals(minibatch["response_mask"]),
                                          self.value_objective).items():
                sums[k] = sums.get(k, 0.0) + v
        tokens = max(mask.sum().item(), 1.0)
        out = {"critic/value_loss": sums["loss"] / len(minibatches), "critic/grad_norm": sums["grad_norm"] / len(minibatches),
               "critic/value_error": sums["value_error"] / tokens,
               "critic/explained_variance": explained_variance(rollout["old_values"], rollout["returns"], mask)}
        if "value_clipped_tokens" in sums:
            out["critic/clip_fraction"] = sums["value_clipped_tokens"] / tokens
        return out

    # the critic is always saved as a Megatron dist checkpoint: its value head has no HF name
    def save(self, checkpoint_dir: str):
        super().save(checkpoint_dir)
        self.critic.call("save_checkpoint", checkpoint_dir, "dist")

    def load(self, checkpoint_dir: str):
        super().load(checkpoint_dir)
        self.critic.call("load_checkpoint", checkpoint_dir, "dist")
