"""Learning-rate schedules: a pure function of the optimizer step, so a resumed run sets exactly
the rates an uninterrupted one would (the step is in the checkpoint, the schedule in its config)."""

import math
from dataclasses import dataclass

from rlkit.config.schema import ConfigError, OptimizerConfig, check_choice

SCHEDULES = ("constant", "linear", "cosine")


def check_learning_rate(key: str, lr: float, example: str) -> None:
    """The check every learning-rate key gets: a negative rate trains away from the objective, and
    nan or inf makes every weight nan at the first step."""
    if not 0 < lr < math.inf:
        raise ConfigError(f"{key}: must be a finite number > 0 (got: {lr}); e.g. {example}")


def check_schedule(o: OptimizerConfig) -> None:
    """policy.optimizer's rate and its schedule."""
    check_choice("policy.optimizer.lr_schedule", o.lr_schedule, SCHEDULES)
    check_learning_rate("policy.optimizer.lr", o.lr, "1e-6")
    if o.warmup_steps < 0:
        raise ConfigError(f"policy.optimizer.warmup_steps: must be >= 0 (got: {o.warmup_steps}); 0 for no warmup")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"policy.optimizer.min_lr_ratio: must lie in [0, 1] (got: {o.min_lr_ratio}); e.g. 0.1")


@dataclass(frozen=True)
class LearningRateSchedule:
    """lr at optimizer step s (0-based) of total_steps: linear warmup over the first warmup_steps
    (step s trains at lr * (s + 1) / warmup_steps), then constant, or a linear or cosine decay that
    reaches lr * min_ratio at the last step."""

    lr: float
    total_steps: int
    kind: str = "constant"
    warmup_steps: int = 0
    min_ratio: float = 0.0

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        decay_steps = self.total_steps - self.warmup_steps - 1
        progress = min((step - self.warmup_steps) / decay_steps, 1.0) if decay_steps > 0 else 1.0
        shape = 1.0 - progress if self.kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_ratio + (1.0 - self.min_ratio) * shape)


def schedule_of(optimizer, total_steps: int, lr: float | None = None) -> LearningRateSchedule:
    """The schedule a config's optimizer section (policy.optimizer) asks for over total_steps
    optimizer steps; lr overrides its peak (PPO's critic: algorithm.critic.lr)."""
    return LearningRateSchedule(optimizer.lr if lr is None else lr, total_steps, optimizer.lr_schedule,
                                optimizer.warmup_steps, optimizer.min_lr_ratio)
