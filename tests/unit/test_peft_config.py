"""policy.peft (rlkit/bridge/adapters.py, checked at config load): HF module names map to the
Megatron layers that compute them, fused layers are asked for whole, and every bad value, or
adapters with policy.bridge=mbridge, is one ConfigError naming its key."""

import pytest

from rlkit.bridge.adapters import megatron_target_modules
from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config

RECIPE = "grpo_tiny_lora_cpu"


@pytest.mark.parametrize("hf_names, megatron", [
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
     ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
    (["o_proj", "v_proj", "q_proj", "k_proj"], ["linear_qkv", "linear_proj"]),
    (["down_proj"], ["linear_fc2"]),
    (["up_proj", "gate_proj"], ["linear_fc1"]),
])
def test_hf_module_names_map_to_the_megatron_layers_computing_them(hf_names, megatron):
    assert megatron_target_modules(hf_names) == megatron


def test_the_lora_recipe_loads_with_adapters_on_megatron_bridge():
    cfg, _ = load_config(RECIPE, [])
    assert cfg.policy.bridge == "megatron_bridge"
    assert (cfg.policy.peft.type, cfg.policy.peft.rank, cfg.policy.peft.alpha) == ("lora", 8, 16.0)


@pytest.mark.parametrize("override, message", [
    ("policy.bridge=mbridge", "policy.peft: adapters are built by Megatron-Bridge's PEFT, which policy.bridge=mbridge "
                              "does not run; set policy.bridge=megatron_bridge"),
    ("policy.peft.type=ia3", "policy.peft.type: must be one of ['lora'] (got: 'ia3')"),
    ("policy.peft.rank=0", "policy.peft.rank: must be >= 1 (got: 0)"),
    ("policy.peft.alpha=0", "policy.peft.alpha: must be > 0 (got: 0.0)"),
    ("policy.peft.dropout=1.0", "policy.peft.dropout: must lie in [0, 1) (got: 1.0)"),
    ("policy.peft.target_modules=[q_proj,lm_head]", "policy.peft.target_modules: must be a non-empty list of"),
    ("policy.peft.target_modules=[]", "policy.peft.target_modules: must be a non-empty list of"),
    ("policy.peft.target_modules=[q_proj,v_proj]", "policy.peft.target_modules: Megatron computes ['k_proj', "
                                                   "'q_proj', 'v_proj'] in one layer (linear_qkv)"),
    ("policy.peft.target_modules=[gate_proj]", "policy.peft.target_modules: Megatron computes ['gate_proj', "
                                               "'up_proj'] in one layer (linear_fc1)"),
    ("policy.peft.ranks=8", "policy.peft.ranks: unknown key"),
    ("checkpoint.save_format=hf", "checkpoint.save_format: hf saves the policy with its adapters merged"),
    ("policy.peft.init_from=/nonexistent/step_000004", "policy.peft.init_from: /nonexistent/step_000004 is not a "
                                                       "checkpoint (no policy/ folder in it)"),
], ids=lambda value: value if value.startswith(("policy.", "checkpoint.")) else "")
def test_a_bad_peft_setting_is_one_error_naming_its_key(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(RECIPE, [override])
    assert str(error.value).startswith(message), str(error.value)


def test_full_fine_tuning_is_the_default():
    cfg, _ = load_config("grpo_tiny_cpu", [])
    assert cfg.policy.peft is None


def test_the_peft_object_is_megatron_bridges_lora_on_the_megatron_layers():
    from rlkit.bridge.megatron_bridge_integration import create_peft
    from rlkit.config.schema import PeftConfig

    lora = create_peft(PeftConfig(type="lora", rank=8, alpha=16.0, dropout=0.05,
                                  target_modules=["down_proj", "q_proj", "k_proj", "v_proj"]))
    assert type(lora).__module__ == "megatron.bridge.peft.lora" and type(lora).__name__ == "LoRA"
    assert (lora.target_modules, lora.dim, lora.alpha, lora.dropout) == (["linear_qkv", "linear_fc2"], 8, 16.0, 0.05)


def test_refit_merges_the_adapters_unless_told_to_send_them_alone():
    assert load_config(RECIPE, [])[0].refit.peft == "merged"
    assert load_config(RECIPE, ["refit.peft=adapter"])[0].refit.peft == "adapter"


@pytest.mark.parametrize("recipe, overrides, message", [
    (RECIPE, ["refit.peft=lora"], "refit.peft: must be one of ['merged', 'adapter'] (got: 'lora'); pick one"),
    ("grpo_tiny_cpu", ["refit.peft=adapter"], "refit.peft: adapter sends the policy's LoRA adapters alone, and "
                                              "policy.peft is null (the policy trains every weight); set "
                                              "refit.peft=merged, or set policy.peft"),
], ids=["unknown-mode", "adapter-without-peft"])
def test_a_bad_refit_peft_setting_is_one_error_naming_its_key(recipe, overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(recipe, overrides)
    assert str(error.value).startswith(message), str(error.value)


def test_adapter_refit_on_hf_workers_needs_peft_installed(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == "peft" else find_spec(name, *args))
    with pytest.raises(ConfigError, match=r"^refit.peft: adapter on generation.backend=hf applies the adapters with "
                                          r"HF peft, which is not installed; pip install"):
        load_config(RECIPE, ["refit.peft=adapter"])
