"""The config's rules for the generation workers (generation.*): one ConfigError line each, as the
config loads; free of torch and vLLM, which loading a config must not import."""

from rlkit.config.schema import ConfigError, GenerationConfig, check_choice, check_positive

# generation.backend: HF transformers (CPU) or vLLM (GPUs)
BACKENDS = ("hf", "vllm")
# generation.vllm.quantization: the engine's weights as refitted, or quantized by vLLM as each refit loads them
QUANTIZATIONS = (None, "fp8")


def check_generation(g: GenerationConfig, heads: int) -> None:
    """generation.*, for a model of `heads` attention heads."""
    check_choice("generation.precision", g.precision, ("fp32", "bf16"))
    check_choice("generation.backend", g.backend, BACKENDS)
    if g.backend != "vllm":
        return
    if g.vllm is None:
        raise ConfigError("generation.vllm: the vllm backend needs engine settings; use generation=vllm")
    # a vLLM engine of several GPUs splits the model's heads as the policy's TP does
    tp = g.vllm.tensor_parallel_size
    check_positive(("generation.vllm.tensor_parallel_size", tp))
    if heads % tp:
        raise ConfigError(f"generation.vllm.tensor_parallel_size: must divide the model's {heads} attention heads "
                          f"(got: {tp}); pick a divisor of {heads}")
    check_choice("generation.vllm.quantization", g.vllm.quantization, QUANTIZATIONS)
    if g.vllm.quantization is not None and g.precision != "bf16":
        raise ConfigError(f"generation.vllm.quantization: {g.vllm.quantization} rollouts quantize bf16 weights "
                          f"(got: generation.precision={g.precision}); set generation.precision=bf16")
