"""The config's rules for a model PyTorch FSDP2 trains (policy.backend=fsdp2): every rank holds a
shard of one copy of the model, so Megatron's model-parallel keys stay at 1; the model is any
causal LM the installed transformers builds from its own code, under LoRA on any of its modules;
and its training state fits the devices a local run has. One ConfigError line each, raised as the
config loads; free of torch and transformers (loading a config imports neither)."""

import importlib.util
import json
import os
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from omegaconf import MISSING

from rlkit.bridge.adapters import check_peft_ranges
from rlkit.config.schema import ConfigError, PolicyConfig, RootConfig
from rlkit.models.shape import ModelShape

# bytes each parameter's training state holds: fp32 weight and gradient, Adam's two fp32 moments
STATE_BYTES_PER_PARAMETER = 16
# Megatron's layout keys, which FSDP2 has no use for: each must keep its default of 1
MEGATRON_ONLY = ("tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_parallel_size",
                 "context_parallel_size", "expert_parallel_size")


@dataclass
class FSDP2Config:
    """policy.fsdp2: the FSDP2 backend's own settings (configs/policy/fsdp2_tiny.yaml)."""

    activation_checkpointing: bool = MISSING
    reshard_after_forward: bool = MISSING


@dataclass
class FSDP2PolicyConfig(PolicyConfig):
    """The policy section under policy.backend=fsdp2: every backend's keys and its own."""

    # None: the section is missing (check_fsdp2_settings names the policy group that has it)
    fsdp2: Optional[FSDP2Config] = None


def check_fsdp2_settings(p: FSDP2PolicyConfig) -> None:
    """Its own section is there, and Megatron's layout keys keep their defaults."""
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


def check_fsdp2_layout(p: PolicyConfig, shape: ModelShape) -> None:
    """policy.peft's ranges (HF peft's LoRA takes any module names: each is an HF module of the
    model's own), and the model's architecture is one transformers itself implements: a checkpoint
    whose code comes with it (config.json's auto_map) would need trust_remote_code, which rlkit
    does not run."""
    if p.peft is not None:
        check_peft_ranges(p.peft, shape.hidden)
        if not p.peft.target_modules:
            raise ConfigError("policy.peft.target_modules: must name at least one of the model's linear layers "
                              "(got: []); e.g. [q_proj, k_proj, v_proj, o_proj]")
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


def check_fsdp2_fits(cfg: RootConfig) -> None:
    """A run that starts its own cluster here: the model's training state (STATE_BYTES_PER_PARAMETER
    a parameter, counted from its safetensors headers), split over policy.num_workers ranks, fits
    in each rank's device (a GPU of this machine, or its share of this machine's memory). A lower
    bound (activations come on top), so what fails here would fail once its weights loaded."""
    p = cfg.policy
    if p.model_path.startswith("tiny://") or cfg.cluster.address_to_join() is not None:
        return
    parameters = _parameter_count(Path(p.model_path))
    device, available = _device_memory_per_rank(p.num_workers)
    needed = STATE_BYTES_PER_PARAMETER * parameters / p.num_workers
    if parameters and needed > available:
        fix = (f"set policy.num_workers to at least {-(-STATE_BYTES_PER_PARAMETER * parameters // available)}"
               if device == "GPU" else "train it on GPUs")
        where = "each rank's GPU" if device == "GPU" else "each rank's share of this machine's memory"
        raise ConfigError(f"policy.model_path: training {p.model_path} under policy.backend=fsdp2 holds at least "
                          f"{needed / 1e9:.1f} GB per rank ({parameters / 1e9:.2f} B parameters x "
                          f"{STATE_BYTES_PER_PARAMETER} bytes of fp32 weights, gradients and Adam moments / "
                          f"policy.num_workers={p.num_workers}), more than the {available / 1e9:.1f} GB of {where} "
                          f"(got: {p.num_workers} ranks); {fix}, or pick a smaller model")


def _parameter_count(model_dir: Path) -> int:
    """Elements of every tensor of the checkpoint's safetensors files, read from their headers
    (0 where it has none: nothing to estimate from)."""
    index = model_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"] if (model_dir / "model.safetensors").is_file() else [])
    count = 0
    for name in files:
        with open(model_dir / name, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for key, tensor in header.items():
            if key != "__metadata__":
                elements = 1
                for size in tensor["shape"]:
                    elements *= size
                count += elements
    return count


def _device_memory_per_rank(ranks: int) -> tuple[str, int]:
    """("GPU", the smallest GPU's bytes) where this machine has NVIDIA GPUs (nvidia-smi, without
    importing torch), else ("CPU", this machine's memory / ranks: a local run's ranks share it)."""
    if Path("/dev/nvidiactl").exists():
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        sizes = [int(line) for line in out.stdout.split()] if out.returncode == 0 else []
        if sizes:
            return "GPU", min(sizes) << 20
    return "CPU", os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // ranks
