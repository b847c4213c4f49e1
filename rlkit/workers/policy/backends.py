"""Training backends (policy.backend): the worker class that trains a model on each rank
(rlkit/workers/policy/base.py TrainingBackend), named lazily so that loading a config imports no
torch, the config rules of that backend, run as the config loads, and the schema of its policy
section. To add a backend: its module(s), its rules, its configs/policy YAML (<name>_tiny.yaml among
them), and one line in BACKENDS; no other rlkit module names it (tests/unit/test_backend_door.py)."""

from dataclasses import dataclass
from typing import Callable

from rlkit.config.named import Lazy
from rlkit.config.schema import ConfigError, PolicyConfig, RootConfig
from rlkit.models.shape import ModelShape
from rlkit.workers.policy import fsdp2_rules, megatron_rules
from rlkit.workers.policy.expected_warnings import optional_kernels_missing


@dataclass(frozen=True)
class Backend:
    worker: Lazy  # the TrainingBackend class of one rank
    check_settings: Callable[[PolicyConfig], None]  # its own keys, before the model's shape is read
    check_layout: Callable[[PolicyConfig, ModelShape], None]  # its layout against the model's shape
    data_parallel_size: Callable[[PolicyConfig], int]  # ranks that each train on their own shard of a batch
    # a warm pool's processes of one backend share imports only where this agrees (e.g. the bridge)
    imports: Callable[[PolicyConfig], str]
    # the heads its models may have: "lm" (token logprobs), "value" (PPO's critic), "reward" (a reward model)
    heads: tuple[str, ...]
    # the model's training state against the devices it will run on, where they are known as the config loads
    check_fits: Callable[[RootConfig], None] = lambda cfg: None
    # the optional fused-kernel packages it would use that are not installed (the driver says so once)
    optional_kernels_missing: Callable[[], list[str]] = lambda: []
    # the policy section's schema: PolicyConfig, or a subclass that adds the backend's own keys
    config: type = PolicyConfig
    # whether it trains models of an HF model_type (config.json's; None: a checkpoint without one)
    trains: Callable[[str | None], bool] = lambda model_type: True


BACKENDS = {
    "megatron": Backend(Lazy("rlkit.workers.policy.megatron:MegatronModelWorker"),
                        megatron_rules.check_megatron_settings, megatron_rules.check_megatron_layout,
                        megatron_rules.data_parallel_size, lambda p: p.bridge, ("lm", "value", "reward"),
                        optional_kernels_missing=optional_kernels_missing, trains=megatron_rules.converts),
    "fsdp2": Backend(Lazy("rlkit.workers.policy.fsdp2:FSDP2ModelWorker"), fsdp2_rules.check_fsdp2_settings,
                     fsdp2_rules.check_fsdp2_layout, lambda p: p.num_workers, lambda p: "", ("lm", "value", "reward"),
                     fsdp2_rules.check_fsdp2_fits, config=fsdp2_rules.FSDP2PolicyConfig),
}


def training_backend(p: PolicyConfig) -> Backend:
    return backend_named(p.backend)


def backend_named(name: str) -> Backend:
    """policy.backend's record (a ConfigError for a name it does not hold)."""
    if name not in BACKENDS:
        raise ConfigError(f"policy.backend: must be one of {list(BACKENDS)} (got: {name!r}); pick one of those")
    return BACKENDS[name]


def worker_class(p: PolicyConfig) -> type:
    """The class each rank of p's model runs (imports torch and the backend's libraries)."""
    return training_backend(p).worker.resolve()
