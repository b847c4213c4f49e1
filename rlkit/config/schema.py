"""Typed schema of the whole config. Defaults live in configs/*.yaml (one place each); the
schema only fixes names and types, so unknown keys and wrong types fail at load time. Each
algorithm's own section is declared by its module (rlkit/algorithms/registry.py)."""

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING


class ConfigError(ValueError):
    """One line naming the config key (or file) at fault and how to fix it."""


def check_finite(section: str, config) -> None:
    """Every number of a config section (nested sections too; None: no section) is finite: nan
    passes every range check (nan < 0 is false) and acts as 0, and an inf loss coefficient makes
    the loss NaN, which refit hands to generation before the next step fails."""
    for name, value in (vars(config) if config is not None else {}).items():
        key = f"{section}.{name}"
        if dataclasses.is_dataclass(value):
            check_finite(key, value)
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number (got: {value}); give a number in its range, e.g. the "
                              f"recipe's value (rlkit train --config-name <recipe> --cfg job shows it)")


def check_choice(key: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}: must be one of {list(choices)} (got: {value!r}); pick one of those")


def check_positive(*counts: tuple[str, int]) -> None:
    """(key, count): each >= 1."""
    for key, count in counts:
        if count < 1:
            raise ConfigError(f"{key}: must be >= 1 (got: {count}); set a positive value")


def check_seconds(*durations: tuple[str, float, float]) -> None:
    """(key, seconds, a usual value): each a finite number of seconds > 0. A negative or zero one
    was accepted and ended the wait at once, nan never ended it, inf overflows a timer."""
    for key, seconds, usual in durations:
        if not (math.isfinite(seconds) and seconds > 0):
            raise ConfigError(f"{key}: must be a finite number of seconds > 0 (got: {seconds}); e.g. {usual}")


@dataclass
class ClusterConfig:
    address: Optional[str] = MISSING
    connect_timeout_s: float = MISSING
    num_cpus: int = MISSING
    object_store_mb: int = MISSING
    placement: str = MISSING
    threads_per_worker: int = MISSING
    call_timeout_s: float = MISSING
    collective_timeout_s: float = MISSING
    fork_workers: bool = MISSING

    def address_to_join(self) -> tuple[str, str] | None:
        """(the key that names it, its address) of the Ray cluster a run joins: cluster.address,
        else RAY_ADDRESS; None: the run starts a local cluster (neither is set, or it is "local",
        Ray's name for a new local cluster)."""
        key, address = ("cluster.address", self.address) if self.address else ("RAY_ADDRESS",
                                                                               os.environ.get("RAY_ADDRESS"))
        return (key, address) if address and address != "local" else None

    def check_timeouts(self) -> None:
        check_seconds(("cluster.connect_timeout_s", self.connect_timeout_s, 30),
                      ("cluster.call_timeout_s", self.call_timeout_s, 600),
                      ("cluster.collective_timeout_s", self.collective_timeout_s, 600))


@dataclass
class TinyModelConfig:
    hidden_size: int = MISSING
    num_layers: int = MISSING
    seed: int = MISSING


@dataclass
class OptimizerConfig:
    lr: float = MISSING
    weight_decay: float = MISSING
    adam_beta1: float = MISSING
    adam_beta2: float = MISSING
    adam_eps: float = MISSING
    clip_grad: float = MISSING
    lr_schedule: str = MISSING
    warmup_steps: int = MISSING
    min_lr_ratio: float = MISSING


@dataclass
class PeftConfig:
    """policy.peft: low-rank adapters on the named linear layers; the base weights stay frozen."""

    type: str = MISSING
    rank: int = MISSING
    alpha: float = MISSING
    dropout: float = MISSING
    target_modules: list[str] = MISSING
    # a policy.peft run's checkpoint (.../checkpoints/step_N) whose adapters this run starts from
    init_from: Optional[str] = None


@dataclass
class PolicyConfig:
    """Every training backend's keys; a backend with keys of its own types the section with a
    subclass (rlkit/workers/policy/backends.py Backend.config)."""

    model_path: str = MISSING
    # the training backend (rlkit/workers/policy/backends.py); a default here: checkpoints saved
    # before the key existed load as they were
    backend: str = "megatron"
    tiny_model: TinyModelConfig = field(default_factory=TinyModelConfig)
    num_workers: int = MISSING
    tensor_parallel_size: int = MISSING
    pipeline_parallel_size: int = MISSING
    virtual_pipeline_parallel_size: int = MISSING
    context_parallel_size: int = MISSING
    expert_parallel_size: int = MISSING
    micro_batch_size: int = MISSING
    max_tokens_per_microbatch: int = MISSING
    train_global_batch_size: int = MISSING
    precision: str = MISSING
    fp32_lm_head: bool = MISSING
    attention_backend: str = MISSING
    bridge: str = MISSING
    use_distributed_optimizer: bool = MISSING
    offload: str = MISSING
    # None: every weight trains
    peft: Optional[PeftConfig] = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)


@dataclass
class VllmEngineConfig:
    tensor_parallel_size: int = MISSING
    gpu_memory_utilization: float = MISSING
    max_model_len: int = MISSING
    enforce_eager: bool = MISSING
    torch_compile: bool = MISSING
    seed_per_request: bool = MISSING
    engine_process: bool = MISSING
    # None: the engine holds the weights as refitted; "fp8": vLLM quantizes them as each refit loads them
    quantization: Optional[str] = None


@dataclass
class GenerationConfig:
    backend: str = MISSING
    num_workers: int = MISSING
    max_new_tokens: int = MISSING
    temperature: float = MISSING
    top_p: float = MISSING
    top_k: int = MISSING
    ignore_eos: bool = MISSING
    precision: str = MISSING
    vllm: Optional[VllmEngineConfig] = None


@dataclass
class RefitConfig:
    transport: str = MISSING
    bucket_mb: float = MISSING
    verify_checksums: bool = MISSING
    keep_fp32: list[str] = MISSING
    channel_host: str = MISSING
    # nccl: one | spread (rlkit/config/choices.py BROADCAST_GROUPS)
    broadcast_groups: str = MISSING
    # policy.peft runs: merged | adapter (rlkit/config/choices.py PEFT_MODES)
    peft: str = MISSING
    # send each bucket's changes since the last refit (rlkit/refit/delta.py); refit.transport=cpu or nccl
    delta: bool = MISSING


@dataclass
class WarmStartConfig:
    """A short supervised run before RL or DPO (algorithm.warm_start in those algorithms)."""

    sft_steps: int = MISSING
    batch_size: int = MISSING
    lr: float = MISSING


@dataclass
class EpisodeWarmStartConfig(WarmStartConfig):
    """RL's warm start: for an environment that gives reference turns (tool calls, then the
    answer), on whole episodes, a share of them answered directly instead."""

    direct_fraction: float = MISSING


@dataclass
class EnvRunnerConfig:
    num_workers: int = MISSING
    timeout_s: float = MISSING
    failure_reward: float = MISSING
    fail_fast: bool = MISSING
    max_turns: int = MISSING
    max_total_tokens: int = MISSING
    max_tool_seconds: float = MISSING
    observation_format: str = MISSING
    flow: str = MISSING


@dataclass
class ArithmeticSetConfig:
    train_size: int = MISSING
    val_size: int = MISSING
    max_operand: int = MISSING
    operations: list[str] = MISSING
    seed: int = MISSING


@dataclass
class SyntheticSetConfig(ArithmeticSetConfig):
    """A prompt set generated offline: arithmetic ("12+7=") or GSM8K-format word problems."""

    kind: str = MISSING


@dataclass
class PromptDataConfig:
    """RL prompts from files or the hub, each row mapped to a prompt and a ground truth."""

    name: str = MISSING
    train_path: str = MISSING
    val_path: Optional[str] = MISSING
    subset: Optional[str] = MISSING
    train_split: str = MISSING
    val_split: str = MISSING
    val_size: Optional[int] = MISSING
    prompt_field: str = MISSING
    answer_field: Optional[str] = MISSING
    max_prompt_tokens: int = MISSING
    max_row_bytes: int = MISSING
    chat_template: bool = MISSING
    system_prompt: Optional[str] = MISSING
    prompt_format: str = MISSING
    # where a tool environment's tools are shown: chat_template | system_prompt (choices.TOOL_PROMPTS)
    tool_prompt: str = MISSING
    synthetic: Optional[SyntheticSetConfig] = None


@dataclass
class FileDataConfig:
    name: str = MISSING
    train_path: str = MISSING
    val_path: Optional[str] = MISSING
    max_length: int = MISSING
    max_row_bytes: int = MISSING
    synthetic: Optional[ArithmeticSetConfig] = None


@dataclass
class SFTDataConfig(FileDataConfig):
    pack: bool = MISSING


@dataclass
class PreferenceSetConfig(ArithmeticSetConfig):
    """Preference pairs on generated problems: rejected is a near miss (the answer off by 1-3), or
    with probability malformed_fraction a malformed response (the answer repeated or with extra
    characters, empty, random characters)."""

    malformed_fraction: float = 0.0  # a default here: the sets written before the key stay as they were
    # arithmetic or word_problems (GSM8K-format worked solutions: rlkit/data/word_problem_pairs.py); a default as above
    kind: str = "arithmetic"
    # the prompt around each problem, as the policy is asked it (data.prompt_format); a default as above
    prompt_format: str = "{prompt}"


@dataclass
class PreferenceDataConfig(FileDataConfig):
    synthetic: Optional[PreferenceSetConfig] = None


# data.name -> its schema
DATASETS = {"prompts": PromptDataConfig, "sft_files": SFTDataConfig, "preference_files": PreferenceDataConfig}


@dataclass
class CheckpointConfig:
    enabled: bool = True  # a default here: checkpoints saved before the key existed load as they were
    every: int = MISSING
    save_format: str = MISSING
    background: bool = MISSING
    keep_last: int = MISSING
    resume: str = MISSING
    # rlkit/launch/resume_drift.py; a default here for the reason enabled has one
    resume_with_changes: bool = False
    dir: Optional[str] = MISSING
    interrupt_grace_s: float = MISSING

    def check_timeouts(self) -> None:
        check_seconds(("checkpoint.interrupt_grace_s", self.interrupt_grace_s, 300))


@dataclass
class WandbConfig:
    enabled: bool = MISSING
    project: str = MISSING
    mode: str = MISSING


@dataclass
class LoggerConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    tensorboard: bool = MISSING
    plots: bool = MISSING


@dataclass
class RunConfig:
    name: str = MISSING
    output_dir: str = MISSING
    cache_dir: str = MISSING
    seed: int = MISSING


@dataclass
class RootConfig:
    run: RunConfig = field(default_factory=RunConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    # typed at load time: algorithm by its module's spec (algorithm.name), data through DATASETS
    algorithm: Any = MISSING
    data: Any = MISSING
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    # RL only (rollouts): absent from SFT and DPO recipes
    generation: Optional[GenerationConfig] = None
    refit: Optional[RefitConfig] = None
    # the environment's own keys are its constructor's: checked against it, not here
    env: Optional[dict[str, Any]] = None
    env_runner: Optional[EnvRunnerConfig] = None
