"""The door for training backends (rlkit/workers/policy/backends.py): adding one changes no rlkit
module but its own (rlkit/workers/policy/<name>*.py), its configs/policy YAML and its line in
BACKENDS. Each backend's name appears in no other rlkit module, comments and docstrings included:
its config schema, rules, model types and messages come through its Backend record."""

import re
from pathlib import Path

import pytest

from rlkit.workers.policy.backends import BACKENDS

ROOT = Path(__file__).resolve().parents[2]
POLICY = ROOT / "rlkit" / "workers" / "policy"
# Megatron was rlkit's one backend before the registry: the rest of rlkit still speaks of it
# (its bridges, its checkpoints, its fused kernels); a backend added since is behind the door
BEHIND_THE_DOOR = sorted(set(BACKENDS) - {"megatron"})


@pytest.mark.parametrize("name", BEHIND_THE_DOOR)
def test_no_rlkit_module_outside_a_backends_own_names_it(name):
    own = set(POLICY.glob(f"{name}*.py")) | {POLICY / "backends.py"}
    mentions = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                for path in sorted((ROOT / "rlkit").rglob("*.py")) if path not in own
                for number, line in enumerate(path.read_text().splitlines(), start=1)
                if re.search(name, line, re.IGNORECASE)]
    assert own - {POLICY / "backends.py"}, f"rlkit/workers/policy/{name}*.py: no module of its own"
    assert mentions == [], "\n".join(mentions)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_has_a_tiny_policy_group(name):
    """The group a config error names for it (policy=<name>_tiny), selecting it."""
    group = ROOT / "configs" / "policy" / f"{name}_tiny.yaml"
    assert re.search(rf"^backend: {name}$", group.read_text(), re.MULTILINE), group
