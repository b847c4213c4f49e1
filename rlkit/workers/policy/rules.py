"""The config's rules for a trained model (policy.*): the settings every training backend reads,
then the backend's own (policy.backend: rlkit/workers/policy/backends.py), and its layout against
the model's shape. Each is one ConfigError line, raised as the config loads; free of torch, which
loading a config must not import (tests/unit/test_cli_startup.py)."""

from rlkit.config.choices import OFFLOAD_MODES
from rlkit.config.schema import ConfigError, PolicyConfig, RootConfig, check_choice, check_positive
from rlkit.models.shape import ModelShape, model_shape
from rlkit.models.tiny import ARCHITECTURES, parse_tiny
from rlkit.workers.policy.backends import BACKENDS, training_backend


def data_parallel_size(p: PolicyConfig) -> int:
    """Ranks that each train on their own shard of a batch."""
    return training_backend(p).data_parallel_size(p)


def check_policy(p: PolicyConfig) -> None:
    """What the policy's settings need of each other, before the model's shape is read."""
    backend = training_backend(p)
    check_choice("policy.precision", p.precision, ("fp32", "bf16"))
    if p.model_path.startswith("tiny://") and parse_tiny(p.model_path) not in ARCHITECTURES:
        raise ConfigError(f"policy.model_path: tiny model '{p.model_path}' is unknown; use one of "
                          f"{['tiny://' + x for x in ARCHITECTURES]}")
    check_positive(("policy.num_workers", p.num_workers), ("policy.tensor_parallel_size", p.tensor_parallel_size),
                   ("policy.pipeline_parallel_size", p.pipeline_parallel_size),
                   ("policy.virtual_pipeline_parallel_size", p.virtual_pipeline_parallel_size),
                   ("policy.context_parallel_size", p.context_parallel_size),
                   ("policy.expert_parallel_size", p.expert_parallel_size),
                   ("policy.micro_batch_size", p.micro_batch_size),
                   ("policy.train_global_batch_size", p.train_global_batch_size))
    backend.check_settings(p)
    check_choice("policy.offload", p.offload, OFFLOAD_MODES)
    if p.max_tokens_per_microbatch < 0:
        raise ConfigError(f"policy.max_tokens_per_microbatch: must be >= 0 (got: {p.max_tokens_per_microbatch}); "
                          f"0 turns the token budget off")
    dp = data_parallel_size(p)
    if p.train_global_batch_size % (dp * p.micro_batch_size):
        raise ConfigError(f"policy.train_global_batch_size: must be divisible by DP ({dp}) x "
                          f"policy.micro_batch_size ({p.micro_batch_size}) = {dp * p.micro_batch_size} "
                          f"(got: {p.train_global_batch_size}); set it to a multiple of {dp * p.micro_batch_size}")


def check_model_layout(p: PolicyConfig, shape: ModelShape) -> None:
    """The backend trains the model's architecture (where it does not: the backends that do), and
    its layout fits the model's shape (policy.backend's check_layout)."""
    backend = training_backend(p)
    if not backend.trains(shape.model_type):
        others = [name for name, other in BACKENDS.items() if other.trains(shape.model_type)]
        fix = (f"train it with policy={others[0]}_tiny (policy.backend={others[0]})" if others
               else "use a model of another architecture")
        raise ConfigError(f"policy.model_path: {p.model_path} is a {shape.model_type!r} model, which "
                          f"policy.backend={p.backend} does not train (got: policy.backend={p.backend}); {fix}")
    backend.check_layout(p, shape)


def check_model(cfg: RootConfig, heads: set[str]) -> ModelShape:
    """The trained model against the run: the backend builds every head the algorithm needs, its
    layout fits the model's shape, its training state fits the run's devices; the shape read."""
    p = cfg.policy
    _check_heads(p, cfg.algorithm.name, heads)
    shape = model_shape(p.model_path, p.tiny_model.num_layers, p.tiny_model.hidden_size)
    check_model_layout(p, shape)
    training_backend(p).check_fits(cfg)
    return shape


def _check_heads(p: PolicyConfig, algorithm: str, heads: set[str]) -> None:
    """The backend trains models with every head the algorithm needs (its policy's, a critic's)."""
    missing = sorted(heads - set(training_backend(p).heads))
    if missing:
        raise ConfigError(f"policy.backend: algorithm {algorithm} trains a model with a {missing[0]} head, which "
                          f"policy.backend={p.backend} does not build yet (got: {p.backend!r}); set "
                          f"policy.backend=megatron")
