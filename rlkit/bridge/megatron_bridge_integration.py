"""Megatron-Bridge as a library inside rlkit's own training loop: the few steps of its setup that an
external trainer takes over (provider configuration, PEFT creation, the PEFT pre-wrap hook, the DDP
config), written on Megatron-Bridge 0.3.1's primitives. rlkit owns rollouts, the loop and
checkpoints; these functions only build the model the way the bridge expects it built."""

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


def load_adapted_model_state(model, state: dict):
    """A distributed checkpoint's model state into a model with adapters. The checkpoint keeps each
    wrapped layer's own weights under the layer's name (AdapterWrapper.sharded_state_dict and
    state_dict), its adapter's under <layer>.adapter.; load_state_dict expects the wrapped layer's
    under <layer>.to_wrap.<name>. Strict: every weight, base and adapter, is restored."""
    from megatron.bridge.peft.adapter_wrapper import AdapterWrapper

    wrappers = {name for name, module in model.named_modules() if isinstance(module, AdapterWrapper)}

    def module_key(key: str) -> str:
        owner, _, leaf = key.rpartition(".")
        return f"{owner}.to_wrap.{leaf}" if owner in wrappers else key

    model.load_state_dict({module_key(key): value for key, value in state.items()})
