"""Run megatron-core 0.16.1 on a CPU-only torch build (gloo). Used only when no GPU is present.

megatron-core assumes CUDA in a handful of places: `torch.cuda.current_device()` passed as a
device, the CUDA RNG tracker, a causal mask built with device="cuda", the MoE alltoall token
dispatcher's device-to-host copies (on a side stream, of counts it then needs as numpy arrays),
and DDP/optimizer/pipeline-schedule code that allocates with device="cuda" or asserts
`grad.type()` is a CUDA type. `enable()` points the first four at the CPU and installs a
TorchFunctionMode that maps every "cuda" device argument to "cpu" for the rest, and drops the
pinned-memory requests (RotaryEmbedding's context-parallel split pins its chunk indices) that a
CPU-only build refuses. Measured overhead
is within noise.
"""

import contextlib
import logging
import warnings

import torch
from torch.overrides import TorchFunctionMode


def _to_cpu(device):
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaAsCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _to_cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            # clip_grads asserts grad.type() == "torch.cuda.FloatTensor"
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _to_cpu(args[1]), *args[2:])
        return func(*args, **kwargs)


class _SynchronousStream:
    """A CUDA stream or event on the CPU, where every op has finished when it returns: waiting and
    synchronizing have nothing to do."""

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self):
        pass


_DEFAULT_STREAM = _SynchronousStream()


def _host_copy(tensor, as_numpy=False, record_stream=False):
    """moe_utils.maybe_move_tensor_to_cpu for tensors already on the host: it converts only CUDA
    tensors to numpy, and all_to_all_single takes the split sizes as numpy but not as a tensor."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _uncompiled(model=None, **options):
    """torch.compile's signature, compiling nothing: as a decorator it returns the function as is."""
    return model if model is not None else (lambda function: function)


_mode = None


def import_megatron():
    """Import megatron-core as a CPU run uses it, without CUDA's stand-ins (a process that forks
    workers imports it once this way: rlkit/cluster/fork_server.py)."""
    # megatron-core wraps its fusable functions in torch.compile as it imports them (megatron.core.jit's
    # jit_fuser), which imports dynamo and inductor: 1.5 s of CPU in every worker process. On a CPU they
    # stay plain functions (what megatron does where torch.compile is missing); the first import of
    # megatron.core binds jit_fuser, so this holds for its modules imported later too.
    compile_ = torch.compile
    torch.compile = _uncompiled
    try:
        import megatron.core.fusions.fused_softmax  # noqa: F401
        import megatron.core.transformer.moe.token_dispatcher  # noqa: F401
        import megatron.core.tensor_parallel.random  # noqa: F401
        import megatron.core.transformer.utils  # noqa: F401
    finally:
        torch.compile = compile_


def enable():
    global _mode
    if _mode is not None:
        return
    import_megatron()
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.tensor_parallel.random as mcore_random
    import megatron.core.transformer.utils as transformer_utils

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.empty_cache = lambda: None
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.Stream = _SynchronousStream
    torch.cuda.current_stream = lambda device=None: _DEFAULT_STREAM
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    token_dispatcher.maybe_move_tensor_to_cpu = _host_copy
    mcore_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state()
    mcore_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: torch.set_rng_state(state)

    def causal_mask(seq_len):
        return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)

    transformer_utils.get_default_causal_mask = causal_mask
    fused_softmax.get_default_causal_mask = causal_mask
    # The CUDA and CPU RNG are one generator here, which megatron's RNG tracker warns about.
    logging.getLogger(mcore_random.__name__).setLevel(logging.ERROR)
    # megatron's tensor-parallel layers advise CUDA_DEVICE_MAX_CONNECTIONS=1 for CUDA's streams: none here
    warnings.filterwarnings("ignore", message=r"When using (sequence parallelism|async grad allreduce) it is "
                                              r"recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS")
    _mode = _CudaAsCpu()
    _mode.__enter__()
