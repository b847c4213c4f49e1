"""Methods rlkit adds to each vLLM worker process (LLM(worker_extension_cls=...)), called
through collective_rpc. `self` is vLLM's GPU worker. Buckets are unpacked with the same
RefitPlan the policy packed them with, then handed to the model's own load_weights, which
knows vLLM's fused layouts (qkv_proj, gate_up_proj) and its TP sharding."""

import functools
import pickle

import torch

from rlkit.refit.plan import PackedBucket, RefitIntegrityError, RefitPlan, bucket_checksum


def _pickled_args(method):
    """The worker side of VLLMGenerationWorker._rpc: arguments arrive as one pickle."""
    @functools.wraps(method)
    def unpickle(self, payload: bytes):
        return method(self, *pickle.loads(payload))
    return unpickle


class RefitExtension:
    @_pickled_args
    def rlkit_begin_refit(self, plan: RefitPlan, verify: bool):
        self._rlkit_plan, self._rlkit_verify = plan, verify
        self._rlkit_pending = set(range(len(plan.buckets)))

    def _rlkit_load(self, packed: PackedBucket):
        weights = self._rlkit_plan.unpack(packed, verify=self._rlkit_verify)
        self.model_runner.get_model().load_weights(weights=weights)
        self._rlkit_pending.discard(packed.index)

    @_pickled_args
    def rlkit_load_ipc_bucket(self, message: dict):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(message["handle"])
        args[6] = torch.cuda.current_device()  # the sender's device index means nothing here
        buffer = rebuild_cuda_tensor(*args)
        self._rlkit_load(PackedBucket(message["index"], buffer, message["checksum"]))
        torch.cuda.current_stream().synchronize()  # done reading before the sender reuses the buffer

    @_pickled_args
    def rlkit_init_refit_group(self, host: str, port: int, world_size: int, rank: int):
        from rlkit.refit.nccl_group import RefitGroup
        self._rlkit_group = RefitGroup(host, port, rank, world_size)

    @_pickled_args
    def rlkit_receive_broadcast_bucket(self):
        index = min(self._rlkit_pending)  # buckets are broadcast in index order
        self._rlkit_load(self._rlkit_group.receive(self._rlkit_plan.buckets[index]))

    @_pickled_args
    def rlkit_end_refit(self):
        if self._rlkit_pending:
            raise RefitIntegrityError(f"refit incomplete: buckets {sorted(self._rlkit_pending)} never arrived")
        self._rlkit_plan = None

    @_pickled_args
    def rlkit_param_checksums(self) -> dict[str, int]:
        """{vLLM parameter name: checksum of its bytes}, for bit-exactness checks."""
        return {name: bucket_checksum(p.detach().contiguous().view(-1).view(torch.uint8))
                for name, p in self.model_runner.get_model().named_parameters()}
