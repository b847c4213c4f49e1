"""A Megatron model's optimizer: Adam with fp32 main weights (policy.optimizer), distributed over
data-parallel ranks where policy.use_distributed_optimizer says so."""

import torch

from rlkit.config.schema import ConfigError, PolicyConfig


def build_optimizer(cfg: PolicyConfig, transformer_config, model: list, lr: float):
    """Megatron's optimizer over the model chunks; the model's gradients are finalized (reduced
    over data-parallel ranks) by the schedule through the config it sets."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if transformer_config.num_moe_experts and transformer_config.tensor_model_parallel_size > 1:
        # megatron-core's MoE layer refuses TP without sequence parallelism in training mode; with its
        # check bypassed, the gradients were wrong (measured)
        raise ConfigError(f"policy.tensor_parallel_size: an MoE model trains at TP > 1 only with sequence "
                          f"parallelism, which rlkit does not enable (got: "
                          f"{transformer_config.tensor_model_parallel_size}); train it at TP=1 and spread its "
                          f"experts with policy.expert_parallel_size")
    o, bf16 = cfg.optimizer, cfg.precision == "bf16"
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad, bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=cfg.use_distributed_optimizer), model)
    transformer_config.finalize_model_grads_func = finalize_model_grads
    return optimizer
