"""What a Megatron worker process would otherwise print in every process, and what the driver says
once instead (optional_kernels_missing)."""

import importlib.util
import warnings

# megatron-core's PyTorch fallbacks when Apex / TransformerEngine are absent, the "full"
# cuda_graph_scope that mbridge's configs still name (graphs are off), and mbridge's note that a
# checkpoint saved from a single-file model has no safetensors index (none is needed). And
# PyTorch's deprecation of the ShardedTensor and dcp.load_state_dict that megatron-core 0.16's
# torch_dist load strategy is built on (a resume, `rlkit convert`); the CPU path's TorchFunctionMode
# (cpu_compat) is only where the first is reported from, as the frame that calls into ShardedTensor.
EXPECTED = (r".*(Apex|Transformer Engine).* (is|are) not installed", r"full scope is deprecated",
            r"No index file found", r"Please use DTensor instead and we are deprecating ShardedTensor",
            r"`load_state_dict` is deprecated")


def silence_expected_warnings() -> None:
    for message in EXPECTED:
        warnings.filterwarnings("ignore", message=message)


def optional_kernels_missing() -> list[str]:
    """Which of Megatron's optional fused-kernel packages are not installed here."""
    return [name for name, module in [("Apex", "apex"), ("TransformerEngine", "transformer_engine")]
            if importlib.util.find_spec(module) is None]
