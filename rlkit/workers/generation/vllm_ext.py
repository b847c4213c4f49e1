"""Methods rlkit adds to each vLLM worker process (LLM(worker_extension_cls=...)), called
through collective_rpc; refits themselves arrive at a standing receiver thread these methods
start, not through collective_rpc. `self` is vLLM's GPU worker. Buckets are unpacked with the same
RefitPlan the policy packed them with. The model's own load_weights, which knows vLLM's fused
layouts (qkv_proj, gate_up_proj) and its TP sharding, places each tensor the first time a plan
is used; later refits replay its copies (rlkit/refit/replay.py)."""

import functools
import pickle

import torch

from rlkit.refit.plan import RefitPlan, bucket_checksum
from rlkit.refit.replay import LoadReplay


def _pickled_args(method):
    """The worker side of VLLMGenerationWorker._rpc: arguments arrive as one pickle."""
    @functools.wraps(method)
    def unpickle(self, payload: bytes):
        return method(self, *pickle.loads(payload))
    return unpickle


class RefitExtension:
    def _rlkit_loader(self, plan: RefitPlan) -> LoadReplay:
        """This plan's replay of this model's loader; a new plan or model is learned again."""
        model = self.model_runner.get_model()
        replay = getattr(self, "_rlkit_replay", None)
        if replay is None or replay.plan != plan or replay.model is not model:
            replay = self._rlkit_replay = LoadReplay(plan, model)
        return replay

    @_pickled_args
    def rlkit_init_refit_group(self, host: str, port: int, world_size: int, rank: int, timeout_s: float):
        from rlkit.refit.nccl_group import RefitGroup
        self._rlkit_group = RefitGroup(host, port, rank, world_size, timeout_s)

    @_pickled_args
    def rlkit_start_refit_receiver(self, transport: str, address: tuple, name: str, timeout_s: float):
        """Starts this process's standing receiver (rlkit/refit/channel.py) for `transport`:
        from here on the policy rank at `address` starts each refit, no call into vLLM needed."""
        from rlkit.refit.channel import READY, StandingReceiver
        from rlkit.refit.cuda_ipc import IpcReceiver

        ipc = IpcReceiver() if transport == "cuda_ipc" else None

        def serve(channel, plan, start):
            replay = self._rlkit_loader(plan)

            def load(packed):
                replay.load(packed, start.verify)

            if ipc is not None:
                if start.setup is not None:  # the old slots are about to be unmapped
                    replay.release_buffers()
                ipc.receive(channel, plan, start.setup, load)
            else:
                self._rlkit_group.prepare(plan)
                channel.send(READY)  # the sender broadcasts only once every receiver got this far
                self._rlkit_group.receive_all(plan, load, start.verify)
            return {"refit/replayable_fraction": replay.replayable_fraction}

        self._rlkit_receiver = StandingReceiver(address, name, serve, torch.cuda.current_device(), timeout_s)

    @_pickled_args
    def rlkit_param_checksums(self) -> dict[str, int]:
        """{vLLM parameter name: checksum of its bytes}, for bit-exactness checks."""
        return {name: bucket_checksum(p.detach().contiguous().view(-1).view(torch.uint8))
                for name, p in self.model_runner.get_model().named_parameters()}
