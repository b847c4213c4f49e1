"""The config's rules for a model PyTorch FSDP2 trains (policy.backend=fsdp2): every rank holds a
shard of one copy of the model, so Megatron's model-parallel keys stay at 1, and the model is any
causal LM the installed transformers builds from its own code. One ConfigError line each, raised as
the config loads; free of torch and transformers (loading a config imports neither)."""

import importlib.util
import json
from pathlib import Path

from rlkit.config.schema import ConfigError, PolicyConfig
from rlkit.models.shape import ModelShape

# Megatron's layout keys, which FSDP2 has no use for: each must keep its default of 1
MEGATRON_ONLY = ("tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_parallel_size",
                 "context_parallel_size", "expert_parallel_size")


def check_fsdp2_settings(p: PolicyConfig) -> None:
    if p.fsdp2 is None:
        raise ConfigError("policy.fsdp2: policy.backend=fsdp2 reads this section, which the policy config lacks (got: "
                          "null); select the FSDP2 policy with policy=fsdp2_tiny, or add the section as "
                          "configs/policy/fsdp2_tiny.yaml has it")
    for name in MEGATRON_ONLY:
        size = getattr(p, name)
        if size != 1:
            raise ConfigError(f"policy.{name}: a Megatron layout key, which policy.backend=fsdp2 does not use (got: "
                              f"{size}); set policy.{name}=1 (FSDP2 shards every weight over policy.num_workers "
                              f"ranks) or policy.backend=megatron")
    if p.peft is not None:
        raise ConfigError("policy.peft: adapters train under policy.backend=megatron only for now (got: "
                          f"{p.peft.type}); set policy.peft=null or policy.backend=megatron")


def check_fsdp2_layout(p: PolicyConfig, shape: ModelShape) -> None:
    """The model's architecture is one transformers itself implements: a checkpoint whose code
    comes with it (config.json's auto_map) would need trust_remote_code, which rlkit does not run."""
    if p.model_path.startswith("tiny://") or shape.model_type is None:
        return
    if not _transformers_implements(shape.model_type):
        hf = json.loads((Path(p.model_path) / "config.json").read_text())
        why = ("its code comes with the checkpoint (config.json auto_map), which needs trust_remote_code"
               if "auto_map" in hf else "the installed transformers has no such architecture")
        raise ConfigError(f"policy.model_path: {p.model_path} is a {shape.model_type!r} model and {why}, which rlkit "
                          f"does not run (got: model_type={shape.model_type!r}); use a checkpoint of an architecture "
                          f"transformers implements, or upgrade transformers if a newer one does")


def _transformers_implements(model_type: str) -> bool:
    """Whether the installed transformers has a models/<model_type> package (found without importing it)."""
    spec = importlib.util.find_spec("transformers")
    return any((Path(root) / "models" / model_type.replace("-", "_")).is_dir()
               for root in spec.submodule_search_locations or [])
