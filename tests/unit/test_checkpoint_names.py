"""An HF model's checkpoint tensors under its checkpoint's names: transformers 5 fuses Qwen3-MoE's
experts into stacked parameters, and the HF generation worker receives refits into views of them;
GLM-4-MoE's expert bias is a buffer, received like a parameter."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from rlkit.models.checkpoint_names import checkpoint_tensors
from rlkit.models.tiny import build_tiny_model


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "qwen2"])  # qwen2 ties its embeddings
def test_names_and_values_are_the_checkpoint_files(arch, tmp_path):
    model_dir = build_tiny_model(arch, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    on_disk = load_file(model_dir / "model.safetensors")
    named = checkpoint_tensors(model)
    assert set(named) == set(on_disk)
    assert all(torch.equal(named[name], tensor) for name, tensor in on_disk.items())


def test_writing_a_checkpoint_tensor_changes_the_fused_parameter_the_model_computes_with(tmp_path):
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model("qwen3_moe", tmp_path / "moe"), dtype=torch.float32)
    experts = model.model.layers[1].mlp.experts
    intermediate = experts.gate_up_proj.shape[1] // 2
    named = checkpoint_tensors(model)
    with torch.no_grad():
        named["model.layers.1.mlp.experts.3.up_proj.weight"].fill_(7.0)
        named["model.layers.1.mlp.experts.2.down_proj.weight"].fill_(5.0)
    assert torch.all(experts.gate_up_proj[3, intermediate:] == 7.0)
    assert not torch.any(experts.gate_up_proj[3, :intermediate] == 7.0)  # the gate half is its own tensor
    assert torch.all(experts.down_proj[2] == 5.0) and not torch.any(experts.down_proj[1] == 5.0)


def test_a_bf16_model_holds_the_expert_bias_in_fp32(tmp_path):
    """transformers keeps GLM-4-MoE's e_score_correction_bias float32 in a bf16 model (its
    _keep_in_fp32_modules_strict), so refit.keep_fp32 sends it into an fp32 tensor."""
    config = AutoConfig.from_pretrained(build_tiny_model("glm4_moe", tmp_path / "glm"))
    tensors = checkpoint_tensors(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16))
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert tensors[bias].dtype == torch.float32
    assert all(tensor.dtype == torch.bfloat16 for name, tensor in tensors.items() if name != bias)
