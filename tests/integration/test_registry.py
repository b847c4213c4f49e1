"""An algorithm is one module and one YAML. A throwaway one, written here into a folder of the
user's own (never into rlkit), is found by its name, typed, validated by its own rule, and
trains two GRPO-style steps on the tiny model through the same launch path as the built-ins."""

import shutil
import textwrap

import pytest

from rlkit.config.schema import ConfigError
from rlkit.launch.config import RECIPES_DIR, load_config
from rlkit.launch.run import train

pytestmark = pytest.mark.integration

MODULE = '''
"""Sign advantages: +1 for a sample above its prompt group's mean reward by more than the margin,
-1 below it by more, 0 otherwise."""

from dataclasses import dataclass

import torch
from omegaconf import MISSING

from rlkit.algorithms import policy_gradient
from rlkit.algorithms.advantages import group_centered
from rlkit.algorithms.policy_gradient import PolicyGradientConfig, PolicyGradientTrainer, per_sample
from rlkit.algorithms.registry import AlgorithmSpec
from rlkit.config.schema import ConfigError


@dataclass
class SignConfig(PolicyGradientConfig):
    margin: float = MISSING


def validate(cfg, dp):
    policy_gradient.validate(cfg, dp, min_group_size=2)
    if cfg.algorithm.margin < 0:
        raise ConfigError(f"algorithm.margin: must be >= 0 (got: {cfg.algorithm.margin}); e.g. 0.0")


def sign(a, rewards, group_ids):
    centered = group_centered(rewards, group_ids)
    return torch.where(centered.abs() > a.margin, centered.sign(), torch.zeros_like(centered))


def odd_length(response: str, metadata: dict) -> float:
    """A reward a random model earns half the time, so groups differ and advantages are not 0."""
    return float(len(response) % 2)


ALGORITHM = AlgorithmSpec(
    name="sign_advantages", config=SignConfig, data="prompts", load_data=policy_gradient.load_prompts,
    trainer=PolicyGradientTrainer, rollouts=True, validate=validate, estimator=per_sample(sign),
    kl_in_loss=lambda a: True, uses_reference=lambda a: a.kl_coef > 0)
'''

YAML = '''
# Sign advantages (a throwaway algorithm): +1 / -1 / 0 around the prompt group's mean reward
defaults:
  - /algorithm_shared/policy_gradient@_here_
  - _self_

# the algorithm's module
name: sign_advantages
# rewards within this distance of the group mean get advantage 0
margin: 0.0
'''


@pytest.fixture
def own_recipes(tmp_path, monkeypatch):
    """A user's folder: the algorithm's module (importable) and its YAML next to a recipe."""
    (tmp_path / "sign_advantages.py").write_text(textwrap.dedent(MODULE))
    (tmp_path / "algorithm").mkdir()
    (tmp_path / "algorithm" / "sign_advantages.yaml").write_text(textwrap.dedent(YAML))
    shutil.copy(RECIPES_DIR / "grpo_tiny_cpu.yaml", tmp_path / "grpo_tiny_cpu.yaml")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the environment workers import it too
    return tmp_path


def test_an_algorithm_from_one_module_and_one_yaml_trains(warm_pool, own_recipes, cache_dir):
    overrides = ["algorithm=sign_advantages", f"run.cache_dir={cache_dir}", f"run.output_dir={own_recipes / 'out'}",
                 "algorithm.num_steps=2", "algorithm.val_every=2", "algorithm.prompts_per_step=8",
                 "algorithm.group_size=4", "policy.train_global_batch_size=16", "policy.micro_batch_size=4",
                 "algorithm.warm_start.sft_steps=0", "checkpoint.every=0", "env._target_=sign_advantages.odd_length"]
    with pytest.raises(ConfigError, match=r"^algorithm\.margin: must be >= 0 \(got: -1\.0\)"):
        load_config("grpo_tiny_cpu", [*overrides, "algorithm.margin=-1"], own_recipes)
    cfg, resolved = load_config("grpo_tiny_cpu", overrides, own_recipes)
    assert type(cfg.algorithm).__name__ == "SignConfig" and cfg.algorithm.margin == 0.0
    history = train(cfg, resolved, pool=warm_pool).history  # the driver and the environment workers import it
    assert [m["step"] for m in history] == [0, 1, 2]
    for metrics in history[1:]:  # the sign advantages moved the policy, and refit kept up with it
        assert metrics["train/grad_norm"] > 0 and metrics["refit/logprob_abs_error_max"] < 1e-4
