"""rlkit/bridge/megatron_bridge_compat.py: each fix Megatron-Bridge 0.3.1 needs on rlkit's stack,
shown on the function it fixes. Without TransformerEngine the bridge imports and nothing sees TE
as installed; the checkpoint's RoPE base and rotated fraction reach the model config; the local
layer spec's experts have conversions; and, on two gloo ranks, a row-parallel weight reaches each
tensor-parallel rank as its own columns, and an expert held on one rank exports as itself."""

import importlib.util
import json
import sys

import pytest
import torch
from gloo_ranks import on_gloo_ranks

from rlkit.bridge.megatron_bridge_compat import auto_bridge

TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(TE_INSTALLED, reason="the import placeholders apply where TransformerEngine is absent")
def test_imports_without_transformer_engine_and_leaves_it_absent():
    assert auto_bridge().__name__ == "AutoBridge"
    assert importlib.util.find_spec("transformer_engine") is None
    assert not [name for name in sys.modules if name.split(".")[0] == "transformer_engine"]


@pytest.mark.skipif(TE_INSTALLED, reason="the flags are True where TransformerEngine is installed")
def test_every_have_te_flag_of_the_bridge_reads_false_without_transformer_engine():
    """Megatron-Bridge's LoRA and layer choices branch on these: a True one picks TE classes
    that are only import-time placeholders here."""
    auto_bridge()
    flags = {f"{name}.{flag}": value for name, module in list(sys.modules.items())
             if name.startswith("megatron.bridge.") and module is not None
             for flag, value in vars(module).items() if flag.startswith("HAVE_TE") and isinstance(value, bool)}
    assert "megatron.bridge.peft.utils.HAVE_TE" in flags  # the LoRA layers' switch is among them
    assert [flag for flag, value in flags.items() if value] == []


@pytest.mark.parametrize("config_class, rope, expected", [
    ("Qwen3Config", {"rope_theta": 1e6, "rope_type": "default"}, (1e6, 1.0)),
    # GLM-4.5 rotates half of each head
    ("Glm4MoeConfig", {"rope_theta": 5e5, "partial_rotary_factor": 0.5, "rope_type": "default"}, (5e5, 0.5)),
], ids=["qwen3-rope-base", "glm4-moe-partial-rotary"])
def test_the_checkpoints_rope_settings_reach_the_model_config(tmp_path, config_class, rope, expected):
    """transformers 5 keeps them in config.rope_parameters; the config is read from a checkpoint
    directory as the backend reads it."""
    import transformers

    config = getattr(transformers, config_class)(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                                 rope_parameters=rope)
    config.architectures = [config_class.replace("Config", "ForCausalLM")]
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["rope_parameters"]["rope_theta"] == rope["rope_theta"]
    provider = auto_bridge().from_hf_config(transformers.AutoConfig.from_pretrained(tmp_path)).to_megatron_provider(
        load_weights=False)
    assert (provider.rotary_base, provider.rotary_percent) == expected


def test_experts_of_the_local_layer_spec_have_the_grouped_experts_conversions():
    """GLM-4.5's name table maps only TEGroupedMLP's experts (linear_fc1.weight<E>); Megatron's
    local spec holds them as SequentialMLP's (local_experts.<E>.linear_fc1.weight)."""
    auto_bridge()
    from megatron.bridge.models.glm.glm45_bridge import GLM45Bridge

    registry = GLM45Bridge().mapping_registry()
    fc1 = registry.megatron_to_hf_lookup("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight")
    fc2 = registry.megatron_to_hf_lookup("decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight")
    assert fc1.hf_param == {"gate": "model.layers.1.mlp.experts.3.gate_proj.weight",
                            "up": "model.layers.1.mlp.experts.3.up_proj.weight"}
    assert fc2.hf_param == "model.layers.1.mlp.experts.3.down_proj.weight"
    assert type(fc1).__name__ == "GatedMLPMapping"


def _two_rank_checks(rank: int, port: int, results):
    """On each of two gloo ranks (TP=2, EP=1): a row-parallel weight loaded through the bridge's
    mapping, and an expert's export from SequentialMLP's name."""
    import torch.distributed as dist

    from rlkit.workers.policy import cpu_compat

    cpu_compat.enable()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    from megatron.core import parallel_state as mpu

    mpu.initialize_model_parallel(tensor_model_parallel_size=2)
    auto_bridge()
    from megatron.bridge.models.conversion.param_mapping import AutoMapping, RowParallelMapping

    full = torch.arange(4 * 6, dtype=torch.float32).view(4, 6)  # o_proj [hidden, heads x head_dim]
    shard = torch.nn.Linear(3, 4, bias=False)  # this rank's half of linear_proj: 3 of the 6 input columns
    row_parallel = RowParallelMapping("decoder.layers.0.self_attention.linear_proj.weight",
                                      "model.layers.0.self_attn.o_proj.weight")
    loaded = row_parallel.hf_to_megatron(full, shard)
    expert = torch.nn.Linear(4, 8, bias=False)
    expert.config = type("Config", (), {"num_moe_experts": 4})()
    down_proj = AutoMapping("decoder.layers.0.mlp.experts.local_experts.2.linear_fc2.weight",
                            "model.layers.0.mlp.experts.2.down_proj.weight")
    try:
        exported = down_proj.gather_from_ep_ranks(expert.weight.detach(), expert, down_proj.hf_param)
        exported = {name: torch.equal(tensor, expert.weight) for name, tensor in exported.items()}
    except Exception as e:  # what 0.3.1 raises reading an expert number off the name
        exported = f"{type(e).__name__}: {e}"
    results[rank] = {"row_parallel": torch.equal(loaded, full[:, 3 * rank:3 * rank + 3]), "expert": exported}
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks():
    return on_gloo_ranks(_two_rank_checks)


def test_tensor_parallel_load_gives_each_rank_its_own_columns(two_ranks):
    """A row-parallel weight (attention output, MLP down projection) splits along dim 1 into
    views of the whole tensor; gloo sent each view's storage from its start: scrambled rows."""
    assert [two_ranks[rank]["row_parallel"] for rank in (0, 1)] == [True, True]


def test_an_expert_held_on_one_rank_exports_as_itself(two_ranks):
    for rank in (0, 1):
        assert two_ranks[rank]["expert"] == {"model.layers.0.mlp.experts.2.down_proj.weight": True}
