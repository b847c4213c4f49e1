"""Every number has a range, checked before any worker starts: each value a user met accepted without
a word (or failing minutes later in a traceback) is now one config error line naming the key, the
range and the fix, and the fix loads. The real recipes, composed with the bad override."""

import importlib.util
import json

import pytest
from omegaconf import OmegaConf

from rlkit.cli import main
from rlkit.config.schema import ConfigError
from rlkit.launch.config import RECIPES_DIR, load_config

LORA = "grpo_tiny_lora_cpu"  # rank-8 adapters on every linear layer of tiny://qwen2, hidden size 128


@pytest.fixture
def dirs(tmp_path) -> list[str]:
    return [f"run.cache_dir={tmp_path / 'cache'}", f"run.output_dir={tmp_path / 'out'}"]


def load_error(recipe: str, overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(recipe, overrides)
    message = str(info.value)
    assert "\n" not in message, f"config errors are one line: {message!r}"
    return message


# ---- loss coefficients: finite -------------------------------------------------------------------------

@pytest.mark.parametrize("recipe, key", [("grpo_tiny_cpu", "algorithm.entropy_coef"),
                                         ("grpo_tiny_cpu", "algorithm.kl_coef"),
                                         ("ppo_tiny_cpu", "algorithm.critic.value_clip"),
                                         ("reinforce_pp_tiny_cpu", "algorithm.kl_coef"),
                                         ("dpo_tiny_cpu", "algorithm.beta"),
                                         ("dpo_tiny_cpu", "algorithm.sft_weight")])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_loss_coefficient_must_be_finite(dirs, recipe, key, value):
    """nan passed every range check and acted as 0; inf made the loss NaN, refit it, and failed step 2."""
    message = load_error(recipe, [*dirs, f"{key}={value}"])
    assert message.startswith(f"{key}: must be a finite number (got: {float(value)}); give a number in its range")
    load_config(recipe, [*dirs, f"{key}=0.1"])


@pytest.mark.parametrize("recipe, key", [(LORA, "policy.peft.alpha"), ("grpo_tiny_cpu", "policy.optimizer.weight_decay"),
                                         ("grpo_tiny_cpu", "generation.temperature"), ("grpo_tiny_cpu", "refit.bucket_mb")])
def test_every_other_number_is_finite_too(dirs, recipe, key):
    """nan passed their range checks (nan <= 0 is false)."""
    message = load_error(recipe, [*dirs, f"{key}=nan"])
    assert message.startswith(f"{key}: must be a finite number (got: nan)")


# ---- timeouts: finite seconds > 0 ----------------------------------------------------------------------

@pytest.mark.parametrize("key, usual", [("checkpoint.interrupt_grace_s", 300), ("cluster.connect_timeout_s", 30),
                                        ("cluster.call_timeout_s", 600), ("cluster.collective_timeout_s", 600)])
@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf"])
def test_a_timeout_is_a_finite_number_of_seconds(dirs, key, usual, value):
    message = load_error("grpo_tiny_cpu", [*dirs, f"{key}={value}"])
    assert message == f"{key}: must be a finite number of seconds > 0 (got: {float(value)}); e.g. {usual}"
    load_config("grpo_tiny_cpu", [*dirs, f"{key}={usual}"])


# ---- LoRA: its rank against the model, init_from against the run ----------------------------------------

def test_lora_rank_must_stay_below_the_hidden_size(dirs):
    """rank 4096 on a 128-wide model: 40x the base's parameters, and not one word."""
    message = load_error(LORA, [*dirs, "policy.peft.rank=4096"])
    assert message.startswith("policy.peft.rank: must be below the model's hidden size 128 (got: 4096): past it the "
                              "adapters learn nothing more and hold more parameters than the weights they adapt")
    assert message.endswith("use a rank well below 128 (8 to 64 is usual), or policy.peft=null to train every weight")
    assert load_error(LORA, [*dirs, "policy.peft.rank=128"]).startswith("policy.peft.rank: must be below")
    load_config(LORA, [*dirs, "policy.peft.rank=64"])


def test_lora_rank_against_an_hf_checkpoints_hidden_size(tmp_path, dirs):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "num_attention_heads": 4,
                                                   "num_key_value_heads": 2, "num_hidden_layers": 2,
                                                   "hidden_size": 64}))
    message = load_error(LORA, [*dirs, f"policy.model_path={model}", "policy.peft.rank=64"])
    assert message.startswith("policy.peft.rank: must be below the model's hidden size 64 (got: 64)")


@pytest.fixture
def adapter_checkpoint(tmp_path, dirs):
    """A policy.peft run's checkpoint folder as the run saves it: policy/ and the config it ran with."""
    _, resolved = load_config(LORA, dirs)
    checkpoint = tmp_path / "lora_run" / "checkpoints" / "step_000004"
    (checkpoint / "policy").mkdir(parents=True)
    (checkpoint / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    return checkpoint


@pytest.mark.parametrize("override, key, saved", [
    ("policy.peft.rank=16", "policy.peft.rank", "8"),
    ("policy.peft.target_modules=[q_proj,k_proj,v_proj]", "policy.peft.target_modules",
     "[down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj]")])
def test_init_from_must_match_the_runs_adapters(dirs, adapter_checkpoint, override, key, saved):
    """Another rank: a shape traceback after workers started; other target modules: most adapters
    quietly dropped."""
    init = f"policy.peft.init_from={adapter_checkpoint}"
    message = load_error(LORA, [*dirs, init, override])
    assert message.startswith(f"{key}: the adapters in {init} were saved with {key}={saved} and this run asks for ")
    assert message.endswith(f"set {key}={saved}, or policy.peft.init_from=null to start new adapters")
    load_config(LORA, [*dirs, init, override, "policy.peft.init_from=null"])
    load_config(LORA, [*dirs, init])


def test_init_from_a_checkpoint_of_every_weight_is_refused(tmp_path, dirs):
    _, resolved = load_config("grpo_tiny_cpu", dirs)
    checkpoint = tmp_path / "full_run" / "step_000002"
    (checkpoint / "policy").mkdir(parents=True)
    (checkpoint / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    message = load_error(LORA, [*dirs, f"policy.peft.init_from={checkpoint}"])
    assert message.startswith(f"policy.peft.init_from: {checkpoint} holds every weight (saved without policy.peft)")


# ---- vLLM where it cannot run ---------------------------------------------------------------------------

VLLM = ["generation=vllm", "refit=cuda_ipc", "policy.num_workers=1", "policy.train_global_batch_size=128"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is installed here")
def test_vllm_without_vllm_stops_before_ray(tmp_path, dirs):
    """It was a 153-line `No module named 'vllm'` once the workers started."""
    from rlkit.launch.run import train

    with pytest.raises(ConfigError) as info:
        train(*load_config("grpo_tiny_cpu", [*dirs, *VLLM]))
    assert str(info.value) == ("generation.backend: vllm is not installed on this machine (no module 'vllm'); its "
                               "engines run on NVIDIA GPUs: on a CPU machine use generation=hf refit=cpu, on a GPU "
                               "machine pip install vllm")
    assert not (tmp_path / "out").exists()


def test_the_cuda_ipc_hint_says_vllm_is_for_gpus(dirs):
    """The hint that sent CPU users to generation=vllm now says where each one runs."""
    assert load_error("grpo_tiny_cpu", [*dirs, "refit=cuda_ipc"]) == (
        "refit.transport: 'cuda_ipc' needs generation.backend=vllm (vLLM engines on NVIDIA GPUs); with "
        "generation.backend=hf (CPU machines) use refit=cpu")


# ---- the CLI takes Hydra's --config-path ----------------------------------------------------------------

def test_config_path_is_config_dir(capsys):
    assert main(["train", "--config-path", str(RECIPES_DIR), "--config-name", "grpo_tiny_cpu", "--cfg", "job"]) == 0
    assert "algorithm:" in capsys.readouterr().out
