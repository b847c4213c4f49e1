"""Algorithms: pure losses and estimators, objectives, and one controller per family."""

from omegaconf import DictConfig

from rlkit.config.schema import RL_ALGORITHMS, RootConfig


def run(cfg: RootConfig, resolved: DictConfig):
    """Train with cfg.algorithm.name; returns the run's RunResult (metrics history, run folder)."""
    if cfg.algorithm.name in RL_ALGORITHMS:
        from rlkit.algorithms.policy_gradient import run_policy_gradient
        return run_policy_gradient(cfg, resolved)
    from rlkit.algorithms.supervised import run_supervised
    return run_supervised(cfg, resolved)
