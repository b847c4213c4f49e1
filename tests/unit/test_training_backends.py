"""The training-backend registry (rlkit/workers/policy/backends.py): every policy.backend names a
class that implements the whole TrainingBackend interface, the controller's start-up finds the
class there (rlkit/cluster imports no backend's module), and each backend's own config rules run
for it alone, one line each."""

import ast
from pathlib import Path

import pytest

from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config
from rlkit.workers.policy.backends import BACKENDS
from rlkit.workers.policy.base import TrainingBackend

ROOT = Path(__file__).resolve().parents[2]


def load_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config("grpo_tiny_cpu", list(overrides))
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_resolves_to_a_whole_training_backend(name):
    worker = BACKENDS[name].worker.resolve()
    assert issubclass(worker, TrainingBackend) and not worker.__abstractmethods__, worker.__abstractmethods__


def test_the_cluster_imports_no_backend_module():
    backend_modules = {lazy.worker.target.partition(":")[0] for lazy in BACKENDS.values()}
    for path in (ROOT / "rlkit" / "cluster").glob("*.py"):
        imported = {node.module for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)}
        assert not imported & backend_modules, (path, imported & backend_modules)


def test_an_unknown_backend_is_one_line_naming_the_key():
    message = load_error("policy.backend=deepspeed")
    assert message.startswith("policy.backend: must be one of ['megatron'") and "(got: 'deepspeed')" in message


def test_the_default_backend_is_megatron():
    cfg, _ = load_config("grpo_tiny_cpu", [])
    assert cfg.policy.backend == "megatron"
