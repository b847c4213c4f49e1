"""Megatron-Bridge as a library inside rlkit's own training loop: the few steps of its setup that an
external trainer takes over (provider configuration, PEFT creation, the PEFT pre-wrap hook, the DDP
config, adapter checkpoints), written on Megatron-Bridge 0.3.1's primitives. rlkit owns rollouts,
the loop and checkpoints; these functions only build the model the way the bridge expects it built
and move its adapters in and out of checkpoints."""

from typing import Callable

import torch

from rlkit.bridge.adapters import megatron_target_modules
from rlkit.bridge.megatron_bridge_compat import auto_bridge
from rlkit.config.schema import PeftConfig


def configure_provider(provider, params_dtype: torch.dtype, overrides: dict):
    """The provider laid out as megatron's initialized parallel_state says (TP/PP/CP/EP), in
    params_dtype, with the caller's overrides on top, then finalized: the one order in which the
    provider's derived fields come out right. Returns the provider."""
    from megatron.core import parallel_state as mpu

    settings = {"tensor_model_parallel_size": mpu.get_tensor_model_parallel_world_size(),
                "pipeline_model_parallel_size": mpu.get_pipeline_model_parallel_world_size(),
                "context_parallel_size": mpu.get_context_parallel_world_size(),
                "expert_model_parallel_size": mpu.get_expert_model_parallel_world_size(),
                "params_dtype": params_dtype, "bf16": params_dtype == torch.bfloat16, "fp16": False,
                **overrides}
    for key, value in settings.items():
        if not hasattr(provider, key):  # a misspelt override would otherwise be a silent new attribute
            raise AttributeError(f"{type(provider).__name__} has no setting {key!r}")
        setattr(provider, key, value)
    provider.finalize()
    return provider


def create_peft(peft: PeftConfig):
    """Megatron-Bridge's PEFT object for policy.peft (a LoRA on the Megatron layers that compute
    the HF modules named in target_modules)."""
    auto_bridge()  # Megatron-Bridge importable on rlkit's stack (its LoRA layers import TE unguarded)
    from megatron.bridge.peft.lora import LoRA

    return LoRA(target_modules=megatron_target_modules(peft.target_modules), dim=peft.rank, alpha=peft.alpha,
                dropout=peft.dropout)


def create_peft_hook(peft) -> Callable[[list], list]:
    """A provider pre-wrap hook that adds `peft`'s adapters to the freshly built chunks and freezes
    every other weight, before DDP wraps them: DDP's gradient buffers and the optimizer then hold
    the adapters only."""

    def add_adapters(chunks: list) -> list:
        return peft(chunks, training=True)

    return add_adapters


def create_ddp_config(use_distributed_optimizer: bool):
    """The DDP config rlkit trains with: gradients reduced in fp32 (bf16 sums of many ranks lose
    the small updates), the optimizer state optionally sharded over DP ranks."""
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer)


def adapter_state(sharded_state_dict: dict) -> dict:
    """The adapters' entries of a model's sharded state dict: what an adapter checkpoint holds. The
    frozen base stays in the HF checkpoint it was loaded from (the caller records which)."""
    return {key: value for key, value in sharded_state_dict.items() if ".adapter." in key}


def load_adapter_state(model, state: dict):
    """An adapter checkpoint's model state (adapter_state's entries, loaded) into a model with
    adapters: every adapter weight is restored, nothing else is touched."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    unrestored = [key for key in missing if ".adapter." in key]
    if unrestored or unexpected:
        raise RuntimeError(f"the adapter checkpoint does not match the model's adapters: missing {unrestored[:3]}, "
                           f"unexpected {unexpected[:3]} (another policy.peft.rank or target_modules?)")


def load_peft_adapter_checkpoint(model, checkpoint_dir: str):
    """The adapters of a Megatron distributed adapter checkpoint (saved from adapter_state) into
    the unwrapped model chunk, whatever TP/PP it was saved at. Collective."""
    from megatron.core import dist_checkpointing

    loaded = dist_checkpointing.load({"model": adapter_state(model.sharded_state_dict())}, checkpoint_dir)
    load_adapter_state(model, loaded["model"])
