from rlkit.envs.base import EnvStep, Environment

__all__ = ["EnvStep", "Environment"]
