"""The training-backend registry (rlkit/workers/policy/backends.py): every policy.backend names a
class that implements the whole TrainingBackend interface, the controller's start-up finds the
class there (rlkit/cluster imports no backend's module), and each backend's own config rules run
for it alone, one line each."""

import ast
import dataclasses
import json
import struct
from pathlib import Path

import pytest

from rlkit.config.schema import ConfigError
from rlkit.launch.config import load_config
from rlkit.workers.policy.backends import BACKENDS
from rlkit.workers.policy.base import TrainingBackend

ROOT = Path(__file__).resolve().parents[2]


def load_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config("grpo_tiny_cpu", list(overrides))
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_every_backend_resolves_to_a_whole_training_backend(name):
    worker = BACKENDS[name].worker.resolve()
    assert issubclass(worker, TrainingBackend) and not worker.__abstractmethods__, worker.__abstractmethods__


def test_the_cluster_imports_no_backend_module():
    backend_modules = {lazy.worker.target.partition(":")[0] for lazy in BACKENDS.values()}
    for path in (ROOT / "rlkit" / "cluster").glob("*.py"):
        imported = {node.module for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom)}
        assert not imported & backend_modules, (path, imported & backend_modules)


def test_an_unknown_backend_is_one_line_naming_the_key():
    message = load_error("policy.backend=deepspeed")
    assert message.startswith("policy.backend: must be one of ['megatron', 'fsdp2']") and "(got: 'deepspeed')" in message


def test_the_default_backend_is_megatron():
    cfg, _ = load_config("grpo_tiny_cpu", [])
    assert cfg.policy.backend == "megatron"


@pytest.mark.parametrize("key", ["tensor_parallel_size", "pipeline_parallel_size", "virtual_pipeline_parallel_size",
                                 "context_parallel_size", "expert_parallel_size"])
def test_a_megatron_layout_key_under_fsdp2_is_one_line_naming_it(key):
    message = load_error("policy=fsdp2_tiny", f"policy.{key}=2", "policy.num_workers=4", "policy.model_path=tiny://qwen3_moe")
    assert message.startswith(f"policy.{key}: a Megatron layout key, which policy.backend=fsdp2 does not use (got: 2)")
    assert f"set policy.{key}=1" in message and "or policy.backend=megatron" in message


def test_fsdp2_without_its_section_names_the_policy_group():
    message = load_error("policy.backend=fsdp2")
    assert message.startswith("policy.fsdp2: policy.backend=fsdp2 reads this section") and "policy=fsdp2_tiny" in message


def test_a_backend_refuses_an_algorithm_whose_head_it_does_not_build(monkeypatch):
    for recipe in ("ppo_tiny_cpu", "reward_model_tiny_cpu"):  # fsdp2 builds a critic's and a reward model's head
        assert load_config(recipe, ["policy=fsdp2_tiny"])[0].policy.backend == "fsdp2"
    monkeypatch.setitem(BACKENDS, "fsdp2", dataclasses.replace(BACKENDS["fsdp2"], heads=("lm",)))
    with pytest.raises(ConfigError, match=r"^policy.backend: algorithm ppo trains a model with a value head, which "
                                          r"policy.backend=fsdp2 does not build yet \(got: 'fsdp2'\); set "
                                          r"policy.backend=megatron$"):
        load_config("ppo_tiny_cpu", ["policy=fsdp2_tiny"])


def test_fsdp2_refuses_a_checkpoint_that_needs_trust_remote_code(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "my_own_lm", "auto_map": {"AutoModelForCausalLM": "modeling_my_own.MyOwnLM"},
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "hidden_size": 64}))
    message = load_error("policy=fsdp2_tiny", f"policy.model_path={tmp_path}")
    assert message.startswith(f"policy.model_path: {tmp_path} is a 'my_own_lm' model and its code comes with the "
                              f"checkpoint (config.json auto_map), which needs trust_remote_code")


def test_fsdp2_loads_as_a_policy_group():
    cfg, _ = load_config("grpo_tiny_cpu", ["policy=fsdp2_tiny"])
    assert cfg.policy.backend == "fsdp2" and cfg.policy.fsdp2.reshard_after_forward


def test_an_architecture_no_bridge_converts_is_refused_under_megatron_and_loads_under_fsdp2():
    message = load_error("policy.model_path=tiny://phi3")
    assert message == ("policy.model_path: tiny://phi3 is a 'phi3' model, which policy.backend=megatron does not train "
                       "(got: policy.backend=megatron); train it with policy=fsdp2_tiny (policy.backend=fsdp2)")
    cfg, _ = load_config("grpo_tiny_cpu_fsdp2_phi3", [])
    assert (cfg.policy.backend, cfg.policy.model_path) == ("fsdp2", "tiny://phi3")


def test_fsdp2_refuses_a_model_whose_training_state_outgrows_this_machine(tmp_path):
    """A checkpoint whose safetensors header declares 10 B fp32 parameters (160 GB of training state,
    more than this CPU machine's memory); the header alone is read."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "hidden_size": 64}))
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [100_000, 100_000],
                                                       "data_offsets": [0, 0]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    message = load_error("policy=fsdp2_tiny", f"policy.model_path={tmp_path}", "policy.num_workers=2",
                         "policy.train_global_batch_size=64")
    assert message.startswith(f"policy.model_path: training {tmp_path} under policy.backend=fsdp2 holds at least "
                              f"80.0 GB per rank (10.00 B parameters x 16 bytes of fp32 weights, gradients and Adam "
                              f"moments / policy.num_workers=2), more than the ")
