"""Megatron distributed checkpoints written by a thread of the worker while training goes on.

A save has three parts. `start` is what holds training: megatron-core plans the save (the
collective part), then every tensor it will write is copied into host buffers that are allocated
once and reused (pinned on a GPU: one device-to-host copy at link speed; cloned on a CPU, where
the planned tensors are the live ones). Page-locking is slow when done per tensor at the save
(1.0-1.5 s of SmolLM2's 1.9 GB on an H100), so the worker reserves the memory ahead (`reserve`,
after its first optimizer step: a thread page-locks one block while training goes on) and the
first save cuts its buffers out of it in the order it needs them, each a storage of its own over
its part of the block: the writer serializes a tensor's whole storage, so plain views of the
block would write all of it. A thread then writes those copies to disk while the
worker trains, several files side by side (file writes and hashing release the GIL). `finish`
(collective, at a step boundary) finalizes once every rank's thread is done: the global
metadata, metadata.json. Each file's SHA-256 is taken as soon as it is written,
while the others are still being written, for the checkpoint's manifest, so completing the
checkpoint never re-reads the shards.

This is megatron-core's own asynchronous save (`async_sharded_save=True`), scheduled differently:
megatron-core runs the write in a forked process per file, handing results back through a
multiprocessing Manager (a server process that outlives a worker killed with SIGKILL); forking a
process whose other thread trains risks a deadlock on any lock held at the fork. rlkit writes in a
thread of the worker's own process (file writes release the GIL) and hands results back through
an in-process queue, so no process is started and a killed worker leaves nothing behind.
"""

import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from rlkit.checkpoint import WrittenFiles, file_digest

ON_GPU = torch.cuda.is_available()
# files per rank and save, written side by side: two files written and hashed one after the other
# took a 1.9 GB SmolLM2 save at 0.8-1.0 GB/s on an H100 machine's disk
FILES_PER_RANK = 4


class BackgroundSave:
    def __init__(self):
        self.request = None  # megatron-core's AsyncRequest of the save being written
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.on_finished = None
        self.written = WrittenFiles({})  # what the thread wrote last: files, SHA-256s, bytes, seconds
        self.staging: dict[tuple[int, int], torch.Tensor] = {}  # (file, item) -> host copy, reused
        # one strategy for every save: from the third on it reuses the global save plan (the
        # model's layout does not change), and access integrity is validated at the first only
        self.strategy = None
        self.block: torch.Tensor | None = None  # host memory reserved ahead for new staging buffers
        self.block_used = 0  # bytes of it handed out (never handed out again)
        self._reserving: threading.Thread | None = None

    def reserve(self, nbytes: int) -> None:
        """Allocate nbytes of host memory for staging buffers (pinned on a GPU) in a thread, off
        the caller's path; the first save waits for it if it has not finished."""
        if self._reserving is not None:
            return

        def allocate():
            self.block = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ON_GPU)

        self._reserving = threading.Thread(target=allocate, name="checkpoint-reserve", daemon=True)
        self._reserving.start()

    @property
    def reserved(self) -> bool:
        return self._reserving is not None

    @property
    def pending(self) -> bool:
        return self.request is not None

    def start(self, sharded_state_dict: dict, directory: str, on_finished=None) -> dict[str, float]:
        """Plan the save, copy what it writes to host memory and start writing it. Collective.
        on_finished() runs on every rank once the checkpoint is whole. Returns the seconds the
        caller was held in each part (plan, stage)."""
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies import filesystem_async
        from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

        assert not self.pending, "the previous checkpoint is still being written"
        start = time.perf_counter()
        # the writer's lazily created results queue: a Manager process unless set here
        if not isinstance(filesystem_async._results_queue, queue.Queue):
            filesystem_async._results_queue = queue.Queue()
        first = self.strategy is None
        if first:
            self.strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=FILES_PER_RANK,
                                                         cached_metadata=True)
        request = dist_checkpointing.save(sharded_state_dict, directory, self.strategy,
                                          validate_access_integrity=first, async_sharded_save=True)
        planned = time.perf_counter()
        transforms, buckets, results = [], [], None
        if request.async_fn is not None:  # None: nothing of this rank's is written
            _, buckets, results = request.async_fn_args
            buckets = self._stage(buckets)
            transforms = request.async_fn.args[0]
        self.request, self.on_finished, self.error, self.written = request, on_finished, None, WrittenFiles({})
        self.thread = threading.Thread(target=self._write, args=(transforms, buckets, results),
                                       name="checkpoint-writers", daemon=True)
        self.thread.start()
        return {"plan": planned - start, "stage": time.perf_counter() - planned}

    def finish(self, wait: bool) -> WrittenFiles | None:
        """None while a rank is still writing; once every rank's write is done (with wait: once it
        is) the save is finalized and what this rank's thread wrote is returned (again on later
        calls, until the next save). Collective; every rank gets the same answer."""
        if not self.pending:
            return self.written
        if wait:
            self.thread.join()
        # one collective: is any rank still writing, has any rank failed
        status = torch.tensor([self.thread.is_alive(), self.error is not None], dtype=torch.int32,
                              device="cuda" if ON_GPU else "cpu")
        torch.distributed.all_reduce(status, op=torch.distributed.ReduceOp.MAX)
        writing, failed = status.tolist()
        if writing:
            return None
        request, self.request = self.request, None
        if failed:  # every rank names the same rank's error: whichever rank the controller hears first
            raise RuntimeError(f"writing the checkpoint failed on {_first_error(self.error)}")
        for finalize in request.finalize_fns:  # global metadata; metadata.json
            finalize()
        if self.on_finished:
            self.on_finished()
        return self.written

    def _stage(self, buckets: list) -> list:
        """The buckets with every tensor replaced by its host copy, in buffers kept for the next save."""
        if self._reserving is not None:
            self._reserving.join()
        staged = []
        for b, (path, key, (bytes_data, tensor_data)) in enumerate(buckets):
            copies = []
            for i, (item, tensor) in enumerate(tensor_data):
                buffer = self.staging.get((b, i))
                if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                    buffer = self._new_buffer(tensor)
                    self.staging[(b, i)] = buffer
                buffer.copy_(tensor.detach(), non_blocking=ON_GPU)
                copies.append((item, buffer))
            staged.append((path, key, (bytes_data, copies)))
        if ON_GPU:
            torch.cuda.current_stream().synchronize()
        return staged

    def _new_buffer(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host buffer for `tensor`: cut out of the reserved block while it has room (a storage
        of its own over that part), else allocated now."""
        nbytes = tensor.numel() * tensor.element_size()
        start = self.block_used
        if self.block is None or start + nbytes > self.block.numel():
            return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=ON_GPU)
        self.block_used = _aligned(start + nbytes)
        part = self.block.untyped_storage()[start:start + nbytes]  # shares the block's memory, keeps it alive
        return torch.empty(0, dtype=tensor.dtype).set_(part, 0, tensor.shape)

    def _write(self, transforms: list, buckets: list, results: queue.Queue | None):
        from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

        # the per-file writer without its decorator, which turns the garbage collector off for
        # the whole process (meant for a forked writer, not a thread beside training)
        write = FileSystemWriterAsync.write_preloaded_data.__wrapped__

        def write_and_hash(index: int) -> tuple:
            local, count = queue.Queue(), _Count()
            write(transforms, index, buckets[index], local, count, True)
            _, outcome = local.get()
            if isinstance(outcome, Exception):
                raise outcome
            wrote = time.perf_counter()
            return outcome, wrote, file_digest(Path(buckets[index][0]))

        try:
            start = time.perf_counter()
            with ThreadPoolExecutor(max(len(buckets), 1), thread_name_prefix="checkpoint-writer") as pool:
                files = list(pool.map(write_and_hash, range(len(buckets))))
            hashed, wrote = time.perf_counter(), max((w for _, w, _ in files), default=start)
            paths = [Path(path) for path, _, _ in buckets]
            self.written = WrittenFiles({str(p): digest for p, (_, _, digest) in zip(paths, files)},
                                        sum(p.stat().st_size for p in paths), wrote - start, hashed - wrote)
            if results is not None:
                results.put({index: outcome for index, (outcome, _, _) in enumerate(files)})
        except BaseException as e:  # reported by finish(), on every rank
            self.error = e
            if results is not None:
                results.put(e)


def _first_error(own: BaseException | None) -> str:
    """'rank <r>: <its error>' of the lowest rank whose write failed, on every rank. Collective."""
    errors = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(errors, None if own is None else repr(own))
    rank, error = next((rank, error) for rank, error in enumerate(errors) if error is not None)
    return f"rank {rank}: {error}"


def state_bytes(modules: list, optimizer) -> int:
    """Bytes of what a distributed checkpoint of `modules` and `optimizer` (megatron-core's, a
    chained one included) stages: the parameters and the optimizer's tensors (main copies,
    moments), each tensor once."""
    tensors = [p for module in modules for p in module.parameters()]
    for wrapper in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = wrapper.optimizer
        tensors += [p for group in inner.param_groups for p in group["params"]]
        tensors += [t for state in inner.state.values() for t in state.values() if torch.is_tensor(t)]
    unique = {(t.data_ptr(), t.numel() * t.element_size()) for t in tensors}
    return sum(_aligned(nbytes) for _, nbytes in unique)


def _aligned(nbytes: int) -> int:
    """nbytes rounded up to 64: where the next buffer in the block starts, aligned for any dtype."""
    return -(-nbytes // 64) * 64


class _Count:
    """What the per-file writer signals its end on (a JoinableQueue between processes)."""

    def get(self):
        pass

    def task_done(self):
        pass
