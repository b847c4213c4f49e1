"""policy.peft under FSDP2: HF peft's LoRA on the transformers model before it is sharded (the base
frozen, the adapters alone trained), and the model's weights out as rlkit reads them: the base
with the adapters merged in under the HF checkpoint's names (refit, HF export), or the adapters
alone under HF PEFT's names (<HF module>.lora_A.weight; refit.peft=adapter, the PEFT export).
Each tensor is gathered whole from its shards in turn: collective, in one order on every rank."""

from typing import Iterator

import torch

from rlkit.config.schema import PeftConfig
from rlkit.workers.policy.fsdp2_export import DtypeOf, as_held, persistent_buffers

# HF peft's names are the HF model's under this prefix (a PeftModel wraps the model twice)
PEFT_PREFIX = "base_model.model."
ADAPTED = ".base_layer"  # an adapted layer's own weights sit under it


def with_adapters(model: torch.nn.Module, peft: PeftConfig) -> torch.nn.Module:
    """The model under LoRA on peft.target_modules: scale alpha / rank, dropout on the adapters'
    input while training, the adapters in the model's dtype, B starting at zero."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=peft.rank, lora_alpha=peft.alpha, lora_dropout=peft.dropout,
                                            target_modules=list(peft.target_modules)), autocast_adapter_dtype=False)


def is_adapter(name: str) -> bool:
    return ".lora_" in name


def hf_name(name: str) -> str:
    """A base weight's HF checkpoint name from its name under peft."""
    return name.removeprefix(PEFT_PREFIX).replace(ADAPTED, "")


def merged_weights(model: torch.nn.Module, peft: PeftConfig,
                   dtype_of: DtypeOf = as_held) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF module name, whole tensor in dtype_of(its base weight)) of every base weight, an adapted
    layer's as W + alpha / rank x B A (summed in fp32), then of the persistent buffers as held."""
    params = dict(model.named_parameters())
    scale = peft.alpha / peft.rank
    for name, param in params.items():
        if is_adapter(name):
            continue
        weight = param.detach().full_tensor()
        module, adapted, kind = name.partition(ADAPTED)
        if adapted and kind == ".weight":
            a = params[f"{module}.lora_A.default.weight"].detach().full_tensor()
            b = params[f"{module}.lora_B.default.weight"].detach().full_tensor()
            weight = weight.float() + scale * (b.float() @ a.float())
        yield hf_name(name), weight.to(dtype_of(param))
    for name, buffer in persistent_buffers(model):
        yield hf_name(name), buffer


def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF PEFT name: <HF module>.lora_A.weight / .lora_B.weight, whole tensor) of every adapter."""
    for name, param in model.named_parameters():
        if is_adapter(name):
            yield name.removeprefix(PEFT_PREFIX).replace(".default", ""), param.detach().full_tensor()


def restart_adapters(model: torch.nn.Module) -> None:
    """Every adapter adds nothing again (B = 0); A keeps its values, as a fresh LoRA's random A."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_adapter(name) and ".lora_B." in name:
                param.zero_()


def base_names(model: torch.nn.Module) -> dict[str, str]:
    """HF checkpoint name -> the base weight's name under peft."""
    return {hf_name(name): name for name, _ in model.named_parameters() if not is_adapter(name)}
