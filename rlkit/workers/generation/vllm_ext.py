"""Methods rlkit adds to each vLLM worker process (LLM(worker_extension_cls=...)), called
through collective_rpc. `self` is vLLM's GPU worker. They set up this process's refit receiver
(rlkit/refit/receiver.py); refits themselves then arrive at its thread, not through
collective_rpc."""

import contextlib
import functools
import pickle

import torch

from rlkit.refit.plan import bucket_checksum
from rlkit.workers.rendezvous import bind_tcp_rendezvous_stores

# vLLM's engine imports this module before its workers join their process group (tcp://), whose
# store torch would otherwise serve on every interface
bind_tcp_rendezvous_stores()


def _pickled_args(method):
    """The worker side of VLLMGenerationWorker._rpc: arguments arrive as one pickle."""
    @functools.wraps(method)
    def unpickle(self, payload: bytes):
        return method(self, *pickle.loads(payload))
    return unpickle


class RefitExtension:
    @_pickled_args
    def rlkit_join_refit_communicator(self, transport: str, host: str, port: int, world_size: int, first_rank: int,
                                      timeout_s: float):
        """first_rank: the engine's first process's rank; this one's follows by its rank in the engine."""
        from rlkit.refit.transport import transport_spec
        self._rlkit_communicator = transport_spec(transport).join(host, port, first_rank + self.rank, world_size,
                                                                  timeout_s)

    @_pickled_args
    def rlkit_start_refit_receiver(self, transport: str, senders: dict[str, tuple], name: str, timeout_s: float):
        """From here on the policy rank that senders names for this process's GPU starts each
        refit, no call into vLLM needed."""
        from rlkit.refit.receiver import StandingReceiver, receiving_half, sender_for
        from rlkit.refit.transports.cuda_ipc import gpu_identity

        name = f"{name} (GPU {self.rank} of its engine)" if self.parallel_config.world_size > 1 else name
        self._rlkit_receiver = StandingReceiver(
            receiving_half(transport, getattr(self, "_rlkit_communicator", None)), self.model_runner.get_model,
            sender_for(senders, gpu_identity(), name), name, timeout_s,
            load_session=None if self.model_config.quantization is None else self._rlkit_quantizing_reload)

    @contextlib.contextmanager
    def _rlkit_quantizing_reload(self, model):
        """A refit into a quantized engine (generation.vllm.quantization): vLLM's layerwise reload
        takes the refit's bf16 weights, quantizes each layer once all of its weights are in and
        writes the result into the tensors the engine (and its CUDA graphs) already use."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        initialize_layerwise_reload(model)
        yield
        finalize_layerwise_reload(model, self.model_config)

    @_pickled_args
    def rlkit_seed_sampler(self, seed: int):
        """The sampler draws its noise from the device's default generator when no request has a seed."""
        torch.cuda.manual_seed(seed)

    @_pickled_args
    def rlkit_param_checksums(self) -> dict[str, int]:
        """{vLLM parameter name: checksum of its bytes}, for bit-exactness checks."""
        return {name: bucket_checksum(p.detach().contiguous().view(-1).view(torch.uint8))
                for name, p in self.model_runner.get_model().named_parameters()}
