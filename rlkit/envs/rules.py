"""The config's rules for the environment (env.*) and the loop that runs it (env_runner.*): one
ConfigError line each, as the config loads. `rlkit env check` (check.py) checks an environment's
target and keywords as env.* gets checked here (check_environment_config)."""

from typing import Any

from rlkit.config.choices import FLOWS
from rlkit.config.schema import ConfigError, EnvRunnerConfig, check_choice, check_positive
from rlkit.envs.base import check_environment_config
from rlkit.envs.reward_models.server import shared_gpus


def check_env_runner(r: EnvRunnerConfig) -> None:
    check_positive(("env_runner.num_workers", r.num_workers), ("env_runner.max_turns", r.max_turns),
                   ("env_runner.max_total_tokens", r.max_total_tokens))
    check_choice("env_runner.flow", r.flow, FLOWS)
    if r.max_tool_seconds < 0:
        raise ConfigError(f"env_runner.max_tool_seconds: must be >= 0 (got: {r.max_tool_seconds}); give seconds, "
                          f"or 0 for no limit")
    if r.timeout_s <= 0:
        raise ConfigError(f"env_runner.timeout_s: must be > 0 (got: {r.timeout_s}); set a positive number of seconds")
    if "{observation}" not in r.observation_format:
        raise ConfigError(f"env_runner.observation_format: must contain {{observation}} (got: {r.observation_format!r})")


def check_environment(env: dict[str, Any]) -> None:
    """env._target_ imports, takes the section's other keys and can run on this machine."""
    if "_target_" not in env:
        raise ConfigError("env._target_: no environment set; give an importable Environment class or scoring "
                          "function, e.g. env._target_=rlkit.envs.arithmetic.ArithmeticEnv")
    problem = check_environment_config(env["_target_"], {k: v for k, v in env.items() if k != "_target_"})
    if problem:
        raise ConfigError(problem)
    if shared_gpus(env) >= 1:  # the run's placement leaves this share of each GPU free: it must leave some
        raise ConfigError(f"env.num_gpus: the model servers' shares below one GPU add up to {shared_gpus(env):g} of "
                          f"each GPU (summed over env.parts); keep the sum below 1, or give a server whole GPUs of its own")
