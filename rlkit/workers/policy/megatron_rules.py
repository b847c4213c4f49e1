"""The config's rules for a model Megatron trains (policy.backend=megatron): its settings, then its
parallel layout against the model's shape (TP, PP and virtual stages, CP, EP), its bridge and its
adapters. Each is one ConfigError line, raised as the config loads; free of torch, which loading a
config must not import (tests/unit/test_cli_startup.py)."""

from rlkit.bridge.adapters import check_peft
from rlkit.bridge.base import (ATTENTION_BACKENDS, BRIDGES, check_bridge,
                               check_transformer_engine_context_parallel)
from rlkit.config.schema import ConfigError, PolicyConfig, check_choice
from rlkit.models.shape import ModelShape

# HF model types neither bridge converts (Phi-3: fused q/k/v and gate/up projections)
NO_BRIDGE = ("phi3",)


def model_parallel_size(p: PolicyConfig) -> int:
    """The ranks one copy of the model spans: TP x CP x PP."""
    return p.tensor_parallel_size * p.pipeline_parallel_size * p.context_parallel_size


def data_parallel_size(p: PolicyConfig) -> int:
    return p.num_workers // model_parallel_size(p)


def converts(model_type: str | None) -> bool:
    """Whether a bridge converts models of this HF model_type for Megatron."""
    return model_type not in NO_BRIDGE


def check_megatron_settings(p: PolicyConfig) -> None:
    """What Megatron's settings need of each other, before the model's shape is read."""
    check_choice("policy.attention_backend", p.attention_backend, ATTENTION_BACKENDS)
    check_choice("policy.bridge", p.bridge, BRIDGES)
    model_parallel = model_parallel_size(p)
    if p.num_workers % model_parallel:
        raise ConfigError(f"policy.num_workers: must be a multiple of policy.tensor_parallel_size x "
                          f"policy.context_parallel_size x policy.pipeline_parallel_size = {model_parallel} "
                          f"(got: {p.num_workers}); set it to a multiple of {model_parallel}")


def check_megatron_layout(p: PolicyConfig, shape: ModelShape) -> None:
    """The parallel layout against the model's shape, then what the bridge builds (check_bridge), the
    attention TransformerEngine brings where installed, and the adapters (check_peft)."""
    for name, count in [("attention heads", shape.heads), ("key/value heads", shape.kv_heads)]:
        if count % p.tensor_parallel_size:
            raise ConfigError(f"policy.tensor_parallel_size: must divide the model's {count} {name} "
                              f"(got: {p.tensor_parallel_size}); pick a divisor of {count}")
    _check_expert_parallel(p, shape.experts)
    _check_virtual_pipeline(p, shape.layers)
    _check_context_parallel(p, shape.experts)
    check_bridge(p, shape.model_type)
    check_transformer_engine_context_parallel(p.context_parallel_size)
    check_peft(p.peft, shape.hidden)


def _check_expert_parallel(p: PolicyConfig, experts: int) -> None:
    """Megatron lays the experts over TP x EP x PP ranks (expert TP = TP), so an expert-parallel group
    spans data-parallel ranks only, and each of its ranks holds an equal share of the experts."""
    ep, dp = p.expert_parallel_size, data_parallel_size(p)
    if ep == 1:
        return
    if not experts:
        raise ConfigError(f"policy.expert_parallel_size: {p.model_path} is a dense model, without experts to "
                          f"spread (got: {ep}); set it to 1")
    if experts % ep:
        raise ConfigError(f"policy.expert_parallel_size: must divide the model's {experts} experts (got: {ep}); "
                          f"pick a divisor of {experts}")
    if dp % ep:
        raise ConfigError(f"policy.expert_parallel_size: must divide the data-parallel size policy.num_workers / "
                          f"(TP x PP) = {dp} (got: {ep}); set policy.num_workers to a multiple of "
                          f"TP x PP x EP = {p.tensor_parallel_size * p.pipeline_parallel_size * ep}")


def _check_virtual_pipeline(p: PolicyConfig, layers: int) -> None:
    """Virtual pipeline stages: each pipeline rank holds policy.virtual_pipeline_parallel_size chunks
    of equal depth, run by Megatron's interleaved schedule, which needs a micro-batch per pipeline
    rank. Which bridge builds them: check_bridge."""
    vpp, dp = p.virtual_pipeline_parallel_size, data_parallel_size(p)
    if vpp == 1:
        return
    key = "policy.virtual_pipeline_parallel_size"
    if p.pipeline_parallel_size == 1:
        raise ConfigError(f"{key}: virtual stages interleave pipeline ranks, and policy.pipeline_parallel_size is 1 "
                          f"(got: {vpp}); set policy.pipeline_parallel_size > 1, or this to 1")
    stages = p.pipeline_parallel_size * vpp
    if not layers:
        raise ConfigError(f"{key}: {p.model_path}/config.json gives no num_hidden_layers to split into {stages} chunks; "
                          f"point policy.model_path at a complete HF checkpoint, or set {key}=1")
    if layers % stages:
        fitting = [v for v in range(1, layers + 1) if layers % (p.pipeline_parallel_size * v) == 0]
        raise ConfigError(f"{key}: the model's {layers} layers must split evenly into policy.pipeline_parallel_size x "
                          f"{key} = {stages} chunks (got: {vpp}); at policy.pipeline_parallel_size="
                          f"{p.pipeline_parallel_size} pick one of {fitting}")
    if p.train_global_batch_size // dp < p.pipeline_parallel_size:
        raise ConfigError(f"policy.train_global_batch_size: with {key}={vpp} each of the {dp} data-parallel ranks "
                          f"needs at least policy.pipeline_parallel_size={p.pipeline_parallel_size} rows per step, one "
                          f"per micro-batch (got: {p.train_global_batch_size}); set it to at least "
                          f"{dp * p.pipeline_parallel_size}")


def _check_context_parallel(p: PolicyConfig, experts: int) -> None:
    """rlkit's context-parallel attention is SDPAttention's (rlkit/bridge/context_parallel.py);
    with MoE layers it is untested, so refused rather than trusted."""
    cp = p.context_parallel_size
    if cp == 1:
        return
    if p.attention_backend != "sdpa":
        raise ConfigError(f"policy.context_parallel_size: context parallelism needs policy.attention_backend=sdpa "
                          f"(got: {p.attention_backend!r} with context_parallel_size={cp}); set "
                          f"policy.attention_backend=sdpa or policy.context_parallel_size=1")
    if experts:
        raise ConfigError(f"policy.context_parallel_size: {p.model_path} is an MoE model, which rlkit does not "
                          f"train with context parallelism yet (got: {cp}); set policy.context_parallel_size=1")
