"""An FSDP2 model's weights as its HF checkpoint holds them, for refit and the HF exports: every
parameter gathered whole from its shards in turn (a tied weight once), then the persistent buffers
(e.g. an MoE router's expert bias), in the checkpoint's layout. transformers 5 holds some weights
converted from that layout (a MoE layer's experts fused into one tensor per projection), which
revert_weight_conversion splits back, as save_pretrained does, one decoder layer at a time.
Collective: every rank iterates in the same order."""

import itertools
import re
from typing import Callable, Iterator

import torch

LAYER = re.compile(r"^(.*\.layers\.\d+)\.")  # a decoder layer's weights convert together
DtypeOf = Callable[[torch.nn.Parameter], torch.dtype]  # the dtype a parameter is exported in


def as_held(param: torch.nn.Parameter) -> torch.dtype:
    return param.dtype


def whole_weights(model: torch.nn.Module, dtype_of: DtypeOf = as_held) -> Iterator[tuple[str, torch.Tensor]]:
    """(the model's own name, whole tensor) of every parameter in dtype_of(it), each shard cast
    before the gather (bf16 moves half fp32's bytes), then of every persistent buffer as held."""
    for name, param in model.named_parameters():
        yield name, param.detach().to(dtype_of(param)).full_tensor()
    yield from persistent_buffers(model)


def persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint holds (not rotary caches and the like); FSDP2 leaves them whole."""
    saved = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name in saved:
            yield name, buffer.detach()


def in_checkpoint_layout(model: torch.nn.Module, named: Iterator[tuple[str, torch.Tensor]]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """named (HF module names, whole tensors) under the checkpoint's names and layout. model: the
    transformers model (its conversions are those from_pretrained applied)."""
    from transformers.core_model_loading import revert_weight_conversion

    for _, group in itertools.groupby(named, key=lambda item: _layer_of(item[0])):
        yield from revert_weight_conversion(model, dict(group)).items()


def _layer_of(name: str) -> str:
    match = LAYER.match(name)
    return match.group(1) if match else name
