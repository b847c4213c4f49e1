"""An HF model's parameters under its checkpoint's names: transformers 5 fuses Qwen3-MoE's experts
into stacked parameters; the HF generation worker receives refits into views of them."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlkit.models.checkpoint_names import checkpoint_named_parameters
from rlkit.models.tiny import build_tiny_model


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2"])
def test_names_and_values_are_the_checkpoint_files(arch, tmp_path):
    model_dir = build_tiny_model(arch, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    on_disk = load_file(model_dir / "model.safetensors")
    named = checkpoint_named_parameters(model)
    assert set(named) == set(on_disk)
    assert all(torch.equal(named[name], tensor) for name, tensor in on_disk.items())


def test_writing_a_checkpoint_tensor_changes_the_fused_parameter_the_model_computes_with(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model("qwen3_moe", tmp_path / "moe"), dtype=torch.float32)
    experts = model.model.layers[1].mlp.experts
    intermediate = experts.gate_up_proj.shape[1] // 2
    named = checkpoint_named_parameters(model)
    with torch.no_grad():
        named["model.layers.1.mlp.experts.3.up_proj.weight"].fill_(7.0)
        named["model.layers.1.mlp.experts.2.down_proj.weight"].fill_(5.0)
    assert torch.all(experts.gate_up_proj[3, intermediate:] == 7.0)
    assert not torch.any(experts.gate_up_proj[3, :intermediate] == 7.0)  # the gate half is its own tensor
    assert torch.all(experts.down_proj[2] == 5.0) and not torch.any(experts.down_proj[1] == 5.0)
