"""Algorithms as registered units. An algorithm is one module that defines

    ALGORITHM = AlgorithmSpec(...)

and one YAML in an `algorithm/` config group (configs/algorithm/<name>.yaml, or a group folder
next to your own recipes) whose `name` is the module: a built-in short name (grpo, rloo,
reinforce_pp, ppo, sft, dpo, reward_model) or an importable module path (`my_package.my_algorithm`). The
launch path (rlkit/launch/run.py) reads the spec: which config keys the algorithm has and how to
check them, which data and workers it needs, and how to build its trainer.

Loading a config imports the module (its config keys and checks), so the built-ins keep torch,
Ray and Megatron out of it: they name their trainer, data loading and estimators with Lazy, or
import those inside the functions that run them. rlkit's help texts and config errors then
answer in well under a second (benchmarks/cli_latency.py, tests/unit/test_cli_startup.py).

The RL family's policy loss is chosen the same way: algorithm.policy_loss names a built-in
(POLICY_LOSSES) or a function of one's own as "module:attribute" (own_policy_loss).
"""

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from omegaconf import MISSING

from rlkit.config.named import Lazy, NoSuchModule, import_named, named_attribute
from rlkit.config.schema import ConfigError, RootConfig

BUILTIN = ("grpo", "rloo", "reinforce_pp", "ppo", "sft", "dpo", "reward_model")


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
class AlgorithmSpec:
    name: str
    config: type  # dataclass of the algorithm.* keys (defaults live in its YAML)
    data: str  # the data group it reads (data.name): "prompts", "sft_files", "preference_files"
    load_data: Callable  # (cfg, tokenizer) -> TrainingData (rlkit/algorithms/loop.py)
    trainer: Callable  # (RunContext) -> Trainer (rlkit/algorithms/loop.py)
    validate: Callable[[RootConfig, int], None] = no_checks  # its own cross-key checks, given the DP size
    rollouts: bool = False  # needs generation workers, refit and environments
    critic: bool = False  # a second Megatron model beside the policy (PPO)
    # what the trained model (policy.*) outputs: "lm" token logprobs, or "reward" one scalar per position
    # (rlkit/workers/policy/megatron.py)
    head: str = "lm"
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
        module = import_named(module_name)
    except NoSuchModule as e:
        raise ConfigError(f"algorithm.name: must be one of {list(BUILTIN)} or an importable module that defines "
                          f"ALGORITHM (got: {name!r}); select the config group with algorithm=<name> ({e})") from None
    spec = getattr(module, "ALGORITHM", None)
    if not isinstance(spec, AlgorithmSpec):
        raise ConfigError(f"algorithm.name: module {module_name!r} defines no ALGORITHM = AlgorithmSpec(...); "
                          f"add one (see rlkit/algorithms/grpo.py)")
    return spec


# algorithm.policy_loss's built-ins, by short name; any other value names a function of one's own as
# "module:attribute" that takes POLICY_LOSS_ARGUMENTS (clipped_policy_loss's parameters)
POLICY_LOSSES = {"clipped": Lazy("rlkit.algorithms.losses:clipped_policy_loss")}
# what a policy loss is called with: these by position, then the optional tensors (None where the
# algorithm's config does not use them) by keyword (rlkit/algorithms/objectives.py PolicyGradient)
POLICY_LOSS_ARGUMENTS = ("logprobs", "old_logprobs", "advantages", "mask", "cfg", "totals")
POLICY_LOSS_OPTIONAL = ("reference_logprobs", "off_policy_weights", "entropy")


def load_policy_loss(name: str) -> Callable:
    """The function algorithm.policy_loss names, where the loss runs (a built-in's module imports torch)."""
    return POLICY_LOSSES[name].resolve() if name in POLICY_LOSSES else own_policy_loss(name)


def own_policy_loss(name: str) -> Callable:
    """A function of one's own that algorithm.policy_loss names as "module:attribute", imported from
    where algorithm modules are; a config error line where the name does not import, or where the
    function cannot take a policy loss's arguments. The config's checks call it: before any worker."""
    wrong = (f"algorithm.policy_loss: must be one of {list(POLICY_LOSSES)} or a function of your own as "
             f"'module:attribute' (got: {name!r}); pick one of those (docs/algorithms.md: A loss of your own)")
    loss = named_attribute(name, wrong, "function", callable)
    try:
        inspect.signature(loss).bind(*POLICY_LOSS_ARGUMENTS, **dict.fromkeys(POLICY_LOSS_OPTIONAL))
    except TypeError as e:
        parameters = ", ".join([*POLICY_LOSS_ARGUMENTS, *(f"{p}=None" for p in POLICY_LOSS_OPTIONAL)])
        raise ConfigError(f"algorithm.policy_loss: cannot be called as a policy loss: {e} (got: {name!r}); give it "
                          f"the parameters ({parameters})") from None
    return loss
