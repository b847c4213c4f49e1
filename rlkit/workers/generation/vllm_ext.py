"""Methods rlkit adds to each vLLM worker process (LLM(worker_extension_cls=...)), called
through collective_rpc. `self` is vLLM's GPU worker. Buckets are unpacked with the same
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
    def rlkit_receive_ipc_refit(self, plan: RefitPlan, verify: bool, address: tuple) -> dict:
        """The cuda_ipc transport: every bucket of the plan in one call, from the policy rank on
        this GPU (connected at the first refit, and again after a failed one)."""
        from rlkit.refit.cuda_ipc import IpcReceiver

        replay = self._rlkit_loader(plan)
        if getattr(self, "_rlkit_ipc", None) is None or self._rlkit_ipc.address != address:
            self._rlkit_ipc = IpcReceiver(address)
        try:
            self._rlkit_ipc.receive(plan, lambda packed: replay.load(packed, verify))
        except BaseException:
            self._rlkit_ipc.close()  # the sender sees the channel close instead of waiting out its timeout
            self._rlkit_ipc = None
            raise
        return {"refit/replayable_fraction": replay.replayable_fraction}

    @_pickled_args
    def rlkit_init_refit_group(self, host: str, port: int, world_size: int, rank: int):
        from rlkit.refit.nccl_group import RefitGroup
        self._rlkit_group = RefitGroup(host, port, rank, world_size)

    @_pickled_args
    def rlkit_receive_nccl_refit(self, plan: RefitPlan, verify: bool) -> dict:
        """The nccl transport: every bucket of the plan in one call."""
        replay = self._rlkit_loader(plan)
        self._rlkit_group.receive_all(plan, lambda packed: replay.load(packed, verify))
        return {"refit/replayable_fraction": replay.replayable_fraction}

    @_pickled_args
    def rlkit_param_checksums(self) -> dict[str, int]:
        """{vLLM parameter name: checksum of its bytes}, for bit-exactness checks."""
        return {name: bucket_checksum(p.detach().contiguous().view(-1).view(torch.uint8))
                for name, p in self.model_runner.get_model().named_parameters()}
