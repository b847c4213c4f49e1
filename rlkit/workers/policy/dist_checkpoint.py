"""Megatron distributed checkpoints, saved without helper processes.

megatron-core's file writer hands each rank's write results over through a queue of a
multiprocessing Manager: a server process (and Python's resource tracker) that it starts on a
rank's first save and that outlives a worker killed with SIGKILL. rlkit saves synchronously, in
the worker's own process, so an in-process queue carries the same results and no process is
started."""

import queue


def save(sharded_state_dict: dict, directory: str) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # the writer's lazily created queue; set here, it is never created
    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, directory)
