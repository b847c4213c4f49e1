"""Algorithms as registered units. An algorithm is one module that defines

    ALGORITHM = AlgorithmSpec(...)

and one YAML in an `algorithm/` config group (configs/algorithm/<name>.yaml, or a group folder
next to your own recipes) whose `name` is the module: a built-in short name (grpo, rloo,
reinforce_pp, ppo, sft, dpo) or an importable module path (`my_package.my_algorithm`). The
launch path (rlkit/launch/run.py) reads the spec: which config keys the algorithm has and how to
check them, which data and workers it needs, and how to build its trainer.

Loading a config imports the module (its config keys and checks), so the built-ins keep torch,
Ray and Megatron out of it: they name their trainer, data loading and estimators with Lazy, or
import those inside the functions that run them. rlkit's help texts and config errors then
answer in well under a second (benchmarks/cli_latency.py, tests/unit/test_cli_startup.py).
"""

import importlib
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import MISSING

from rlkit.config.schema import ConfigError, RootConfig

BUILTIN = ("grpo", "rloo", "reinforce_pp", "ppo", "sft", "dpo")


@dataclass
class AlgorithmConfig:
    """The keys every algorithm has (the loop reads them); an algorithm's config extends it."""

    name: str = MISSING
    num_steps: int = MISSING
    val_every: int = MISSING
    val_before_training: bool = MISSING


def no_checks(cfg: RootConfig, dp: int) -> None:
    pass


@dataclass(frozen=True)
class Lazy:
    """A spec's callable named as "module:attribute" (e.g. "rlkit.algorithms.policy_gradient:
    PolicyGradientTrainer"), imported at its first call, when the run starts, not when the
    config loads."""

    target: str

    def __call__(self, *args, **kwargs):
        module, _, attribute = self.target.partition(":")
        return getattr(importlib.import_module(module), attribute)(*args, **kwargs)


@dataclass(frozen=True)
class AlgorithmSpec:
    name: str
    config: type  # dataclass of the algorithm.* keys (defaults live in its YAML)
    data: str  # the data group it reads (data.name): "prompts", "sft_files", "preference_files"
    load_data: Callable  # (cfg, tokenizer) -> TrainingData (rlkit/algorithms/loop.py)
    trainer: Callable  # (RunContext) -> Trainer (rlkit/algorithms/loop.py)
    validate: Callable[[RootConfig, int], None] = no_checks  # its own cross-key checks, given the DP size
    rollouts: bool = False  # needs generation workers, refit and environments
    critic: bool = False  # a second Megatron model beside the policy (PPO)
    # a short supervised run before training, cached: (cfg, policy, tokenizer, data, out_dir) -> None
    warm_start: Callable | None = None
    # (algorithm config) -> whether it trains against a frozen reference: the weights it started from
    uses_reference: Callable[[Any], bool] = lambda a: False
    # RL: (trainer, rewards [B], group ids [B]) -> metrics; writes advantages into the policy's held rollout
    estimator: Callable | None = None
    # RL: (algorithm config) -> whether the KL to the reference is a loss term (else a reward penalty)
    kl_in_loss: Callable[[Any], bool] | None = None


def load_algorithm(name: str) -> AlgorithmSpec:
    """The spec of algorithm.name: rlkit.algorithms.<name> for built-ins, else the module `name`."""
    module_name = f"rlkit.algorithms.{name}" if name in BUILTIN else name
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        if e.name is not None and not module_name.startswith(e.name):
            raise  # the module exists but something it imports is missing: that error, not this one
        raise ConfigError(f"algorithm.name: must be one of {list(BUILTIN)} or an importable module that defines "
                          f"ALGORITHM (got: {name!r}); select the config group with algorithm=<name> ({e})") from None
    spec = getattr(module, "ALGORITHM", None)
    if not isinstance(spec, AlgorithmSpec):
        raise ConfigError(f"algorithm.name: module {module_name!r} defines no ALGORITHM = AlgorithmSpec(...); "
                          f"add one (see rlkit/algorithms/grpo.py)")
    return spec
