"""The schema a composed config is merged into: RootConfig, with the sections whose keys depend on
a choice in the config typed by the part that owns that choice: algorithm by its module's spec
(algorithm.name), data by its set (data.name), policy by its training backend's record
(policy.backend, rlkit/workers/policy/backends.py)."""

from omegaconf import DictConfig, OmegaConf

from rlkit.algorithms.registry import load_algorithm
from rlkit.config.schema import DATASETS, ConfigError, RootConfig
from rlkit.workers.policy.backends import backend_named


def typed_schema(cfg: DictConfig) -> DictConfig:
    schema = OmegaConf.structured(RootConfig)
    name = OmegaConf.select(cfg, "algorithm.name")
    if not isinstance(name, str):
        raise ConfigError(f"algorithm.name: no algorithm selected (got: {name!r}); select the config group with "
                          f"algorithm=<name>")
    schema["algorithm"] = OmegaConf.structured(load_algorithm(name).config)
    name = OmegaConf.select(cfg, "data.name")
    if name not in DATASETS:
        raise ConfigError(f"data.name: must be one of {list(DATASETS)} (got: {name!r}); select the config group "
                          f"with data=<name>")
    schema["data"] = OmegaConf.structured(DATASETS[name])
    backend = OmegaConf.select(cfg, "policy.backend", default=schema.policy.backend)
    schema["policy"] = OmegaConf.structured(backend_named(backend).config)
    return schema
